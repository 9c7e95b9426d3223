"""GRPO's data: an embedded verifiable task, its reward functions, and prompt-only datasets.

The embedded task (``dataset_name: embedded``) is built offline and deterministically: each
prompt lists a few words and asks for the last one,

    prompt: "Repeat the last word: file value node\\nAnswer:"     answer: "node"

with two built-in reward functions (``REWARD_FUNCTIONS``), called as TRL calls them,
``f(prompts, completions, **columns)`` with the dataset's other columns (here ``answer``):

- ``exact_match``: 1.0 when the completion, stripped, is the answer; 0.5 when its first word is;
- ``format``: the fraction of the completion's whitespace-separated pieces that are plain
  lowercase words (``[a-z]+``), 0 for an empty completion. A randomly initialised model emits
  such pieces part of the time, so the reward has a gradient from the first step, and a tiny
  model measurably raises it within a CPU minute or two; ``exact_match`` is the harder signal.

A prompt-only dataset (a local JSONL/Parquet/CSV path) has a ``prompt`` column: text, or a
conversation (a list of ``{"role", "content"}`` messages, rendered with the tokenizer's chat
template and its generation prompt, as TRL does). Its other columns reach the reward functions.
"""

from __future__ import annotations

import random
import re
from typing import Any, Callable, Mapping, Optional, Sequence

from twinseq.common.data.loading import load_dataset_any, resolve_dataset, select_split, split_off_eval
from twinseq.common.errors import ConfigError, DataError
from twinseq.common.objectives.grpo import check_callable_reward

EMBEDDED_GRPO_NAMES = ("embedded", "embedded-grpo")
TASK_WORDS = (
    "file",
    "value",
    "list",
    "string",
    "data",
    "name",
    "path",
    "type",
    "object",
    "line",
    "time",
    "error",
    "class",
    "module",
    "number",
    "key",
    "text",
    "field",
    "size",
    "mode",
    "item",
    "index",
    "order",
    "result",
    "count",
    "node",
    "test",
    "code",
    "user",
    "host",
    "port",
    "word",
)
"""Words that the embedded tokenizer encodes as one token, with or without a leading space."""
PROMPT_TEMPLATE = "Repeat the last word: {words}\nAnswer:"
_WORD = re.compile(r"[a-z]+")


def build_last_word_task(
    num_prompts: int = 512, *, words_per_prompt: int = 3, seed: int = 0, vocabulary: Sequence[str] = TASK_WORDS
) -> list[dict[str, str]]:
    """Rows ``{"prompt": str, "answer": str}`` of the last-word task, the same for one seed.

    >>> build_last_word_task(1, seed=0)[0]["prompt"].startswith("Repeat the last word: ")
    True
    """
    rng = random.Random(seed)
    rows = []
    for _ in range(num_prompts):
        words = rng.sample(list(vocabulary), words_per_prompt)
        rows.append({"prompt": PROMPT_TEMPLATE.format(words=" ".join(words)), "answer": words[-1]})
    return rows


