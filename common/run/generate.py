"""Completions from a model folder on either backend: ``twinseq generate`` and ``twinseq chat``.

``Generator(path, backend="torch"|"jax")`` reads a model folder once, then completes prompts with the backend's
``complete_prompts`` (a KV cache; greedy at temperature 0). The folder is one of:

- a Hugging Face model folder (``config.json`` + safetensors: a run's ``final/``), read by the backend's
  ``load_pretrained``;
- a PEFT adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``: ``final/`` of a ``--use-peft``
  run). Its base is ``base_model_name_or_path`` (a folder, or a Hub id in the local cache), or ``base_model``;
  when that path is gone (a moved run), the folder's own ``base/``, and the log says so. The adapters are folded
  into the base's weights in numpy (``common.models.peft.merge_adapters``, float64), once for both backends, so
  the two backends run the same merged weights.

The tokenizer is the folder's own ``tokenizer.json`` (a run's ``final/`` holds it), else its base's, else the one
passed. A prompt is encoded as training encodes it: with ``chat`` (the default when the tokenizer has a chat
template) as a user message rendered by the template with the generation prompt
(``TwinseqTokenizer.render_prompt``, the text a GRPO rollout starts from); without, as ``[bos] + encode(text)``,
the start of a plain-text row. A completion is cut after its first EOS and decoded without special tokens.

>>> escape_line("def f():\\n    return 1")
'def f():\\\\n    return 1'
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any, Iterable, Iterator, Optional, Sequence, Union

import numpy as np

from twinseq.common.backend import default_backend, load_backend
from twinseq.common.config import BACKENDS
from twinseq.common.data.tokenizer import TwinseqTokenizer, load_tokenizer
from twinseq.common.errors import CheckpointError, ConfigError
from twinseq.common.models.hf_folder import (
    CONFIG_FILE,
    HUB_ID,
    check_tokenizer_fits,
    hub_cache_folder,
    read_hf_checkpoint,
    read_json,
    read_model_config,
)
from twinseq.common.models.peft import ADAPTER_CONFIG_FILE, merge_adapters, read_adapters
from twinseq.common.objectives.grpo import completion_mask

logger = logging.getLogger(__name__)

TOKENIZER_FILE = "tokenizer.json"
Prompt = Union[str, Sequence[dict]]
"""A plain text, or a conversation (``[{"role": "user", "content": ...}, ...]``, chat mode only)."""


@dataclass(frozen=True)
class ModelFolder:
    """Where a model's parts are: ``weights`` (a model folder), ``adapters`` (None without), ``tokenizer``."""

    weights: Path
    adapters: Optional[Path]
    tokenizer: Path


@dataclass
class Completion:
    """One prompt's completion: its text (special tokens dropped), its ids (the EOS included), and why it stopped:
    ``"eos"`` or ``"length"`` (``max_new_tokens`` reached)."""

    prompt: str
    completion: str
    completion_ids: list[int]
    finish_reason: str


def _has_tokenizer(folder: Path) -> bool:
    return (folder / TOKENIZER_FILE).is_file()


def _adapter_base(path: Path, base_model: Optional[str]) -> Path:
    """The base model folder of the adapter folder ``path`` (see the module docstring)."""
    named = base_model or read_json(path / ADAPTER_CONFIG_FILE).get("base_model_name_or_path")
    if named and Path(named).is_dir():
        return Path(named)
    own = path / "base"
    if (own / CONFIG_FILE).is_file():
        if named:
            logger.info("adapters %s: base %s is not a folder here; using the adapter folder's own base/", path, named)
        return own
    if named and HUB_ID.fullmatch(str(named)):
        return hub_cache_folder(str(named))
    raise CheckpointError(
        f"{path}: the adapters' base model {named!r} (base_model_name_or_path in {ADAPTER_CONFIG_FILE}) is not a "
        f"folder here, and {path}/base does not exist; pass the base model's folder with --base-model PATH."
    )


