"""Tokenizers without torch: the embedded byte-level BPE, and any local Hugging Face tokenizer dir.

``load_tokenizer("embedded")`` trains (once, a few seconds, then cached) a byte-level BPE
with ``vocab_size`` 8192 on the embedded stdlib corpus (``twinseq.common.corpus``). It is
saved as a standard Hugging Face tokenizer folder (``tokenizer.json`` +
``tokenizer_config.json`` with a ``chat_template``), so ``tokenizers.Tokenizer.from_file``
and ``transformers.AutoTokenizer.from_pretrained`` both load it.

Special tokens of the embedded tokenizer: ``<pad>``=0, ``<s>``=1 (bos), ``</s>``=2 (eos),
then the chat role markers ``<|system|>``, ``<|user|>``, ``<|assistant|>``.

``load_tokenizer(path)`` loads any local folder holding a ``tokenizer.json``; a Hub name is
resolved only from the local Hugging Face cache, never downloaded.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import shutil
from importlib import resources
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from twinseq.common import corpus
from twinseq.common.errors import DataError, DataTypeError

logger = logging.getLogger(__name__)

TOKENIZER_VERSION = "1"
EMBEDDED_VOCAB_SIZE = 8192
PAD, BOS, EOS = "<pad>", "<s>", "</s>"
SPECIAL_TOKENS = (PAD, BOS, EOS, "<|system|>", "<|user|>", "<|assistant|>")
MODEL_MAX_LENGTH = 4096


VALID_ROLES = ("system", "user", "assistant")
# Private-use code points bracket the output of {% generation %} blocks while rendering; they
# are removed afterwards and their positions become the assistant character spans.
_GEN_OPEN, _GEN_CLOSE = "\ue000", "\ue001"
_GENERATION_TAG = re.compile(r"{%-?\s*generation\s*-?%}")


def default_chat_template() -> str:
    """The chat template shipped with twinseq (``common/chat_template.jinja``)."""
    return resources.files("twinseq.common").joinpath("chat_template.jinja").read_text()


# --------------------------------------------------------------------------------------
# Chat rendering (jinja2, the same sandbox settings as transformers)
# --------------------------------------------------------------------------------------


def row_name(index: int) -> str:
    """How an error names a row: its 0-based index and, for a JSONL file, its 1-based line."""
    return f"row {index} (line {index + 1} of a JSONL file)"


def validate_messages(messages: Any, index: Optional[int] = None) -> None:
    """Raise ``TypeError``/``ValueError`` naming the bad entry of a ``messages`` list."""
    where = "" if index is None else f"{row_name(index)}: "
    if not isinstance(messages, (list, tuple)) or not messages:
        raise DataTypeError(f"{where}'messages' must be a non-empty list of {{'role', 'content'}} dicts, got "
                            f"{type(messages).__name__} {str(messages)[:80]!r}.")
    for j, msg in enumerate(messages):
        if not isinstance(msg, dict) or "role" not in msg or "content" not in msg:
            raise DataTypeError(f"{where}messages[{j}] must be a dict with 'role' and 'content', got {str(msg)[:80]!r}.")
        if msg["role"] not in VALID_ROLES:
            raise DataError(f"{where}messages[{j}]['role']={msg['role']!r} is not a known role; use one of "
                            f"{VALID_ROLES} (rename e.g. 'human'->'user', 'gpt'->'assistant').")
        if not isinstance(msg["content"], str):
            raise DataTypeError(f"{where}messages[{j}]['content'] must be a string, got "
                                f"{type(msg['content']).__name__} {str(msg['content'])[:80]!r}; flatten "
                                f"multimodal content to text.")


def _generation_extension():
    from jinja2 import nodes
    from jinja2.ext import Extension

    class GenerationMarker(Extension):
        """``{% generation %}...{% endgeneration %}``: brackets the assistant text with markers."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_mark"), [], [], body).set_lineno(lineno)

        def _mark(self, caller):
            return _GEN_OPEN + caller() + _GEN_CLOSE

    return GenerationMarker


@functools.lru_cache(maxsize=16)
def _compile(template: str):
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_generation_extension(), "jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template)


