"""TRL 1.16's own RLOO code, run in-process on inputs we choose: the reference twinseq's RLOO is compared with.

The RLOO twin of ``_trl_grpo`` (same tiny offline Llama and tokenizer from ``_trl_tiny``, same reward functions
reading a dataset column, same per-configuration trainer cache), on a real ``trl.RLOOTrainer``:

- ``trl_rloo_advantages_and_metrics`` runs ``RLOOTrainer._generate_and_score_completions(inputs)``. Two things are
  patched, nothing else: the policy's ``generate`` (an instance attribute on ``trainer.model``, so TRL's prompt
  tokenisation, its mask-after-the-first-EOS in ``_generate_single_turn``, decoding, padding and the length
  metrics of ``_generate`` all run) and ``_get_per_token_logps_and_entropies``, which returns our policy ("old")
  log-probs for ``trainer.model`` and our reference log-probs for ``trainer.ref_model``. TRL's own
  ``_calculate_rewards`` (None -> NaN, float32), weighted ``nansum``, unscorable rows, the sequence-level KL
  penalty ``rewards - beta * sum_t (old - ref) * mask``, the leave-one-out baseline, the optional batch-wide
  normalisation and every metric then run.
- ``trl_rloo_loss_and_grad`` runs ``RLOOTrainer._compute_loss(model, inputs)`` with only
  ``_get_per_token_logps_and_entropies`` patched to return ``(our float64 leaf, zeros as entropies, None)``; the
  sequence-level ratio, clipping, mean over sequences and the clip metrics are TRL's.

Dtypes: rewards are float32 in TRL (``_calculate_rewards`` builds float32 tensors; ``reward_weights`` is float32),
so the advantages are float32 unless the log-probs are float64 (``logps_dtype``): the KL penalty then promotes
``rewards - beta * kl`` to float64, but the rewards themselves were already rounded to float32. By default the
log-probs are handed over as float32, what TRL's float32 model forward would give, so the whole advantage
computation runs in float32 as in TRL. The loss harness uses float64 throughout (TRL's loss code is dtype-generic).
Everything is returned as float64 numpy.

No test lives here; tests import it (it needs ``trl``, ``transformers``, ``datasets`` and ``tokenizers``).
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from tests.torch_backend._trl_grpo import REWARD_COLUMN, _as_tensor, _mean_metrics, online_trainer, rewards_in_groups
from tests.torch_backend._trl_tiny import EOS, TOKEN


@functools.lru_cache(maxsize=None)
def _trainer(num_reward_funcs: int, config_items: tuple):
    """One ``RLOOTrainer`` per (number of reward functions, RLOOConfig keyword items), kept for the session."""
    return online_trainer("RLOO", num_reward_funcs, config_items)


def _key(config: dict) -> tuple:
    return tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in sorted(config.items()))


def _prefix_lengths(mask_NC, n: int, c: int) -> np.ndarray:
    """The per-row lengths of a completion mask whose rows are prefixes of ones (at least one each)."""
    mask = np.asarray(mask_NC) != 0
    if mask.shape != (n, c):
        raise ValueError(f"mask_NC has shape {mask.shape}, expected {(n, c)}")
    lengths = mask.sum(1)
    if (lengths < 1).any() or (mask != (np.arange(c)[None, :] < lengths[:, None])).any():
        raise ValueError("each row of mask_NC must be a prefix of ones holding at least one 1")
    return lengths


def trl_rloo_advantages_and_metrics(
    rewards_NF,
    num_generations: int,
    *,
    old_logps_NC=None,
    ref_logps_NC=None,
    mask_NC=None,
    logps_dtype: str = "float32",
    **options: Any,
) -> tuple[np.ndarray, dict]:
    """TRL's RLOO advantages (float64 numpy [N]) and logged metrics for rewards ``[N, F]`` (NaN: a None reward).

    Runs the real ``RLOOTrainer._generate_and_score_completions`` on N rows, rows ``g*G .. g*G+G-1`` being prompt
    g's group (TRL's order), each prompt one token. Reward function ``reward_i`` returns column i of the rewards
    (None where NaN). ``options`` are ``RLOOConfig`` fields: ``beta`` (TRL's default 0.05; 0 builds no reference
    model and adds no KL), ``normalize_advantages``, ``reward_weights``, ``reward_clip_range``...

    Completions: ``mask_NC`` ([N, C], nonzero = a completion token; None: all ones, C = 1 unless log-probs give C)
    must have rows that are prefixes of ones, each with at least one 1 (the only masks TRL's generation produces).
    The patched ``generate`` returns, for a row of length L, L-1 ordinary tokens, EOS, then ordinary tokens up to
    C; TRL's mask-after-the-first-EOS cuts it to exactly L tokens (EOS included), and right-padding rebuilds the
    mask. Every completion ends in EOS, none is truncated (so ``mask_truncated_completions`` changes nothing). The
    padded width is max L, so TRL's ``logits_to_keep`` may be below C: the stubbed forward returns the first
    ``logits_to_keep`` columns of ``old_logps_NC`` / ``ref_logps_NC`` (all-zero trailing mask columns are unseen).

    ``old_logps_NC`` (None: zeros) is what the policy forward returns, ``ref_logps_NC`` (needed when ``beta != 0``)
    what the reference forward returns, both as ``logps_dtype`` (float32 by default, as TRL's float32 model).

    The metrics are those the call logs, each averaged as ``RLOOTrainer.log`` does: ``reward``, ``reward_std``,
    ``frac_reward_zero_std``, ``rewards/reward_{i}/mean``, ``rewards/reward_{i}/std``, ``kl`` (``beta != 0``:
    the masked mean over tokens of ``old - ref``) and ``_generate``'s ``completions/*`` length metrics (from the
    mask); ``num_tokens`` (a running count of the cached trainer) is left out.
    """
    import torch

    rewards = rewards_in_groups(rewards_NF, num_generations)
    n, f = rewards.shape
    config = {"per_device_train_batch_size": n, "num_generations": int(num_generations), **options}
    if config.get("reward_weights") is not None:
        config["reward_weights"] = [float(w) for w in config["reward_weights"]]
    beta = float(config.get("beta", 0.05))  # RLOOConfig's default
    if beta != 0.0 and ref_logps_NC is None:
        raise ValueError(f"beta={beta} needs ref_logps_NC")

    shapes = [np.shape(x) for x in (old_logps_NC, ref_logps_NC, mask_NC) if x is not None]
    c = shapes[0][1] if shapes else 1
    if any(s != (n, c) for s in shapes):
        raise ValueError(f"old_logps_NC, ref_logps_NC and mask_NC must all be [N={n}, C], got {shapes}")
    lengths = _prefix_lengths(np.ones((n, c)) if mask_NC is None else mask_NC, n, c)
    dtype = getattr(torch, logps_dtype)
    old = torch.zeros((n, c), dtype=dtype) if old_logps_NC is None else _as_tensor(old_logps_NC, dtype)
    ref = None if ref_logps_NC is None else _as_tensor(ref_logps_NC, dtype)

    trainer = _trainer(f, _key(config))
    model = trainer.model
    completions = torch.full((n, c), TOKEN, dtype=torch.long)
    completions[torch.arange(n), torch.as_tensor(lengths - 1)] = EOS

    def generate(input_ids, attention_mask=None, **kwargs):
        assert input_ids.shape[0] == n
        return torch.cat([input_ids, completions.to(input_ids.device)], dim=1)

    def logps(model_, input_ids, attention_mask, logits_to_keep, batch_size=None, **kwargs):
        assert input_ids.shape[0] == n and logits_to_keep == int(lengths.max())
        if model_ is trainer.model:
            out = old
        elif ref is not None and model_ is trainer.ref_model:
            out = ref
        else:
            raise AssertionError("log-probs asked of a model that is neither the policy nor the reference")
        return out[:, :logits_to_keep], None, None

    inputs = [
        {
            "prompt": f"w{3 + (i // num_generations) % 8}",
            **{REWARD_COLUMN.format(j): float(rewards[i, j]) for j in range(f)},
        }
        for i in range(n)
    ]
    trainer._metrics["train"].clear()
    model.generate = generate
    trainer._get_per_token_logps_and_entropies = logps
    try:
        out = trainer._generate_and_score_completions(inputs)
    finally:
        model.__dict__.pop("generate", None)
        trainer.__dict__.pop("_get_per_token_logps_and_entropies", None)
    metrics = _mean_metrics(trainer._metrics["train"])
    trainer._metrics["train"].clear()
    metrics.pop("num_tokens", None)
    expected = torch.as_tensor(np.arange(int(lengths.max()))[None, :] < lengths[:, None]).long()
    assert torch.equal(out["completion_mask"].cpu().long(), expected), "TRL's completion mask is not mask_NC"
    return out["advantages"].detach().double().cpu().numpy(), metrics


def trl_rloo_loss_and_grad(
    logps_NC,
    advantages_N,
    mask_NC,
    *,
    old_logps_NC=None,
    **options: Any,
) -> tuple[float, np.ndarray, dict]:
    """TRL's RLOO loss on one batch: (loss, d loss / d logps_NC as float64 [N, C], TRL's clip metrics).

    Runs the real ``RLOOTrainer._compute_loss(model, inputs)``; only the model forward is replaced, returning
    ``logps_NC`` as a float64 leaf (and zeros as entropies, which ``_compute_loss`` always asks for). ``inputs`` is
    what ``_generate_and_score_completions`` hands over: one-token prompts, ``completion_mask`` (``mask_NC != 0``,
    int64; any 0/1 pattern is accepted here), ``advantages`` (float64) and ``old_logps``, which TRL stores as the
    *sequence sum* ``(old_per_token_logps * completion_mask).sum(1)``: that of ``old_logps_NC``, or with None (the
    on-policy case, ratio 1) the detached sum of ``logps_NC``. TRL's loss is sequence-level:
    ``-mean_i min(r_i A_i, clip(r_i, 1 - epsilon, 1 + epsilon_high) A_i)`` with ``r_i = exp(sum_t mask (logp -
    old))``, a plain mean over the N rows (``_compute_loss`` returns it unscaled; the HF Trainer would divide by
    the gradient accumulation steps).

    ``options``: ``RLOOConfig`` fields, ``epsilon`` (0.2) and ``epsilon_high`` (None: ``epsilon``) being the ones
    the loss reads (``beta`` defaults to 0 here: the loss does not read it, and 0 spares a reference model).
    The metrics: ``clip_ratio/low_mean``, ``clip_ratio/high_mean``, ``clip_ratio/region_mean``,
    ``clip_ratio/low_min``, ``clip_ratio/high_max`` (fractions of sequences; ``entropy``, the stub's zeros, is
    left out).
    """
    import torch

    logps = np.asarray(logps_NC, np.float64)
    if logps.ndim != 2:
        raise ValueError(f"logps_NC must be [N, C], got shape {logps.shape}")
    n, c = logps.shape
    config = {"beta": 0.0, "per_device_train_batch_size": 2, "num_generations": 2, **options}
    trainer = _trainer(1, _key(config))

    dtype = torch.float64
    leaf = torch.tensor(logps, dtype=dtype, requires_grad=True)
    mask = torch.as_tensor(np.asarray(mask_NC) != 0).to(torch.long)
    if mask.shape != (n, c):
        raise ValueError(f"mask_NC has shape {tuple(mask.shape)}, logps_NC {(n, c)}")
    old = leaf.detach() if old_logps_NC is None else _as_tensor(old_logps_NC, dtype)
    inputs: dict[str, Any] = {
        "prompt_ids": torch.full((n, 1), TOKEN, dtype=torch.long),
        "prompt_mask": torch.ones((n, 1), dtype=torch.long),
        "completion_ids": torch.full((n, c), TOKEN, dtype=torch.long),
        "completion_mask": mask,
        "old_logps": (old * mask).sum(1),  # as _generate_and_score_completions stores it
        "advantages": _as_tensor(advantages_N, dtype).reshape(n),
    }

    def stub(model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        assert input_ids.shape[0] == n and logits_to_keep == c
        return leaf, (torch.zeros_like(leaf.detach()) if kwargs.get("compute_entropy") else None), None

    trainer._metrics["train"].clear()
    trainer._get_per_token_logps_and_entropies = stub
    try:
        loss = trainer._compute_loss(trainer.model, inputs)
        loss.backward()
    finally:
        trainer.__dict__.pop("_get_per_token_logps_and_entropies", None)
    metrics = _mean_metrics(trainer._metrics["train"])
    trainer._metrics["train"].clear()
    metrics.pop("entropy", None)  # the stub's zeros, not a model's entropy
    grad = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
    return float(loss.detach()), grad.detach().numpy().astype(np.float64), metrics
