"""Tokenizers without torch: the embedded byte-level BPE, and any local Hugging Face tokenizer dir.

``load_tokenizer("embedded")`` trains (once, a few seconds, then cached) a byte-level BPE
with ``vocab_size`` 8192 on the embedded stdlib corpus (``twinseq.common.data.corpus``). It is
saved as a standard Hugging Face tokenizer folder (``tokenizer.json`` +
``tokenizer_config.json`` with a ``chat_template``), so ``tokenizers.Tokenizer.from_file``
and ``transformers.AutoTokenizer.from_pretrained`` both load it.

Special tokens of the embedded tokenizer: ``<pad>``=0, ``<s>``=1 (bos), ``</s>``=2 (eos),
then the chat role markers ``<|system|>``, ``<|user|>``, ``<|assistant|>``.

``load_tokenizer(path)`` loads any local folder holding a ``tokenizer.json``; a Hub name is
resolved only from the local Hugging Face cache, never downloaded. The folder is read as
``transformers.AutoTokenizer`` reads it, so a conversation renders to the same ids here and
at inference:

- special tokens (bos, eos, pad, ...) from ``tokenizer_config.json``; ``special_tokens_map.json``
  overrides them only in older saves without ``added_tokens_decoder``. A special token that
  is not in the vocabulary is refused. No pad token: pad with eos (logged), as TRL does.
- the chat template from ``chat_template.jinja`` (and ``additional_chat_templates/``) when
  present, else from ``tokenizer_config.json``; of a list of named templates, ``default``.
  Chat rendering itself is ``twinseq.common.data.chat``.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import shutil
import tempfile
from importlib import resources
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from twinseq.common.data import corpus
from twinseq.common.data.chat import (
    VALID_ROLES,
    check_template,
    clean_messages,
    render_chat,
    render_text,
    row_name,
    split_rendered,
    template_roles,
    validate_messages,
)
from twinseq.common.errors import DataError, DataTypeError

logger = logging.getLogger(__name__)

TOKENIZER_VERSION = "1"
EMBEDDED_VOCAB_SIZE = 8192
PAD, BOS, EOS = "<pad>", "<s>", "</s>"
SPECIAL_TOKENS = (PAD, BOS, EOS, "<|system|>", "<|user|>", "<|assistant|>")
MODEL_MAX_LENGTH = 4096


def default_chat_template() -> str:
    """The chat template shipped with twinseq (``common/chat_template.jinja``)."""
    return resources.files("twinseq.common.data").joinpath("chat_template.jinja").read_text()


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
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer=trainer)
    # HF convention (Llama): tokenizer(text) prepends bos; twinseq's encode() does not.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B:1", special_tokens=[(BOS, 1)]
    )
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))
    return tok


def _embedded_config() -> dict[str, Any]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "unk_token": None,
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
        raise RuntimeError(
            f"the embedded corpus only supports {tok.get_vocab_size()} BPE tokens, not "
            f"vocab_size={vocab_size}; lower vocab_size."
        )
    staging = folder.with_name(f".{folder.name}.{os.getpid()}.tmp")
    shutil.rmtree(staging, ignore_errors=True)
    TwinseqTokenizer(tok, _embedded_config(), name_or_path="embedded").save_pretrained(staging)
    try:
        staging.rename(folder)
    except OSError:  # another process finished first; its files are identical
        shutil.rmtree(staging, ignore_errors=True)
    return folder


# The wrapper
# --------------------------------------------------------------------------------------


def _token_text(value: Any) -> Optional[str]:
    """``"<s>"`` or ``{"content": "<s>", ...}`` (older configs) -> ``"<s>"``."""
    if isinstance(value, dict):
        return value.get("content")
    return value


_PROBE = "Hello world"  # any text: the post-processor's template is the same around every one

# The special tokens transformers hands to a chat template (its ``special_tokens_map``).
_TEMPLATE_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class TwinseqTokenizer:
    """A ``tokenizers.Tokenizer`` plus its special tokens and chat template; no torch.

    ``encode`` never adds special tokens unless asked: the data pipeline adds bos and eos
    itself for plain text, and a chat template writes them for conversations.

    ``chat_template`` is the tokenizer's own template (``tokenizer_config.json`` or
    ``chat_template.jinja``); ``chat_template_source`` says where it came from.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        config: dict[str, Any],
        name_or_path: str = "",
        chat_template_source: str = "tokenizer_config.json",
        no_template_reason: Optional[str] = None,
    ):
        self._tok = tokenizer
        self.config = dict(config)
        self.name_or_path = name_or_path
        self.chat_template: Optional[str] = config.get("chat_template")
        self.chat_template_source = chat_template_source if self.chat_template else None
        self._no_template_reason = no_template_reason
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.pad_token = _token_text(config.get("pad_token"))
        self._check_special_tokens()
        if self.pad_token is None and self.eos_token is not None:
            logger.info(
                "tokenizer %s has no pad token; padding with the eos token %r (id %s), as TRL does",
                name_or_path or "(unnamed)",
                self.eos_token,
                self.eos_token_id,
            )
            self.pad_token = self.eos_token
        elif self.pad_token is None:
            logger.info(
                "tokenizer %s has neither a pad nor an eos token; padding with id 0 (padding positions "
                "are masked out of attention and loss, so the id only fills space)",
                name_or_path,
            )

    def _check_special_tokens(self) -> None:
        for name in _TEMPLATE_TOKENS:
            token = _token_text(self.config.get(name))
            if isinstance(token, str) and self._tok.token_to_id(token) is None:
                raise DataError(
                    f"tokenizer {self.name_or_path!r}: {name}={token!r} (tokenizer_config.json or "
                    f"special_tokens_map.json) is not in the vocabulary of tokenizer.json; fix the "
                    f"token name, or add the token to tokenizer.json."
                )

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

    @functools.cached_property
    def text_affixes(self) -> tuple[list[int], list[int]]:
        """``(before, after)``: the special ids ``tokenizer(text)`` puts around a text, as transformers (5.x) reads a
        ``tokenizer.json`` folder: what its post-processor adds (Llama 3's ``<|begin_of_text|>`` in front, nothing
        for Qwen's or GPT-2's, whatever ``bos_token`` the config names), none without one. A chat template writes
        its own instead."""
        plain = self._tok.encode(_PROBE, add_special_tokens=False).ids
        full = self._tok.encode(_PROBE, add_special_tokens=True).ids
        for start in range(len(full) - len(plain) + 1):
            if full[start : start + len(plain)] == plain:
                return full[:start], full[start + len(plain) :]
        raise DataError(
            f"tokenizer {self.name_or_path!r}: its post-processor changes the text's own ids ({plain} -> {full}), so "
            f"the special tokens it adds cannot be told apart; use a tokenizer.json whose post-processor only adds "
            f"tokens around the text (TemplateProcessing)."
        )

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """``"def"`` -> ``[ids]``; special tokens written in the text are recognised."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = False) -> list[list[int]]:
        """``encode`` over many texts, in parallel threads inside ``tokenizers``."""
        fast = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)
        return [e.ids for e in fast(list(texts), add_special_tokens=add_special_tokens)]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    # ----------------------------------------------------------------- chat templates

    @property
    def roles(self) -> tuple[str, ...]:
        """The message roles the chat template handles (``twinseq.common.data.chat.template_roles``)."""
        return template_roles(self.chat_template)

    def _template(self) -> str:
        if not self.chat_template:
            reason = self._no_template_reason or "has no chat_template"
            raise DataError(
                f"tokenizer {self.name_or_path!r} {reason}; add one to its tokenizer_config.json (or "
                f"a chat_template.jinja file next to it), or use prompt/completion or text data."
            )
        return self.chat_template

    def template_kwargs(self) -> dict[str, str]:
        """The special tokens a template sees, as transformers passes them (``bos_token``, ...)."""
        out = {"bos_token": "", "eos_token": ""}
        for name in _TEMPLATE_TOKENS:
            token = _token_text(self.config.get(name))
            if isinstance(token, str):
                out[name] = token
        return out

    def validate_messages(self, messages: Any, index: Optional[int] = None, field: str = "messages") -> list[dict]:
        """Check a conversation against the template's roles; returns it as plain dicts."""
        validate_messages(messages, index=index, field=field, roles=self.roles)
        return clean_messages(messages)

    def render_chat(
        self,
        messages: Sequence[dict],
        add_generation_prompt: bool = False,
        index: Optional[int] = None,
        field: str = "messages",
    ) -> tuple[str, list]:
        """The chat as text, and the character spans ``[(start, end)]`` of the assistant turns."""
        template = self._template()
        messages = self.validate_messages(messages, index, field)
        return render_chat(
            template,
            messages,
            add_generation_prompt=add_generation_prompt,
            index=index,
            field=field,
            **self.template_kwargs(),
        )

    def render_text(
        self,
        messages: Sequence[dict],
        add_generation_prompt: bool = False,
        continue_final_message: bool = False,
        index: Optional[int] = None,
        field: str = "messages",
    ) -> str:
        """The chat as text (transformers' ``apply_chat_template(..., tokenize=False)``)."""
        template = self._template()
        messages = self.validate_messages(messages, index, field)
        return render_text(
            template,
            messages,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            index=index,
            field=field,
            **self.template_kwargs(),
        )

    def render_prompt(self, prompt: Sequence[dict], index: Optional[int] = None) -> str:
        """The prompt as a generation call sees it: with the generation prompt, or, when it ends with
        an assistant message, stopping inside that message so that the completion continues it."""
        prompt = self.validate_messages(prompt, index, "prompt")
        continues = prompt[-1]["role"] == "assistant"
        return self.render_text(
            prompt, add_generation_prompt=not continues, continue_final_message=continues, index=index, field="prompt"
        )

    def render_completion(
        self,
        prompt: Sequence[dict],
        completion: Sequence[dict],
        prompt_text: str,
        index: Optional[int] = None,
        field: str = "completion",
    ) -> str:
        """The rendered ``prompt + completion`` minus ``prompt_text`` (``render_prompt(prompt)``)."""
        prompt = self.validate_messages(prompt, index, "prompt")
        completion = self.validate_messages(completion, index, field)
        full_text = self.render_text(prompt + completion, index=index, field=field)
        return split_rendered(prompt_text, full_text, index, field)

    def render_prompt_completion(
        self, prompt: Sequence[dict], completion: Sequence[dict], index: Optional[int] = None, field: str = "completion"
    ) -> tuple[str, str]:
        """Conversational prompt + completion -> ``(prompt_text, completion_text)``.

        ``prompt_text`` is ``render_prompt(prompt)``: exactly the text a generation call starts
        from. ``completion_text`` is the rest of the rendered ``prompt + completion``,
        end-of-turn tokens included. A template that renders the prompt differently when a
        completion follows is refused, naming the row.

        >>> tok.render_prompt_completion([{"role": "user", "content": "Hi"}],
        ...                              [{"role": "assistant", "content": "Yo"}])  # doctest: +SKIP
        ('<s><|user|>\\nHi</s><|assistant|>\\n', 'Yo</s>')
        """
        prompt_text = self.render_prompt(prompt, index)
        return prompt_text, self.render_completion(prompt, completion, prompt_text, index, field)

    def encode_with_spans(
        self, pieces: Sequence[str], spans: Sequence[tuple[int, int]] = ()
    ) -> tuple[list[list[int]], list[int]]:
        """Encode each piece on its own; returns the ids per piece and a 0/1 mask of the tokens
        overlapping ``spans`` (character spans of the concatenated pieces).

        Pieces are encoded separately so that a prompt gives the same ids whatever follows it.
        """
        ids, offsets, shift = [], [], 0
        for enc, piece in zip(self._tok.encode_batch(list(pieces), add_special_tokens=False), pieces):
            ids.append(list(enc.ids))
            offsets.append(np.asarray(enc.offsets, dtype=np.int64).reshape(-1, 2) + shift)
            shift += len(piece)
        return ids, _span_mask(np.concatenate(offsets) if offsets else np.zeros((0, 2), np.int64), spans)

    def apply_chat_template(
        self,
        messages: Sequence[dict],
        add_generation_prompt: bool = False,
        index: Optional[int] = None,
        field: str = "messages",
    ) -> tuple[list[int], list[int]]:
        """Messages -> ``(input_ids, assistant_mask)``; mask is 1 on assistant tokens (eos included).

        >>> tok.apply_chat_template([{"role": "user", "content": "Hi"},
        ...                          {"role": "assistant", "content": "Yo"}])  # doctest: +SKIP
        ([1, 4, ..., 2, 5, ..., 2], [0, 0, ..., 0, 0, ..., 1, 1])
        """
        text, spans = self.render_chat(messages, add_generation_prompt, index=index, field=field)
        enc = self._tok.encode(text, add_special_tokens=False)
        offsets = np.asarray(enc.offsets, dtype=np.int64).reshape(-1, 2)
        return list(enc.ids), _span_mask(offsets, spans)

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
        return (
            f"TwinseqTokenizer({self.name_or_path!r}, vocab_size={self.vocab_size}, "
            f"bos={self.bos_token_id}, eos={self.eos_token_id}, pad={self.pad_token_id})"
        )