def resolve_model_folder(
    path: Union[str, Path], *, base_model: Optional[str] = None, tokenizer: Optional[str] = None
) -> ModelFolder:
    """The parts of the model folder ``path``: a model folder, or an adapter folder and its base."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(
            f"--model {str(path)!r} is not a folder; pass a model folder (config.json + model.safetensors, a run's "
            f"final/) or an adapter folder ({ADAPTER_CONFIG_FILE} + adapter_model.safetensors)."
        )
    if (path / ADAPTER_CONFIG_FILE).is_file():
        weights, adapters = _adapter_base(path, base_model), path
    elif (path / CONFIG_FILE).is_file():
        weights, adapters = path, None
    else:
        hint = f" (did you mean {path / 'final'}?)" if (path / "final").is_dir() else ""
        raise CheckpointError(
            f"{path} holds neither {CONFIG_FILE} (a model folder) nor {ADAPTER_CONFIG_FILE} (an adapter "
            f"folder){hint}; pass the final/ folder of a twinseq run, or another Hugging Face model folder."
        )
    if tokenizer is not None:
        return ModelFolder(weights, adapters, Path(tokenizer))
    found = next((f for f in (path, weights) if _has_tokenizer(f)), None)
    if found is None:
        raise CheckpointError(
            f"{path} has no {TOKENIZER_FILE}"
            + (f", nor has its base {weights}" if weights != path else "")
            + "; pass the tokenizer the model was trained with: --tokenizer PATH (or --tokenizer embedded)."
        )
    return ModelFolder(weights, adapters, found)


def escape_line(text: str) -> str:
    """A completion on one line: backslash, newline and carriage return written as ``\\\\``, ``\\n``, ``\\r``."""
    return text.replace("\\", "\\\\").replace("\n", "\\n").replace("\r", "\\r")


class Generator:
    """A model folder loaded on one backend, with its tokenizer, ready to complete prompts.

    >>> gen = Generator("runs/tiny/final", backend="jax")  # doctest: +SKIP
    >>> gen.complete(["def add(a, b):"], max_new_tokens=8)[0].completion  # doctest: +SKIP
    """

    def __init__(
        self,
        path: Union[str, Path],
        *,
        backend: Optional[str] = None,
        chat: Optional[bool] = None,
        base_model: Optional[str] = None,
        tokenizer: Optional[str] = None,
    ) -> None:
        self.folder = resolve_model_folder(path, base_model=base_model, tokenizer=tokenizer)
        self.tokenizer: TwinseqTokenizer = load_tokenizer(str(self.folder.tokenizer))
        self.chat = bool(self.tokenizer.chat_template) if chat is None else chat
        if self.chat and not self.tokenizer.chat_template:
            raise ConfigError(
                f"--chat: the tokenizer {self.folder.tokenizer} has no chat template; pass --no-chat to complete "
                "the raw text, or --tokenizer with one that has a template."
            )
        self.backend_name = backend or default_backend()
        self.backend = load_backend(self.backend_name)
        cfg = read_model_config(self.folder.weights)
        check_tokenizer_fits(cfg, self.tokenizer.vocab_size, str(self.folder.weights))
        if self.folder.adapters is None:
            self.model = self.backend.load_pretrained(self.folder.weights)
        else:
            cfg, base = read_hf_checkpoint(self.folder.weights)
            peft, adapters = read_adapters(self.folder.adapters, cfg)
            self.model = self.backend.build_model(cfg, merge_adapters(cfg, peft, base, adapters))
        logger.info(
            "generate: %s on %s (%s), tokenizer %s, %s prompts",
            path,
            self.backend_name,
            f"base {self.folder.weights} + adapters" if self.folder.adapters else "model folder",
            self.folder.tokenizer,
            "chat-template" if self.chat else "plain-text",
        )

    def encode(self, prompt: Prompt) -> list[int]:
        """Prompt ids: a conversation (or a text as one user message) through the chat template with the
        generation prompt, or ``[bos] + encode(text)`` without ``chat``."""
        tok = self.tokenizer
        if self.chat:
            messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
            return tok.encode(tok.render_prompt(messages))
        if not isinstance(prompt, str):
            raise ConfigError("a conversation needs its chat template: pass --chat, or a plain-text prompt.")
        ids = ([] if tok.bos_token_id is None else [tok.bos_token_id]) + tok.encode(prompt)
        if not ids:
            raise ConfigError(
                "an empty prompt gives no token to start from (this tokenizer has no BOS); pass some text."
            )
        return ids

    def complete(
        self, prompts: Sequence[Prompt], *, max_new_tokens: int = 64, temperature: float = 0.0, seed: int = 0
    ) -> list[Completion]:
        """One ``Completion`` per prompt, generated together as one left-padded batch."""
        check_sampling(max_new_tokens, temperature)
        tok = self.tokenizer
        ids_NC = np.asarray(
            self.backend.complete_prompts(
                self.model,
                [self.encode(p) for p in prompts],
                max_new_tokens=max_new_tokens,
                temperature=temperature,
                seed=seed,
                eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id,
            )
        )
        mask_NC, truncated_N = completion_mask(ids_NC, tok.eos_token_id, tok.pad_token_id)
        out = []
        for prompt, ids, n, truncated in zip(prompts, ids_NC, mask_NC.sum(axis=1), truncated_N):
            kept = [int(i) for i in ids[:n]]
            text = tok.decode(kept, skip_special_tokens=True)
            shown = prompt if isinstance(prompt, str) else prompt[-1]["content"]
            out.append(Completion(shown, text, kept, "length" if truncated else "eos"))
        return out


def check_sampling(max_new_tokens: int, temperature: float) -> None:
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens {max_new_tokens!r} is not valid; pass an integer >= 1.")
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature >= 0):
        raise ConfigError(
            f"--temperature {temperature!r} is not valid; pass 0 for greedy decoding or a finite value > 0 to sample."
        )


def chat_turns(
    gen: Generator, lines: Iterable[str], *, system: Optional[str] = None, **sampling: Any
) -> Iterator[Completion]:
    """The replies to ``lines``, one per non-empty line. With a chat template the conversation carries on: each
    reply is appended as the assistant's turn before the next line; without one, each line is its own prompt."""
    history: list[dict] = [{"role": "system", "content": system}] if system else []
    for line in lines:
        if not line.strip():
            continue
        if not gen.chat:
            yield gen.complete([line], **sampling)[0]
            continue
        history.append({"role": "user", "content": line})
        reply = gen.complete([history], **sampling)[0]
        history.append({"role": "assistant", "content": reply.completion})
        yield reply


