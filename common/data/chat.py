"""Chat templates rendered as transformers renders them, without transformers or torch.

A chat template is Jinja2 source shipped with a tokenizer. Rendering uses the settings of
``transformers``' ``apply_chat_template``: an immutable sandbox, ``trim_blocks`` and
``lstrip_blocks``, the ``loopcontrols`` extension, a ``tojson`` filter that keeps non-ASCII,
and the globals ``raise_exception`` and ``strftime_now``. The same template therefore gives
the same text here and in a Hugging Face pipeline, which is what the model sees at inference.

Three renderings the data pipeline needs:

- ``render_chat``: the text and the character spans of the assistant turns (for
  ``assistant_only_loss``), from ``{% generation %}`` blocks when the template has them,
  else by rendering each conversation prefix.
- ``add_generation_prompt=True``: the prompt a generation call starts from.
- ``continue_final_message=True``: the text stops right after the last message's content, so
  that a completion continues it (a "prefilled" assistant answer), as in transformers.

Every error names the row (``row_name``) and the field, because a data file has many rows
and a template refuses one of them.
"""

from __future__ import annotations

import functools
import json
import logging
import re
from datetime import datetime
from typing import Any, Optional, Sequence

from twinseq.common.errors import DataError, DataTypeError

logger = logging.getLogger(__name__)

VALID_ROLES = ("system", "user", "assistant")
# Roles a template may handle besides the three above; allowed when the template names them.
EXTRA_ROLES = ("tool", "ipython", "developer", "function")
# Private-use code points: the first two bracket the output of {% generation %} blocks, the
# third marks where the final message ends (continue_final_message). All are removed from
# the text afterwards; data that holds them is refused.
_GEN_OPEN, _GEN_CLOSE, _CONTINUE = "\ue000", "\ue001", "\ue002"
_RESERVED = (_GEN_OPEN, _GEN_CLOSE, _CONTINUE)
_GENERATION_TAG = re.compile(r"{%-?\s*generation\s*-?%}")
_RENAMES = "rename e.g. 'human'->'user', 'gpt'/'model'/'bot'->'assistant'"


def row_name(index: int) -> str:
    """How an error names a row: its 0-based index and, for a JSONL file, its 1-based line."""
    return f"row {index} (line {index + 1} of a JSONL file)"


def _where(index: Optional[int]) -> str:
    return "" if index is None else f"{row_name(index)}: "


@functools.lru_cache(maxsize=32)
def template_roles(template: Optional[str]) -> tuple[str, ...]:
    """The roles a template accepts: system, user, assistant, plus each of ``EXTRA_ROLES`` it quotes.

    A template such as ChatML prints any role it is given, so a ShareGPT row with role
    ``human`` would render without complaint and train the model on a role it never sees
    at inference. Checking roles before rendering turns that into an error.

    >>> template_roles("{% if m.role == 'tool' %}...{% endif %}")
    ('system', 'user', 'assistant', 'tool')
    """
    extra = tuple(r for r in EXTRA_ROLES if template and re.search(rf"""['"]{r}['"]""", template))
    return VALID_ROLES + extra


def validate_messages(
    messages: Any, index: Optional[int] = None, field: str = "messages", roles: Sequence[str] = VALID_ROLES
) -> None:
    """Raise ``DataTypeError``/``DataError`` naming the row, the field and the bad message.

    A conversation is a non-empty list of ``{"role": str, "content": str}`` dicts whose roles
    are in ``roles``. ``field`` is the column (``messages``, ``prompt``, ``chosen``, ...).
    """
    where = _where(index)
    if not isinstance(messages, (list, tuple)) or not messages:
        raise DataTypeError(
            f"{where}{field!r} must be a non-empty list of {{'role', 'content'}} dicts, got "
            f"{type(messages).__name__} {str(messages)[:80]!r}; write the conversation as "
            f"[{{'role': 'user', 'content': '...'}}, ...]."
        )
    for j, msg in enumerate(messages):
        if not isinstance(msg, dict) or "role" not in msg or "content" not in msg:
            raise DataTypeError(
                f"{where}{field}[{j}] must be a dict with 'role' and 'content', got {str(msg)[:80]!r}; "
                f"write each message as {{'role': 'user', 'content': '...'}}."
            )
        if not isinstance(msg["role"], str) or msg["role"] not in roles:
            raise DataError(
                f"{where}{field}[{j}]['role']={msg['role']!r} is not a role this chat template "
                f"handles; use one of {tuple(roles)} ({_RENAMES})."
            )
        if not isinstance(msg["content"], str):
            raise DataTypeError(
                f"{where}{field}[{j}]['content'] must be a string, got "
                f"{type(msg['content']).__name__} {str(msg['content'])[:80]!r}; flatten "
                f"multimodal content to text."
            )
        if any(c in msg["content"] for c in _RESERVED):
            raise DataError(
                f"{where}{field}[{j}]['content'] holds one of the private-use characters "
                f"U+E000..U+E002, which twinseq reserves for chat rendering; remove them from the data."
            )


def clean_messages(messages: Sequence[dict]) -> list[dict]:
    """Plain dicts without the null keys that Arrow adds when rows have different message keys.

    A JSONL file where one message has a ``name`` gives every message of the column a
    ``name`` (null where absent); a template testing ``'name' in message`` must not see those.
    """
    return [{k: v for k, v in dict(m).items() if v is not None or k in ("role", "content")} for m in messages]


# --------------------------------------------------------------------------------------
# Compiling and rendering
# --------------------------------------------------------------------------------------


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

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_generation_extension(), "jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as err:
        raise DataError(
            f"the chat template does not compile: {err.message} (template line {err.lineno}: "
            f"{(template.splitlines() or [''])[(err.lineno or 1) - 1][:80]!r}); fix the template in the tokenizer "
            f"folder."
        ) from None