def _strip_markers(text: str) -> tuple[str, list[tuple[int, int]]]:
    out, spans, pos, start = [], [], 0, None
    for piece in re.split(f"([{_GEN_OPEN}{_GEN_CLOSE}])", text):
        if piece == _GEN_OPEN:
            start = pos
        elif piece == _GEN_CLOSE:
            assert start is not None, "unbalanced generation markers"
            spans.append((start, pos))
            start = None
        else:
            out.append(piece)
            pos += len(piece)
    return "".join(out), spans


def _render(template: str, messages: Sequence[dict], add_generation_prompt: bool, **special: str) -> str:
    return _compile(template).render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                                     **special)


def render_chat(template: str, messages: Sequence[dict], add_generation_prompt: bool = False,
                **special: str) -> tuple[str, list[tuple[int, int]]]:
    """Render ``messages``; returns the text and the character spans of the assistant turns.

    With ``{% generation %}`` blocks in the template, the spans are their output. Without
    them, the span of assistant message i is the text that message i adds after the
    generation prompt: ``render(m[:i+1])`` minus ``render(m[:i], add_generation_prompt=True)``.
    """
    for msg in messages:
        if _GEN_OPEN in msg["content"] or _GEN_CLOSE in msg["content"]:
            raise DataError("message content holds the private-use characters U+E000/U+E001, which "
                            "twinseq reserves for chat rendering; remove them from the data.")
    text, spans = _strip_markers(_render(template, messages, add_generation_prompt, **special))
    if _GENERATION_TAG.search(template):
        return text, spans
    return text, _prefix_spans(template, messages, text, **special)


@functools.lru_cache(maxsize=16)
def _log_prefix_mode(template: str) -> None:
    logger.info("the chat template has no {%% generation %%} block; assistant tokens are located by "
                "rendering each conversation prefix (template starts %r)", template[:60])


def _prefix_spans(template: str, messages: Sequence[dict], text: str, **special: str) -> list[tuple[int, int]]:
    if any(m["role"] == "assistant" for m in messages):
        _log_prefix_mode(template)
    spans = []
    for i, msg in enumerate(messages):
        if msg["role"] != "assistant":
            continue
        before, _ = _strip_markers(_render(template, messages[:i], True, **special))
        upto, _ = _strip_markers(_render(template, messages[: i + 1], False, **special))
        if not (upto.startswith(before) and text.startswith(upto)):
            raise DataError("the chat template renders a conversation differently from its prefixes, so "
                            "assistant tokens cannot be located; add {% generation %}...{% endgeneration %} "
                            "around the assistant content in the template.")
        spans.append((len(before), len(upto)))
    return spans


# --------------------------------------------------------------------------------------
# The embedded tokenizer
# --------------------------------------------------------------------------------------


def train_bpe(texts: Sequence[str], vocab_size: int = EMBEDDED_VOCAB_SIZE) -> Tokenizer:
    """A byte-level BPE with ``SPECIAL_TOKENS`` at ids 0..5, trained on ``texts`` in order.

    Deterministic: the same texts give a byte-identical ``tokenizer.json``.
    """
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, show_progress=False,
                                  special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    # HF convention (Llama): tokenizer(text) prepends bos; twinseq's encode() does not.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B:1", special_tokens=[(BOS, 1)])
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))
    return tok


def _embedded_config() -> dict[str, Any]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "unk_token": None,
        "additional_special_tokens": list(SPECIAL_TOKENS[3:]),
        "model_max_length": MODEL_MAX_LENGTH,
        "padding_side": "right",
        "clean_up_tokenization_spaces": False,
        "chat_template": default_chat_template(),
    }