# --------------------------------------------------------------------------------------
# The command line: twinseq generate / twinseq chat
# --------------------------------------------------------------------------------------


class _OneLineParser(argparse.ArgumentParser):
    """argparse's rejections as twinseq's one-line error (exit 2), not a usage block."""

    def error(self, message: str) -> Any:
        raise ConfigError(f"{message}; see `{self.prog} --help`.")


def _parser(prog: str, description: str) -> argparse.ArgumentParser:
    p = _OneLineParser(prog=prog, description=description, allow_abbrev=False)
    p.add_argument(
        "--model", required=True, metavar="FOLDER", help="a model folder (a run's final/) or a PEFT adapter folder"
    )
    p.add_argument("--backend", choices=BACKENDS, default=None, help="default: $TWINSEQ_BACKEND, else torch")
    p.add_argument("--max-new-tokens", type=int, default=64, metavar="N", help="tokens per completion, at most (64)")
    p.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0: greedy (the default); > 0: sample")
    p.add_argument("--seed", type=int, default=0, metavar="S", help="the sampling seed (with --temperature > 0; 0)")
    p.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="wrap each prompt in the tokenizer's chat template (default: when it has one)",
    )
    p.add_argument("--tokenizer", default=None, metavar="PATH", help="default: the model folder's own tokenizer.json")
    p.add_argument(
        "--base-model", default=None, metavar="FOLDER", help="an adapter folder's base (default: adapter_config.json's)"
    )
    p.add_argument("--json", action="store_true", help="one JSON object per completion (text, ids, finish reason)")
    return p


def _write(completion: Completion, as_json: bool, out: IO[str]) -> None:
    out.write((json.dumps(asdict(completion)) if as_json else escape_line(completion.completion)) + "\n")
    out.flush()


def _load(args: argparse.Namespace) -> Generator:
    return Generator(
        args.model, backend=args.backend, chat=args.chat, base_model=args.base_model, tokenizer=args.tokenizer
    )


def generate_main(argv: Sequence[str]) -> int:
    """``twinseq generate --model FOLDER --prompt TEXT [--prompt TEXT ...]``: one line per prompt on stdout."""
    parser = _parser("twinseq generate", "Complete prompts with a model folder; one line per prompt on stdout.")
    parser.add_argument(
        "--prompt", action="append", required=True, metavar="TEXT", help="a prompt (repeat the flag for more)"
    )
    args = parser.parse_args(list(argv))
    check_sampling(args.max_new_tokens, args.temperature)
    gen = _load(args)
    for completion in gen.complete(
        args.prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed
    ):
        _write(completion, args.json, sys.stdout)
    return 0


def _stdin_lines(stream: IO[str]) -> Iterator[str]:
    interactive = stream.isatty()
    while True:
        if interactive:
            sys.stderr.write("> ")
            sys.stderr.flush()
        line = stream.readline()
        if not line:
            return
        yield line.rstrip("\r\n")


def chat_main(argv: Sequence[str]) -> int:
    """``twinseq chat --model FOLDER``: a reply on stdout for each line read from stdin, until EOF."""
    parser = _parser("twinseq chat", "Chat with a model folder: one reply per stdin line, until EOF (Ctrl-D).")
    parser.add_argument(
        "--system", default=None, metavar="TEXT", help="a system message at the start of the conversation"
    )
    args = parser.parse_args(list(argv))
    check_sampling(args.max_new_tokens, args.temperature)
    gen = _load(args)
    if args.system and not gen.chat:
        raise ConfigError("--system needs the chat template; drop --no-chat, or drop --system.")
    sampling = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed)
    for reply in chat_turns(gen, _stdin_lines(sys.stdin), system=args.system, **sampling):
        _write(reply, args.json, sys.stdout)
    return 0
