"""TRL's dataset formats: which one a dataset is, and how a conversational row becomes text.

TRL names a dataset by its *type* (the columns) and its *format* (strings = standard, lists
of ``{"role", "content"}`` messages = conversational). twinseq reads these:

| type | standard (strings) | conversational (message lists) | task |
|---|---|---|---|
| language modeling | ``text`` | ``messages`` | sft |
| prompt-completion | ``prompt``, ``completion`` | ``prompt``, ``completion`` | sft |
| preference | ``prompt``, ``chosen``, ``rejected`` | the same three, as message lists | dpo |
| preference, implicit prompt | ``chosen``, ``rejected`` | ``chosen``, ``rejected`` | dpo |
| pre-tokenised | ``input_ids`` (+ ``completion_mask``) | | sft |

Prompt-only data (``prompt`` alone) and unpaired preference (``prompt``, ``completion``,
``label``) are refused with a message: they train online methods (GRPO, KTO) that twinseq
does not run, and SFT on them would silently train on rejected answers or on nothing.

A conversational prompt is rendered with the generation prompt (or, when it ends with an
assistant message, so that the completion continues that message); the completion is the
rest of the rendered ``prompt + completion``. An implicit prompt is the longest shared
start of ``chosen`` and ``rejected``: characters for strings, whole messages for
conversations. Both follow ``trl.data_utils`` (``apply_chat_template``, ``extract_prompt``).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Union

from twinseq.common.data.chat import row_name
from twinseq.common.errors import DataError

TEXT, MESSAGES, PROMPT_COMPLETION, TOKENIZED = "text", "messages", "prompt_completion", "tokenized"
CONVERSATIONAL_PROMPT_COMPLETION = "conversational_prompt_completion"
PREFERENCE, IMPLICIT_PREFERENCE = "preference", "implicit_preference"
CONVERSATIONAL_PREFERENCE, CONVERSATIONAL_IMPLICIT_PREFERENCE = (
    "conversational_preference",
    "conversational_implicit_preference",
)
CONVERSATIONAL = (
    MESSAGES,
    CONVERSATIONAL_PROMPT_COMPLETION,
    CONVERSATIONAL_PREFERENCE,
    CONVERSATIONAL_IMPLICIT_PREFERENCE,
)

DESCRIPTIONS = {
    TOKENIZED: "pre-tokenised input_ids",
    MESSAGES: "conversational language modeling ('messages', chat template)",
    PROMPT_COMPLETION: "standard prompt-completion ('prompt'/'completion' strings)",
    CONVERSATIONAL_PROMPT_COMPLETION: "conversational prompt-completion ('prompt'/'completion' message lists, "
    "chat template)",
    TEXT: "standard language modeling ('text')",
    PREFERENCE: "standard preference ('prompt'/'chosen'/'rejected' strings)",
    IMPLICIT_PREFERENCE: "standard preference with implicit prompt ('chosen'/'rejected' strings)",
    CONVERSATIONAL_PREFERENCE: "conversational preference ('prompt'/'chosen'/'rejected' message lists, chat template)",
    CONVERSATIONAL_IMPLICIT_PREFERENCE: "conversational preference with implicit prompt ('chosen'/'rejected' "
    "message lists, chat template)",
}

STRING, LIST, OTHER = "string", "list", "other"


def column_kinds(dataset) -> dict[str, str]:
    """``{column: "string" | "list" | "other"}`` from a ``datasets.Dataset``'s features.

    A list column is conversational (each row is then checked to be a list of messages).
    An ``other`` column (numbers, nulls) goes down the string path, whose per-row check
    names the first bad row.
    """
    kinds = {}
    for name, feature in dataset.features.items():
        if isinstance(feature, list) or type(feature).__name__ in ("List", "Sequence", "LargeList"):
            kinds[name] = LIST
        elif getattr(feature, "dtype", None) in ("string", "large_string"):
            kinds[name] = STRING
        else:
            kinds[name] = OTHER
    return kinds


def _conversational(kinds: dict[str, str], fields: Sequence[str]) -> bool:
    """True if every field is a list column. A mix goes down the string path, whose per-row
    check names the first row and field that is not a string."""
    return all(kinds.get(f) == LIST for f in fields)


def detect_sft_format(columns: Sequence[str], kinds: Optional[dict[str, str]] = None) -> str:
    """The SFT format of a dataset with these columns (and column kinds, when known).

    Priority: ``input_ids`` (pre-tokenised) > ``messages`` > ``prompt``/``completion`` >
    ``text``. Without ``kinds`` a prompt/completion dataset counts as standard.
    """
    columns, kinds = list(columns), kinds or {}
    if "input_ids" in columns:
        return TOKENIZED
    if "messages" in columns:
        return MESSAGES
    if "chosen" in columns or "rejected" in columns:
        raise DataError(
            f"the dataset has the columns {sorted(columns)}: that is preference data, which SFT cannot "
            f"train on; use task='dpo' (--task dpo), or keep only the chosen answers as 'completion'."
        )
    if "prompt" in columns or "completion" in columns:
        missing = [c for c in ("prompt", "completion") if c not in columns]
        if missing == ["completion"]:
            raise DataError(
                f"prompt/completion SFT data needs the column(s) ['completion'], but the dataset has "
                f"{sorted(columns)}: prompt-only data (TRL's format for online methods such as GRPO) has "
                f"nothing to learn from; add a 'completion' column (or rename e.g. 'response')."
            )
        if missing:
            raise DataError(
                f"prompt/completion SFT data needs the column(s) {missing}, but the dataset has "
                f"{sorted(columns)}; rename your columns, e.g. {{'prompt': 'Q', 'completion': 'A'}}."
            )
        if "label" in columns and kinds.get("label") == OTHER:
            raise DataError(
                "the dataset has 'prompt', 'completion' and 'label' columns: TRL's unpaired preference "
                "format (KTO), where label=False marks a bad completion; SFT would train on those too. "
                "Keep the rows with label=True and drop the 'label' column."
            )
        conversational = _conversational(kinds, ("prompt", "completion"))
        return CONVERSATIONAL_PROMPT_COMPLETION if conversational else PROMPT_COMPLETION
    if "text" in columns:
        return TEXT
    raise DataError(
        f"SFT data needs a 'messages', a 'prompt'+'completion' or a 'text' column, but the dataset "
        f"has {sorted(columns)}; rename your columns (for preference data with "
        f"prompt/chosen/rejected, use task='dpo')."
    )


def detect_dpo_format(columns: Sequence[str], kinds: Optional[dict[str, str]] = None) -> str:
    """The preference format: explicit or implicit prompt, standard or conversational."""
    columns, kinds = list(columns), kinds or {}
    missing = [c for c in ("chosen", "rejected") if c not in columns]
    if missing:
        raise DataError(
            f"DPO data needs the column(s) {missing}, but the dataset has {sorted(columns)}; rename your "
            f"columns, e.g. {{'prompt': 'Q', 'chosen': 'good A', 'rejected': 'bad A'}} ('prompt' may be "
            f"left out when chosen and rejected both start with it)."
        )
    fields = ("prompt", "chosen", "rejected") if "prompt" in columns else ("chosen", "rejected")
    conversational = _conversational(kinds, fields)
    if "prompt" in columns:
        return CONVERSATIONAL_PREFERENCE if conversational else PREFERENCE
    return CONVERSATIONAL_IMPLICIT_PREFERENCE if conversational else IMPLICIT_PREFERENCE


# --------------------------------------------------------------------------------------
# Implicit prompts
# --------------------------------------------------------------------------------------


def shared_prefix_length(chosen: Sequence, rejected: Sequence) -> int:
    """How many leading items (characters or messages) of ``chosen`` and ``rejected`` form the prompt.

    The longest shared start, less one item if it covers all of the shorter side (so each
    completion keeps at least one item), and for text less a final space, which then starts
    both completions (a BPE word carries its leading space: ``" blue"``).

    >>> shared_prefix_length("The sky is blue.", "The sky is green.")
    10
    >>> shared_prefix_length("Yes.", "Yes. Really.")
    3
    """
    n = 0
    for a, b in zip(chosen, rejected):
        if a != b:
            break
        n += 1
    if n == min(len(chosen), len(rejected)):
        n -= 1
    if n > 0 and isinstance(chosen, str) and chosen[n - 1] == " ":
        n -= 1
    return max(n, 0)


def split_implicit_prompt(chosen: Any, rejected: Any, index: int) -> tuple[Any, Any, Any]:
    """``(prompt, chosen_rest, rejected_rest)`` for an implicit-prompt row; raises if nothing is shared."""
    n = shared_prefix_length(chosen, rejected)
    if n == 0:
        what = "text" if isinstance(chosen, str) else "message"
        raise DataError(
            f"{row_name(index)}: 'chosen' and 'rejected' share no leading {what}, so there is no implicit "
            f"prompt to extract (chosen starts {str(chosen)[:40]!r}, rejected {str(rejected)[:40]!r}); "
            f"add a 'prompt' column, or repeat the prompt at the start of both."
        )
    return chosen[:n], chosen[n:], rejected[n:]


# --------------------------------------------------------------------------------------
# Conversational rows -> text
# --------------------------------------------------------------------------------------


def is_empty_conversation(messages: Sequence[dict]) -> bool:
    """True if every message's content is whitespace: nothing to learn, dropped like an empty completion."""
    return not any(m["content"].strip() for m in messages)