def _span_mask(offsets: np.ndarray, spans: Sequence[tuple[int, int]]) -> list[int]:
    mask = np.zeros(len(offsets), dtype=np.int64)
    for start, end in spans:
        # overlap, not containment: a token may start with whitespace just before the span
        mask |= (offsets[:, 0] < end) & (offsets[:, 1] > start)
    return mask.tolist()


# --------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise DataError(f"{path} is not valid JSON ({err}); restore the file from the model's repository.") from None
    if not isinstance(data, dict):
        raise DataTypeError(
            f"{path} holds a {type(data).__name__}, not a JSON object; restore the file from the model's repository."
        )
    return data


def _named_templates(value: Any, folder: Path) -> dict[str, str]:
    """``chat_template`` of tokenizer_config.json: a string, or ``[{"name", "template"}, ...]``."""
    if value is None:
        return {}
    if isinstance(value, str):
        return {"default": value}
    if isinstance(value, dict) and all(isinstance(v, str) for v in value.values()):
        return dict(value)
    if isinstance(value, list) and all(
        isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str) for t in value
    ):
        return {t["name"]: t["template"] for t in value}
    raise DataTypeError(
        f"{folder / 'tokenizer_config.json'}: chat_template must be a string or a list of "
        f"{{'name': ..., 'template': ...}} objects, got {str(value)[:80]!r}; restore the file from the model's "
        f"repository."
    )


