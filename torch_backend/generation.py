"""Sampling completions from the training model: Hugging Face ``generate`` with a KV cache.

Prompts of different lengths are left-padded into one ``[N, P]`` batch; the attention mask
marks the padding, and ``generate`` derives each row's positions from it
(``position_ids = cumsum(attention_mask) - 1``), so RoPE sees every prompt at positions
``0..len-1`` whatever its padding: a left-padded row decodes exactly as the prompt alone does.

The model is switched to eval mode while it generates (dropout off, and Hugging Face's
activation checkpointing, which disables the KV cache in training mode, off), then restored.
A PEFT model generates through its adapters.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

import numpy as np
import torch

from twinseq.common.backend import Model
from twinseq.common.errors import ConfigError


@dataclass
class Generated:
    """``completion_ids`` int64 [N, C] (right-padded with ``pad_token_id`` after EOS), and timing."""

    completion_ids: np.ndarray
    seconds: float


@contextlib.contextmanager
def eval_mode(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was_training)


def left_pad(
    prompts: Sequence[Sequence[int]], pad_token_id: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids [N, P], attention_mask [N, P]) with every prompt aligned to the right.

    >>> ids, mask = left_pad([[5, 6], [7]], 0, torch.device("cpu"))
    >>> ids.tolist(), mask.tolist()
    ([[5, 6], [0, 7]], [[1, 1], [0, 1]])
    """
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ConfigError(
            f"prompts must be a non-empty list of non-empty token lists, got lengths {[len(p) for p in prompts][:8]}; "
            "drop empty prompts or prepend a BOS token."
        )
    width = max(len(p) for p in prompts)
    ids = np.full((len(prompts), width), pad_token_id, np.int64)
    mask = np.zeros((len(prompts), width), np.int64)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = p
        mask[i, width - len(p) :] = 1
    return torch.as_tensor(ids, device=device), torch.as_tensor(mask, device=device)


def _causal_lm(model: torch.nn.Module) -> torch.nn.Module:
    """The object with ``generate``: a PEFT wrapper generates through its adapters."""
    return model


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    *,
    max_completion_length: int,
    eos_token_id: Optional[int],
    pad_token_id: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    greedy: bool = False,
    seed: Optional[int] = None,
    synced_gpus: bool = False,
) -> Generated:
    """Completions of each prompt (token ids, no special handling of chat templates).

    Sampling is ``softmax(logits / temperature)`` restricted to the ``top_k`` most likely tokens
    (0: all) and the smallest set of probability ``top_p``; ``greedy`` takes the argmax. A row
    stops at its first ``eos_token_id`` (kept in the completion) or after
    ``max_completion_length`` tokens; finished rows are padded with ``pad_token_id``.
    ``seed`` seeds torch's generator for this call (None: the global RNG state). ``synced_gpus``: every rank
    steps until all are done (HF's flag), for a ZeRO-3 model generating partitioned, layer by layer.
    """
    device = next(model.parameters()).device
    input_ids, attention_mask = left_pad(prompts, pad_token_id, device)
    kwargs = dict(
        max_new_tokens=int(max_completion_length),
        min_new_tokens=1,
        pad_token_id=pad_token_id,
        eos_token_id=eos_token_id,
        use_cache=True,
        return_dict_in_generate=False,
    )
    if greedy:
        kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
    else:
        kwargs.update(do_sample=True, temperature=float(temperature), top_p=float(top_p), top_k=int(top_k) or None)
    if seed is not None:
        torch.manual_seed(seed)
    t0 = time.perf_counter()
    with eval_mode(model):
        out = _causal_lm(model).generate(
            input_ids=input_ids, attention_mask=attention_mask, synced_gpus=synced_gpus, **kwargs
        )
    completion = out[:, input_ids.shape[1] :].cpu().numpy().astype(np.int64)
    return Generated(completion, time.perf_counter() - t0)


def complete_prompts(
    model: Model,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    seed: int = 0,
    eos_token_id: Optional[int] = None,
    pad_token_id: int = 0,
) -> np.ndarray:
    """int64 [N, C] completions (``common.backend.Backend.complete_prompts``): ``generate``, greedy at
    ``temperature`` 0, else sampled with torch's generator seeded by ``seed``."""
    greedy = not temperature > 0
    return generate(
        model,
        prompts,
        max_completion_length=max_new_tokens,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        temperature=1.0 if greedy else float(temperature),
        greedy=greedy,
        seed=seed,
    ).completion_ids