def embedded_tokenizer_dir(vocab_size: int = EMBEDDED_VOCAB_SIZE) -> Path:
    """The cached folder of the embedded tokenizer, trained on first use.

    Keyed by the Python version and the corpus content hash, so a Python upgrade whose
    docstrings changed gets its own tokenizer.
    """
    records = corpus.collect_docstrings()
    key = f"{corpus.python_tag()}-{corpus.content_hash(records)}-v{TOKENIZER_VERSION}-{vocab_size}"
    folder = corpus.cache_root() / f"tokenizer-{key}"
    if (folder / "tokenizer.json").is_file() and (folder / "tokenizer_config.json").is_file():
        return folder
    logger.info("training the embedded byte-level BPE tokenizer (vocab %d) into %s", vocab_size, folder)
    tok = train_bpe(corpus.tokenizer_training_texts(records), vocab_size)
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(f"the embedded corpus only supports {tok.get_vocab_size()} BPE tokens, not "
                           f"vocab_size={vocab_size}; lower vocab_size.")
    staging = folder.with_name(f".{folder.name}.{os.getpid()}.tmp")
    shutil.rmtree(staging, ignore_errors=True)
    TwinseqTokenizer(tok, _embedded_config(), name_or_path="embedded").save_pretrained(staging)
    try:
        staging.rename(folder)
    except OSError:  # another process finished first; its files are identical
        shutil.rmtree(staging, ignore_errors=True)
    return folder


# --------------------------------------------------------------------------------------
# The wrapper
# --------------------------------------------------------------------------------------


def _token_text(value: Any) -> Optional[str]:
    """``"<s>"`` or ``{"content": "<s>", ...}`` (older configs) -> ``"<s>"``."""
    if isinstance(value, dict):
        return value.get("content")
    return value


class TwinseqTokenizer:
    """A ``tokenizers.Tokenizer`` plus its special tokens and chat template; no torch.

    ``encode`` never adds special tokens unless asked: the data pipeline adds bos and eos
    itself, so that prompt and completion can be tokenised separately.
    """

    def __init__(self, tokenizer: Tokenizer, config: dict[str, Any], name_or_path: str = ""):
        self._tok = tokenizer
        self.config = dict(config)
        self.name_or_path = name_or_path
        self.chat_template: Optional[str] = config.get("chat_template")
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.pad_token = _token_text(config.get("pad_token"))
        if self.pad_token is None and self.eos_token is not None:
            logger.info("tokenizer %s has no pad token; padding with the eos token %r", name_or_path, self.eos_token)
            self.pad_token = self.eos_token

    @property
    def backend(self) -> Tokenizer:
        """The underlying ``tokenizers.Tokenizer``."""
        return self._tok

    def _id(self, token: Optional[str]) -> Optional[int]:
        return None if token is None else self._tok.token_to_id(token)

    @property
    def bos_token_id(self) -> Optional[int]:
        return self._id(self.bos_token)

    @property
    def eos_token_id(self) -> Optional[int]:
        return self._id(self.eos_token)

    @property
    def pad_token_id(self) -> int:
        pad = self._id(self.pad_token)
        return 0 if pad is None else pad

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included (the embedding needs at least this many rows)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def __len__(self) -> int:
        return self.vocab_size

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """``"def"`` -> ``[ids]``; special tokens written in the text are recognised."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = False) -> list[list[int]]:
        """``encode`` over many texts, in parallel threads inside ``tokenizers``."""
        fast = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)
        return [e.ids for e in fast(list(texts), add_special_tokens=add_special_tokens)]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: Sequence[dict], add_generation_prompt: bool = False) -> tuple[str, list]:
        """The chat as text, and the character spans ``[(start, end)]`` of the assistant turns."""
        if not self.chat_template:
            raise DataError(f"tokenizer {self.name_or_path!r} has no chat_template; add one to its "
                            f"tokenizer_config.json, or use prompt/completion or text data.")
        validate_messages(messages)
        return render_chat(self.chat_template, messages, add_generation_prompt=add_generation_prompt,
                           bos_token=self.bos_token or "", eos_token=self.eos_token or "")

    def apply_chat_template(self, messages: Sequence[dict],
                            add_generation_prompt: bool = False) -> tuple[list[int], list[int]]:
        """Messages -> ``(input_ids, assistant_mask)``; mask is 1 on assistant tokens (eos included).

        >>> tok.apply_chat_template([{"role": "user", "content": "Hi"},
        ...                          {"role": "assistant", "content": "Yo"}])  # doctest: +SKIP
        ([1, 4, ..., 2, 5, ..., 2], [0, 0, ..., 0, 0, ..., 1, 1])
        """
        text, spans = self.render_chat(messages, add_generation_prompt)
        enc = self._tok.encode(text, add_special_tokens=False)
        offsets = np.asarray(enc.offsets, dtype=np.int64).reshape(-1, 2)
        mask = np.zeros(len(enc.ids), dtype=np.int64)
        for start, end in spans:
            # overlap, not containment: a token may start with whitespace just before the span
            mask |= (offsets[:, 0] < end) & (offsets[:, 1] > start)
        return list(enc.ids), mask.tolist()

    def save_pretrained(self, directory: str | os.PathLike) -> list[str]:
        """Write ``tokenizer.json`` and ``tokenizer_config.json``; returns the paths written."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        tok_path, cfg_path = directory / "tokenizer.json", directory / "tokenizer_config.json"
        self._tok.save(str(tok_path))
        config = {**self.config, "chat_template": self.chat_template}
        cfg_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        return [str(tok_path), str(cfg_path)]

    def __repr__(self) -> str:
        return (f"TwinseqTokenizer({self.name_or_path!r}, vocab_size={self.vocab_size}, "
                f"bos={self.bos_token_id}, eos={self.eos_token_id}, pad={self.pad_token_id})")