def _read_templates(folder: Path, config: dict[str, Any]) -> tuple[dict[str, str], str]:
    """The folder's named chat templates and where they came from.

    As in transformers (4.43 and later): template files (``chat_template.jinja`` as the
    ``default`` one, ``additional_chat_templates/NAME.jinja``) take priority over the
    ``chat_template`` entry of ``tokenizer_config.json``.
    """
    files: dict[str, str] = {}
    if (folder / "chat_template.jinja").is_file():
        files["default"] = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    extra = folder / "additional_chat_templates"
    if extra.is_dir():
        for path in sorted(extra.glob("*.jinja")):
            files[path.stem] = path.read_text(encoding="utf-8")
    if files:
        if config.get("chat_template"):
            logger.info(
                "tokenizer folder %s has template files and a chat_template in tokenizer_config.json; "
                "the files win, as in transformers",
                folder,
            )
        source = "chat_template.jinja" if "default" in files else "additional_chat_templates/"
        return files, f"{folder / source}"
    return _named_templates(config.get("chat_template"), folder), f"{folder / 'tokenizer_config.json'}"


def _read_config(folder: Path) -> tuple[dict[str, Any], str, Optional[str]]:
    """``tokenizer_config.json`` with its special tokens and chosen chat template; the template's
    source; and, when there are templates but none is usable, why.

    ``special_tokens_map.json`` overrides the config only when the config has no
    ``added_tokens_decoder`` (older saves), which is transformers' rule. Of several named
    templates, twinseq uses ``default``, as ``apply_chat_template`` does without a name.
    """
    path = folder / "tokenizer_config.json"
    config = _read_json(path) if path.is_file() else {}
    special = folder / "special_tokens_map.json"
    if special.is_file() and "added_tokens_decoder" not in config:
        config.update(_read_json(special))
    templates, source = _read_templates(folder, config)
    config["chat_template"] = templates.get("default")
    missing = None
    if templates and "default" not in templates:
        missing = (
            f"has chat templates named {sorted(templates)} but none named 'default', which twinseq uses; "
            f"rename the one for training data to 'default'"
        )
    if config["chat_template"]:
        try:
            check_template(config["chat_template"])
        except DataError as err:
            raise DataError(f"{source}: {err}") from None
    return config, source, missing


