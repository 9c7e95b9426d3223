"""Truncation rules for SFT and DPO, and the statistics of what they removed.

The rules (TRL names):

- SFT: ``max_length`` with ``truncation_mode`` ``keep_start`` (cut the tail) or ``keep_end``
  (cut the head). Masks are cut with the ids.
- DPO, in this order: ``max_prompt_length`` keeps the END of the prompt (the question sits
  right before the answer); ``max_completion_length`` keeps the START of each completion;
  then ``max_length`` bounds prompt + completion, keeping the START of the combined sequence,
  so each completion's tail goes first and the prompt is cut only if it alone exceeds
  ``max_length`` (then the completion is empty and the example is dropped).

A row whose loss would have no target after truncation is dropped and counted, never
passed on to give a loss of 0 or NaN (TRL #3927, #6668). The loss predicts token t+1 from
token t and the first token of a document is never a target, so a row needs a masked-in
token at a position >= 1 (``num_targets``).
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Optional, Sequence

from twinseq.common.config import TRUNCATION_MODES
from twinseq.common.errors import DataError, DataTypeError

logger = logging.getLogger(__name__)

# Reasons an example is dropped; the keys of ``TruncationStats.dropped``.
DROP_EMPTY_COMPLETION = "empty_completion"
DROP_NO_TARGETS = "no_loss_tokens_after_truncation"
DROP_TOO_SHORT = "fewer_than_2_tokens"
DROP_NO_ASSISTANT = "no_assistant_turn"
DROP_EMPTY_CHOSEN = "chosen_empty_after_truncation"
DROP_EMPTY_REJECTED = "rejected_empty_after_truncation"
DROP_EMPTY_TEXT = "empty_text"
DROP_SAME_PAIR = "chosen_equals_rejected"


def check_truncation_mode(truncation_mode: str) -> None:
    if truncation_mode not in TRUNCATION_MODES:
        raise DataError(
            f"truncation_mode={truncation_mode!r} is not valid; choose one of {', '.join(map(repr, TRUNCATION_MODES))}."
        )


def check_length(name: str, value: Optional[int]) -> None:
    """``None`` (no limit) or a positive int; raises naming the field otherwise."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise DataTypeError(
            f"{name}={value!r} must be an int or None, got {type(value).__name__}; pass a number of tokens or None."
        )
    if value <= 0:
        raise DataError(f"{name}={value!r} is not valid; pass a positive number of tokens, or None for no limit.")


def check_preference_limits(
    method: str,
    truncation_mode: str,
    *,
    max_prompt_length: Optional[int],
    max_completion_length: Optional[int],
    max_length: Optional[int],
) -> None:
    """The truncation settings preference data takes (DPO's, KTO's): ``keep_start`` and valid lengths."""
    check_truncation_mode(truncation_mode)
    if truncation_mode != "keep_start":
        raise DataError(
            f"truncation_mode={truncation_mode!r} is not supported for {method}: max_length keeps the start of "
            f"prompt + completion. To keep the end of the prompt, set max_prompt_length."
        )
    for name, value in (
        ("max_prompt_length", max_prompt_length),
        ("max_completion_length", max_completion_length),
        ("max_length", max_length),
    ):
        check_length(name, value)