# --------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------


def _read_config(folder: Path) -> dict[str, Any]:
    config: dict[str, Any] = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):  # later file wins
        path = folder / name
        if path.is_file():
            config.update(json.loads(path.read_text()))
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template}
        config["chat_template"] = named.get("default")
    jinja_file = folder / "chat_template.jinja"
    if not config.get("chat_template") and jinja_file.is_file():
        config["chat_template"] = jinja_file.read_text()
    return config


def _hub_cache_snapshot(name: str) -> Optional[Path]:
    """The newest snapshot of ``name`` in the local Hugging Face cache holding a tokenizer.json."""
    hub_cache = os.environ.get("HF_HUB_CACHE") or os.path.join(
        os.environ.get("HF_HOME") or os.path.expanduser("~/.cache/huggingface"), "hub")
    snapshots = Path(hub_cache) / f"models--{name.replace('/', '--')}" / "snapshots"
    found = sorted(snapshots.glob("*/tokenizer.json"), key=lambda p: p.stat().st_mtime) if snapshots.is_dir() else []
    return found[-1].parent if found else None


def _resolve_folder(name_or_path: str) -> Path:
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if not (path / "tokenizer.json").is_file():
            raise DataError(f"tokenizer_name_or_path={name_or_path!r} is a folder without a tokenizer.json; "
                            f"twinseq needs a fast (tokenizers) tokenizer: save one there with "
                            f"`AutoTokenizer.from_pretrained(...).save_pretrained({str(path)!r})`.")
        return path
    if path.is_file() and path.name == "tokenizer.json":
        return path.parent
    snapshot = _hub_cache_snapshot(name_or_path)
    if snapshot is not None:
        logger.info("tokenizer %r is not a local path; using the local Hugging Face cache copy %s",
                    name_or_path, snapshot)
        return snapshot
    raise DataError(
                    f"tokenizer_name_or_path={name_or_path!r} is neither 'embedded' nor a local folder: expected a "
                    f"directory {str(path.resolve())!r} containing tokenizer.json (and tokenizer_config.json). "
                    f"twinseq never downloads from the Hugging Face Hub; download it where there is network "
                    f"(`hf download {name_or_path} --local-dir DIR`) and pass DIR, or use 'embedded'.")


def load_tokenizer(name_or_path: str = "embedded") -> TwinseqTokenizer:
    """``"embedded"`` (the offline default) or a local Hugging Face tokenizer folder."""
    if not isinstance(name_or_path, (str, os.PathLike)):
        raise DataTypeError(f"tokenizer_name_or_path must be a string, got {type(name_or_path).__name__} "
                            f"({name_or_path!r}); pass 'embedded' or a folder path.")
    name_or_path = str(name_or_path)
    folder = embedded_tokenizer_dir() if name_or_path == "embedded" else _resolve_folder(name_or_path)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    return TwinseqTokenizer(tok, _read_config(folder), name_or_path=name_or_path)


__all__ = ["TwinseqTokenizer", "load_tokenizer", "train_bpe", "embedded_tokenizer_dir", "SPECIAL_TOKENS",
           "VALID_ROLES", "default_chat_template"]