def _hub_cache_snapshot(name: str) -> Optional[Path]:
    """The newest snapshot of ``name`` in the local Hugging Face cache holding a tokenizer.json."""
    hub_cache = os.environ.get("HF_HUB_CACHE") or os.path.join(
        os.environ.get("HF_HOME") or os.path.expanduser("~/.cache/huggingface"), "hub"
    )
    snapshots = Path(hub_cache) / f"models--{name.replace('/', '--')}" / "snapshots"
    found = sorted(snapshots.glob("*/tokenizer.json"), key=lambda p: p.stat().st_mtime) if snapshots.is_dir() else []
    return found[-1].parent if found else None


def _resolve_folder(name_or_path: str) -> Path:
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if not (path / "tokenizer.json").is_file():
            raise DataError(
                f"tokenizer_name_or_path={name_or_path!r} is a folder without a tokenizer.json; "
                f"twinseq needs a fast (tokenizers) tokenizer: save one there with "
                f"`AutoTokenizer.from_pretrained(...).save_pretrained({str(path)!r})`."
            )
        return path
    if path.is_file() and path.name == "tokenizer.json":
        return path.parent
    snapshot = _hub_cache_snapshot(name_or_path)
    if snapshot is not None:
        logger.info(
            "tokenizer %r is not a local path; using the local Hugging Face cache copy %s", name_or_path, snapshot
        )
        return snapshot
    raise DataError(
        f"tokenizer_name_or_path={name_or_path!r} is neither 'embedded' nor a local folder: expected a "
        f"directory {str(path.resolve())!r} containing tokenizer.json (and tokenizer_config.json). "
        f"twinseq never downloads from the Hugging Face Hub; download it where there is network "
        f"(`hf download {name_or_path} --local-dir DIR`) and pass DIR, or use 'embedded'."
    )