def check_template(template: str) -> None:
    """Raise ``DataError`` if ``template`` is not valid Jinja (called when a tokenizer loads)."""
    _compile(template)


def _render_raw(
    template: str,
    messages: Sequence[dict],
    add_generation_prompt: bool,
    index: Optional[int],
    field: str,
    special: dict[str, str],
) -> str:
    import jinja2

    try:
        return _compile(template).render(
            messages=list(messages), add_generation_prompt=add_generation_prompt, tools=None, documents=None, **special
        )
    except jinja2.TemplateError as err:
        raise DataError(
            f"{_where(index)}the chat template refuses {field!r}: {' '.join(str(err).split())}; fix "
            f"the conversation (or the template)."
        ) from None


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


def _continue_final(
    template: str, messages: Sequence[dict], index: Optional[int], field: str, special: dict[str, str]
) -> str:
    """The text up to the end of the last message's content, with no end-of-turn after it.

    The content gets a marker and a space appended; the text is cut at the marker. If the
    template trimmed the space, it trims message ends, so the kept text is right-stripped
    too (the rule of transformers' ``continue_final_message``).
    """
    last = {**messages[-1], "content": messages[-1]["content"] + _CONTINUE + " "}
    text, _ = _strip_markers(_render_raw(template, [*messages[:-1], last], False, index, field, special))
    cut = text.rfind(_CONTINUE)
    if cut < 0:
        raise DataError(
            f"{_where(index)}the chat template drops the content of the last message of {field!r}, so "
            f"a completion cannot continue it; end {field!r} with a user message instead."
        )
    return text[:cut] if text.startswith(" ", cut + 1) else text[:cut].rstrip()


def render_text(
    template: str,
    messages: Sequence[dict],
    *,
    add_generation_prompt: bool = False,
    continue_final_message: bool = False,
    index: Optional[int] = None,
    field: str = "messages",
    **special: str,
) -> str:
    """The rendered conversation as one string (``tokenize=False`` in transformers)."""
    if continue_final_message:
        if add_generation_prompt:
            raise DataError(
                "continue_final_message=True and add_generation_prompt=True exclude each other; "
                "set one of them to False."
            )
        return _continue_final(template, messages, index, field, special)
    text, _ = _strip_markers(_render_raw(template, messages, add_generation_prompt, index, field, special))
    return text


def render_chat(
    template: str,
    messages: Sequence[dict],
    add_generation_prompt: bool = False,
    index: Optional[int] = None,
    field: str = "messages",
    **special: str,
) -> tuple[str, list[tuple[int, int]]]:
    """Render ``messages``; returns the text and the character spans of the assistant turns.

    With ``{% generation %}`` blocks in the template, the spans are their output. Without
    them, the span of assistant message i is the text that message i adds after the
    generation prompt: ``render(m[:i+1])`` minus ``render(m[:i], add_generation_prompt=True)``.
    """
    text, spans = _strip_markers(_render_raw(template, messages, add_generation_prompt, index, field, special))
    if _GENERATION_TAG.search(template):
        return text, spans
    return text, _prefix_spans(template, messages, text, index, field, special)


@functools.lru_cache(maxsize=16)
def _log_prefix_mode(template: str) -> None:
    logger.info(
        "the chat template has no {%% generation %%} block; assistant tokens are located by "
        "rendering each conversation prefix (template starts %r)",
        template[:60],
    )


def _prefix_spans(
    template: str, messages: Sequence[dict], text: str, index: Optional[int], field: str, special: dict[str, str]
) -> list[tuple[int, int]]:
    if any(m["role"] == "assistant" for m in messages):
        _log_prefix_mode(template)
    spans = []
    for i, msg in enumerate(messages):
        if msg["role"] != "assistant":
            continue
        before, _ = _strip_markers(_render_raw(template, messages[:i], True, index, field, special))
        upto, _ = _strip_markers(_render_raw(template, messages[: i + 1], False, index, field, special))
        if not (upto.startswith(before) and text.startswith(upto)):
            raise DataError(
                f"{_where(index)}the chat template renders {field!r} differently from its prefixes, so "
                f"assistant tokens cannot be located; add {{% generation %}}...{{% endgeneration %}} "
                f"around the assistant content in the template."
            )
        spans.append((len(before), len(upto)))
    return spans


def split_rendered(prompt_text: str, full_text: str, index: Optional[int], field: str) -> str:
    """``full_text`` minus its prefix ``prompt_text``: the completion text of a conversational row.

    Raises naming the row when the rendered prompt is not a prefix of the rendered
    conversation, which happens when a template renders a turn differently depending on
    what follows it (TRL refuses such rows too).
    """
    if full_text.startswith(prompt_text):
        return full_text[len(prompt_text) :]
    fix = ", or put the whole conversation in a 'messages' column" if field == "completion" else ""
    at = next(
        (i for i, (a, b) in enumerate(zip(prompt_text, full_text)) if a != b), min(len(prompt_text), len(full_text))
    )
    raise DataError(
        f"{_where(index)}the chat template renders 'prompt' + {field!r} so that it does not start with "
        f"the rendered prompt (they differ at character {at}: prompt {prompt_text[at : at + 30]!r}, "
        f"conversation {full_text[at : at + 30]!r}): the template renders a turn differently depending "
        f"on what follows it. Fix the template{fix}."
    )


__all__ = [
    "VALID_ROLES",
    "EXTRA_ROLES",
    "row_name",
    "template_roles",
    "validate_messages",
    "clean_messages",
    "check_template",
    "render_text",
    "render_chat",
    "split_rendered",
]