Preference = Union[tuple[str, str, str], str]


def conversational_preference(
    tok, prompt: Any, chosen: Any, rejected: Any, index: int, drop_empty: str, drop_same: str
) -> Preference:
    """One conversational preference row -> ``(prompt_text, chosen_text, rejected_text)`` or a drop reason.

    ``prompt=None`` means an implicit prompt: the messages ``chosen`` and ``rejected`` share.
    ``chosen_text`` is the rendered ``prompt + chosen`` without its rendered-prompt prefix, so
    both completions follow the very same prompt text.
    """
    fields = (
        {"chosen": chosen, "rejected": rejected}
        if prompt is None
        else {"prompt": prompt, "chosen": chosen, "rejected": rejected}
    )
    clean = {name: tok.validate_messages(value, index, name) for name, value in fields.items()}
    if clean["chosen"] == clean["rejected"]:
        return drop_same
    if prompt is None:
        clean["prompt"], clean["chosen"], clean["rejected"] = split_implicit_prompt(
            clean["chosen"], clean["rejected"], index
        )
    if is_empty_conversation(clean["chosen"]) or is_empty_conversation(clean["rejected"]):
        return drop_empty
    prompt_text = tok.render_prompt(clean["prompt"], index)
    return (
        prompt_text,
        tok.render_completion(clean["prompt"], clean["chosen"], prompt_text, index, "chosen"),
        tok.render_completion(clean["prompt"], clean["rejected"], prompt_text, index, "rejected"),
    )


__all__ = [
    "detect_sft_format",
    "detect_dpo_format",
    "column_kinds",
    "shared_prefix_length",
    "split_implicit_prompt",
    "conversational_preference",
    "is_empty_conversation",
    "DESCRIPTIONS",
    "CONVERSATIONAL",
]