def _text(completion: Any) -> str:
    """A completion as text: a string, or a conversation's last message content (TRL's conversational form)."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, Sequence) and completion and isinstance(completion[-1], Mapping):
        return str(completion[-1].get("content", ""))
    raise DataError(
        f"a completion must be text or a list of messages, got {type(completion).__name__} {str(completion)[:80]!r}; "
        "pass completions as strings or lists of {'role', 'content'} messages."
    )


def exact_match_reward(
    prompts: Sequence[Any], completions: Sequence[Any], answer: Sequence[str] = (), **columns: Any
) -> list[Optional[float]]:
    """1.0 if ``completion.strip() == answer``, 0.5 if its first word is the answer, else 0.0; None
    (abstain) for a row without an answer.

    >>> exact_match_reward(["p"] * 3, [" apple", " apple pie", "pear"], answer=["apple"] * 3)
    [1.0, 0.5, 0.0]
    """
    if len(answer) != len(completions):
        raise DataError(
            f"exact_match needs an 'answer' column with one entry per completion, got "
            f"{len(answer)} for {len(completions)}; add an 'answer' column to the dataset."
        )
    out: list[Optional[float]] = []
    for completion, target in zip(completions, answer):
        if target is None:
            out.append(None)
            continue
        text = _text(completion).strip()
        first = text.split()[0] if text.split() else ""
        out.append(1.0 if text == str(target).strip() else 0.5 if first == str(target).strip() else 0.0)
    return out


def format_reward(prompts: Sequence[Any], completions: Sequence[Any], **columns: Any) -> list[float]:
    """The fraction of whitespace-separated pieces of each completion that are lowercase words.

    >>> format_reward(["p", "p", "p"], [" apple pie", " apple P!e", ""])
    [1.0, 0.5, 0.0]
    """
    out = []
    for completion in completions:
        pieces = _text(completion).split()
        out.append(sum(bool(_WORD.fullmatch(p)) for p in pieces) / len(pieces) if pieces else 0.0)
    return out


REWARD_FUNCTIONS: dict[str, Callable[..., list]] = {"exact_match": exact_match_reward, "format": format_reward}
"""Built-in reward functions by the name ``reward_funcs`` gives."""
for _name, _func in REWARD_FUNCTIONS.items():
    # the metrics' name: rewards/<name>/mean
    _func.reward_name = _name  # type: ignore[attr-defined]


def resolve_reward_funcs(funcs: Sequence[Any]) -> list[Callable[..., list]]:
    """Names (``REWARD_FUNCTIONS``) and callables -> callables, in order."""
    out = []
    for i, f in enumerate(funcs):
        if isinstance(f, str):
            if f not in REWARD_FUNCTIONS:
                raise ConfigError(
                    f"reward_funcs[{i}]={f!r} is not a built-in reward function; choose from "
                    f"{sorted(REWARD_FUNCTIONS)} (--reward-funcs), or pass a callable from Python."
                )
            f = REWARD_FUNCTIONS[f]
        check_callable_reward(f, i)
        out.append(f)
    return out


# ---------------------------------------------------------------------------------------
# Prompt-only datasets
# ---------------------------------------------------------------------------------------


def _prompt_text(prompt: Any, tokenizer: Any, index: int) -> str:
    if isinstance(prompt, str):
        if not prompt:
            raise DataError(
                f"row {index}: 'prompt' is empty ({prompt!r}); every GRPO row needs a prompt to complete: "
                "fill it in or drop the row."
            )
        return prompt
    if isinstance(prompt, (list, tuple)) and all(isinstance(m, Mapping) for m in prompt):
        return tokenizer.render_prompt(list(prompt), index)
    raise DataError(
        f"row {index}: 'prompt' must be text or a list of {{'role', 'content'}} messages, got {type(prompt).__name__} "
        f"{str(prompt)[:80]!r}; write it as one of those."
    )


def tokenize_prompts(
    rows: Sequence[Mapping[str, Any]], tokenizer: Any, *, max_prompt_length: Optional[int] = None
) -> list[dict[str, Any]]:
    """Prompt rows -> ``{"prompt", "prompt_text", "prompt_input_ids", **other columns}``.

    A prompt longer than ``max_prompt_length`` tokens keeps its end (TRL truncates prompts on
    the left: the end is what the completion continues). A text prompt gets the special ids
    ``tokenizer(prompt)`` puts in front (``text_affixes``: Llama's BOS, nothing for Qwen; not twice when the
    text starts with them); a conversation is rendered by the chat template with its generation prompt, which
    writes its own (``apply_chat_template(prompt, add_generation_prompt=True)``).
    """
    out = []
    before = tokenizer.text_affixes[0] if hasattr(tokenizer, "text_affixes") else [tokenizer.bos_token_id]
    before = [t for t in before if t is not None]
    for i, row in enumerate(rows):
        if "prompt" not in row:
            raise DataError(
                f"row {i} has no 'prompt' column (columns: {sorted(row)}); GRPO reads prompt-only "
                f"data: add a 'prompt' column of text or messages, plus any columns the rewards read."
            )
        text = _prompt_text(row["prompt"], tokenizer, i)
        ids = tokenizer.encode(text)
        if isinstance(row["prompt"], str) and ids[: len(before)] != before:
            ids = before + ids
        if max_prompt_length is not None and len(ids) > max_prompt_length:
            ids = ids[-max_prompt_length:]
        out.append({**row, "prompt_text": text, "prompt_input_ids": ids})
    return out


def load_prompt_rows(dataset_name: str, split: str = "train", *, field: str = "dataset_split") -> list[dict[str, Any]]:
    """The embedded task (a single split, ``train``, which may be sliced: ``train[:90%]``), or the rows of a local
    prompt-only dataset at ``split``, as a list of dicts; ``field`` names the config field of ``split``."""
    if dataset_name in EMBEDDED_GRPO_NAMES:
        return select_split(build_last_word_task(), split, dataset_name, field=field)
    return prompt_rows_of(load_dataset_any(dataset_name, split=split, field=field), repr(dataset_name))


def prompt_rows_of(ds: Any, name: str) -> list[dict[str, Any]]:
    """The rows of a prompt-only ``datasets.Dataset`` as dicts (a ``prompt`` column, plus any extra columns the
    reward functions read)."""
    if "prompt" not in ds.column_names:
        raise DataError(
            f"dataset {name} has no 'prompt' column (columns: {ds.column_names}); GRPO "
            f'needs prompt-only rows: add a column as in {{"prompt": "..."}} or {{"prompt": [messages]}}.'
        )
    return [dict(r) for r in ds]


def prepare_grpo_prompts(cfg: Any, tokenizer: Any, dataset: Any = None) -> list[dict[str, Any]]:
    """``TrainConfig`` -> tokenised prompt rows (see ``tokenize_prompts``); ``dataset``: the rows a Python caller
    passed (``train_dataset``) instead of ``dataset_name``."""
    d = cfg.data
    prompt_rows = split_off_eval(_all_prompt_rows(cfg, dataset), d.eval_fraction, cfg.seed, "train")
    rows = tokenize_prompts(prompt_rows, tokenizer, max_prompt_length=d.max_prompt_length)
    if not rows:
        raise DataError(f"dataset {d.dataset_name!r} holds no prompts; give at least one row.")
    return rows


def _all_prompt_rows(cfg: Any, dataset: Any = None) -> list[dict[str, Any]]:
    """The training prompts before ``eval_fraction`` holds some out: ``dataset`` (``train_dataset``), else
    ``dataset_name`` at ``dataset_split``."""
    d = cfg.data
    if dataset is None:
        return load_prompt_rows(d.dataset_name, d.dataset_split)
    return prompt_rows_of(resolve_dataset(dataset, "train_dataset", split=d.dataset_split), "train_dataset")


def prepare_grpo_eval_prompts(
    cfg: Any, tokenizer: Any, dataset: Any = None, train_dataset: Any = None
) -> Optional[list[dict[str, Any]]]:
    """The held-out prompts of a GRPO run, tokenised as ``prepare_grpo_prompts`` does, or None without an eval set:
    ``dataset`` (a Python ``eval_dataset``), else the prompts ``eval_fraction`` holds out of the training ones, else
    ``eval_dataset_name`` (None: ``dataset_name``) at ``eval_split`` (None: ``train``)."""
    d = cfg.data
    if dataset is not None:
        if d.eval_fraction is not None:
            raise DataError(
                f"eval_dataset= was passed and eval_fraction={d.eval_fraction} holds out training prompts as an eval "
                f"set too; drop one of them."
            )
        rows = prompt_rows_of(resolve_dataset(dataset, "eval_dataset", split=d.eval_split or "train"), "eval_dataset")
    elif d.eval_fraction is not None:
        rows = split_off_eval(_all_prompt_rows(cfg, train_dataset), d.eval_fraction, cfg.seed, "eval")
    elif d.eval_dataset_name is not None or d.eval_split is not None:
        name = d.dataset_name if d.eval_dataset_name is None else d.eval_dataset_name
        rows = load_prompt_rows(name, d.eval_split or "train", field="eval_split")
    else:
        return None
    if not rows:
        raise DataError("the eval set holds no prompts; give at least one row (eval_dataset_name / eval_split).")
    return tokenize_prompts(rows, tokenizer, max_prompt_length=d.max_prompt_length)


class PromptSource:
    """The ``StepSource`` of GRPO: each optimizer step gets the prompts of its groups.

    A generated batch serves ``steps_per_generation x num_iterations`` optimizer steps (``steps_per_generation``:
    the optimizer steps one generation fills, each its ``part`` of it, in the order 0..k-1 per iteration, as TRL),
    so a new set of ``prompts_per_step`` prompts (a generation's) is drawn that often (the trainer keeps the
    completions meanwhile); the stream is shuffled per epoch with ``seed`` and resumable.

    An epoch is ``len(rows) // prompts_per_step`` generations of distinct prompts, in the order of the epoch's
    permutation; the prompts left over (fewer than a generation's groups need) sit that epoch out, as TRL's
    ``RepeatSampler`` drops an incomplete batch, and the next epoch's permutation draws from every prompt again. So
    ``steps_per_epoch`` is that many generations times ``num_iterations x steps_per_generation``.
    """

    def __init__(
        self,
        rows: Sequence[Mapping[str, Any]],
        prompts_per_step: int,
        *,
        num_iterations: int = 1,
        seed: int = 0,
        steps_per_generation: int = 1,
    ) -> None:
        self.rows, self.prompts_per_step, self.num_iterations, self.seed = (
            list(rows),
            prompts_per_step,
            num_iterations,
            seed,
        )
        self.parts = steps_per_generation
        self._cycle = num_iterations * steps_per_generation
        """Optimizer steps between two generations."""
        if len(self.rows) < prompts_per_step:
            raise DataError(
                f"GRPO draws {prompts_per_step} prompts per generation (per_device_train_batch_size x "
                f"gradient_accumulation_steps x ranks / num_generations), but the data has {len(self.rows)}; add "
                f"prompts, or lower per_device_train_batch_size or gradient_accumulation_steps."
            )
        self.epoch, self.position, self.steps_done = 0, 0, 0
        self._order = self._shuffled(0)

    @property
    def steps_per_epoch(self) -> int:
        """Optimizer steps of one pass: every full generation of the epoch's prompts, ``num_iterations x
        steps_per_generation`` steps each."""
        return len(self.rows) // self.prompts_per_step * self._cycle

    def _shuffled(self, epoch: int) -> list[int]:
        order = list(range(len(self.rows)))
        random.Random(self.seed * 1000003 + epoch).shuffle(order)
        return order

    def _take(self) -> list[Mapping[str, Any]]:
        """The next generation's prompts, all from one epoch's order (the next epoch's when this one has too few)."""
        if self.position + self.prompts_per_step > len(self._order):
            self.epoch, self.position = self.epoch + 1, 0
            self._order = self._shuffled(self.epoch)
        picked = [self.rows[i] for i in self._order[self.position : self.position + self.prompts_per_step]]
        self.position += self.prompts_per_step
        return picked

    def next_step(self) -> list[Any]:
        """``[{"prompts": rows, "new_generation": bool, "part": k, "step": n}]``: one entry; ``new_generation`` False
        means the trainer reuses its last generated batch (iteration 2..μ, or the generation's next part); ``part``
        is the slice of the generation this step trains on (0 without ``steps_per_generation``); ``step`` is the
        optimizer step it feeds (1-based; what ``log_completions`` records)."""
        into = self.steps_done % self._cycle
        new = into == 0
        if new:
            self._generation_start = (self.epoch, self.position)
            self._last = self._take()
        self.steps_done += 1
        return [{"prompts": self._last, "new_generation": new, "part": into % self.parts, "step": self.steps_done}]

    def state_dict(self) -> dict[str, Any]:
        # A resume restarts at a generation boundary: the completions are not checkpointed.
        start = self.steps_done - self.steps_done % self._cycle
        epoch, position = (self.epoch, self.position) if start == self.steps_done else self._generation_start
        return {"epoch": epoch, "position": position, "steps_done": start}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.epoch, self.steps_done = int(state["epoch"]), int(state["steps_done"])
        self._order = self._shuffled(self.epoch)
        self.position = int(state["position"])