def load_tokenizer(name_or_path: Union[str, os.PathLike[str]] = "embedded") -> TwinseqTokenizer:
    """``"embedded"`` (the offline default) or a local Hugging Face tokenizer folder."""
    if not isinstance(name_or_path, (str, os.PathLike)):
        raise DataTypeError(
            f"tokenizer_name_or_path must be a string, got {type(name_or_path).__name__} "
            f"({name_or_path!r}); pass 'embedded' or a folder path."
        )
    name_or_path = str(name_or_path)
    folder = embedded_tokenizer_dir() if name_or_path == "embedded" else _resolve_folder(name_or_path)
    try:
        hf_tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    except Exception as err:  # noqa: BLE001 - tokenizers raises a bare Exception for a corrupt file
        raise DataError(
            f"{folder / 'tokenizer.json'} cannot be read by the tokenizers library "
            f"({' '.join(str(err).split())[:200]}); restore the file from the model's "
            f"repository."
        ) from None
    config, source, missing = _read_config(folder)
    if name_or_path == "embedded":
        source = "the embedded default (common/chat_template.jinja)"
    tok = TwinseqTokenizer(
        hf_tok, config, name_or_path=name_or_path, chat_template_source=source, no_template_reason=missing
    )
    logger.info(
        "tokenizer %s: vocab %d, bos=%r eos=%r pad=%r, chat template from %s",
        name_or_path,
        tok.vocab_size,
        tok.bos_token,
        tok.eos_token,
        tok.pad_token,
        tok.chat_template_source or "nowhere (none)",
    )
    return tok


def tokenizer_from(obj: Any) -> TwinseqTokenizer:
    """A tokenizer object a Python caller passed (``processing_class``) -> ``TwinseqTokenizer``.

    A ``TwinseqTokenizer`` as is; a ``transformers`` fast tokenizer through its own files (``save_pretrained`` into
    a temporary folder, then ``load_tokenizer``): the same vocabulary, special tokens, post-processor and chat
    template, so ``tokenizer(text)`` and the run tokenise alike. A slow (Python) tokenizer has no
    ``tokenizer.json`` and is refused."""
    if isinstance(obj, TwinseqTokenizer):
        return obj
    if isinstance(obj, (str, os.PathLike)):
        return load_tokenizer(obj)
    if not callable(getattr(obj, "save_pretrained", None)) or not getattr(obj, "is_fast", False):
        raise DataTypeError(
            f"processing_class={type(obj).__name__} is not a tokenizer twinseq can read; pass a transformers fast "
            f"tokenizer (AutoTokenizer.from_pretrained(..., use_fast=True)), a tokenizer folder, or None for the "
            f"model folder's own."
        )
    folder = Path(tempfile.mkdtemp(prefix="twinseq-tokenizer-"))
    try:
        obj.save_pretrained(str(folder))
        tok = load_tokenizer(str(folder))  # everything is read into memory: the folder can go
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    tok.name_or_path = getattr(obj, "name_or_path", "") or "processing_class"
    return tok


__all__ = [
    "TwinseqTokenizer",
    "load_tokenizer",
    "tokenizer_from",
    "train_bpe",
    "embedded_tokenizer_dir",
    "SPECIAL_TOKENS",
    "VALID_ROLES",
    "default_chat_template",
    "row_name",
    "validate_messages",
]