@dataclass
class TruncationStats:
    """What tokenisation and truncation did to a dataset; ``str()`` gives a one-screen report."""

    task: str = "sft"
    examples_seen: int = 0
    examples_truncated: int = 0
    tokens_seen: int = 0
    tokens_truncated: int = 0
    dropped: Counter = field(default_factory=Counter)

    @property
    def examples_dropped(self) -> int:
        return sum(self.dropped.values())

    @property
    def examples_kept(self) -> int:
        return self.examples_seen - self.examples_dropped

    def record(self, tokens_before: int, tokens_removed: int) -> None:
        self.examples_seen += 1
        self.tokens_seen += tokens_before
        self.tokens_truncated += tokens_removed
        self.examples_truncated += tokens_removed > 0

    def drop(self, reason: str) -> None:
        self.dropped[reason] += 1

    def __str__(self) -> str:
        share = self.tokens_truncated / self.tokens_seen if self.tokens_seen else 0.0
        lines = [
            f"{self.task} data: {self.examples_seen} examples seen, {self.examples_kept} kept",
            f"  truncated: {self.examples_truncated} examples, {self.tokens_truncated} of "
            f"{self.tokens_seen} tokens ({share:.2%})",
        ]
        for reason, count in sorted(self.dropped.items()):
            lines.append(f"  dropped: {count} ({reason})")
        return "\n".join(lines)

    def log(self, log: logging.Logger = logger) -> None:
        level = logging.WARNING if self.examples_dropped else logging.INFO
        for line in str(self).splitlines():
            log.log(level, line)

    def to_dict(self) -> dict:
        return {
            "task": self.task,
            "examples_seen": self.examples_seen,
            "examples_kept": self.examples_kept,
            "examples_truncated": self.examples_truncated,
            "tokens_seen": self.tokens_seen,
            "tokens_truncated": self.tokens_truncated,
            "dropped": dict(self.dropped),
        }


def truncate(ids: list, max_length: Optional[int], truncation_mode: str = "keep_start") -> list:
    """Cut a list to ``max_length``: ``keep_start`` keeps the head, ``keep_end`` the tail.

    >>> truncate([1, 2, 3, 4], 3), truncate([1, 2, 3, 4], 3, "keep_end")
    ([1, 2, 3], [2, 3, 4])
    """
    if max_length is None or len(ids) <= max_length:
        return ids
    return ids[:max_length] if truncation_mode == "keep_start" else ids[len(ids) - max_length :]


def num_targets(loss_mask: Optional[Sequence[int]], length: int) -> int:
    """Tokens the shifted loss will train on: masked-in positions >= 1 (all of them if no mask).

    >>> num_targets([1, 0, 0], 3), num_targets([0, 0, 1], 3), num_targets(None, 1)
    (0, 1, 0)
    """
    if loss_mask is None:
        return max(length - 1, 0)
    return int(sum(loss_mask[1:]))


def truncate_sft(
    columns: dict[str, list], max_length: Optional[int], truncation_mode: str = "keep_start"
) -> tuple[dict[str, list], int]:
    """Cut ``input_ids`` and every aligned mask column of one example; returns (columns, removed).

    >>> truncate_sft({"input_ids": [1, 7, 8, 9], "completion_mask": [0, 0, 1, 1]}, 3, "keep_end")
    ({'input_ids': [7, 8, 9], 'completion_mask': [0, 1, 1]}, 1)
    """
    n = len(columns["input_ids"])
    out = {k: truncate(v, max_length, truncation_mode) for k, v in columns.items()}
    return out, n - len(out["input_ids"])


def truncate_dpo(
    prompt_ids: list,
    chosen_ids: list,
    rejected_ids: list,
    *,
    max_prompt_length: Optional[int] = None,
    max_completion_length: Optional[int] = None,
    max_length: Optional[int] = None,
) -> tuple[list, list, list, int]:
    """The DPO rule (module docstring); returns (prompt, chosen, rejected, tokens removed).

    >>> truncate_dpo([1, 2, 3, 4], [5, 6, 7], [8, 9], max_prompt_length=3, max_length=5)
    ([2, 3, 4], [5, 6], [8, 9], 2)
    """
    before = len(prompt_ids) + len(chosen_ids) + len(rejected_ids)
    prompt_ids = truncate(prompt_ids, max_prompt_length, "keep_end")
    chosen_ids = truncate(chosen_ids, max_completion_length, "keep_start")
    rejected_ids = truncate(rejected_ids, max_completion_length, "keep_start")
    if max_length is not None:
        prompt_ids = prompt_ids[:max_length]
        room = max_length - len(prompt_ids)
        chosen_ids, rejected_ids = chosen_ids[:room], rejected_ids[:room]
    removed = before - len(prompt_ids) - len(chosen_ids) - len(rejected_ids)
    return prompt_ids, chosen_ids, rejected_ids, removed
