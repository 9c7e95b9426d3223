"""TRL 1.16's own GRPO code, run in-process on inputs we choose: the reference twinseq's GRPO is compared with.

Two entry points, both calling the real methods of one real ``trl.GRPOTrainer`` (a tiny random
``LlamaForCausalLM`` from ``LlamaConfig``, an in-memory word-level tokenizer, ``use_cpu=True``, no download;
trainers are cached per configuration: the first call imports TRL and builds, about 9 s; another configuration's
trainer builds in well under a second, and a call on a built trainer takes milliseconds):

- ``trl_loss_and_grad`` runs ``GRPOTrainer._compute_loss(model, inputs)``. Only the model forward is replaced:
  the instance's ``_get_per_token_logps_and_entropies`` is patched, for the duration of the call, to return
  ``(our log-prob leaf tensor, zeros as entropies, None as aux loss)``, the exact triple TRL's method returns
  (``compute_entropy=True`` is always asked by ``_compute_loss``, which logs an ``entropy`` metric from it: that
  metric is the stub's zeros, so it is left out of the returned metrics). Everything after it (ratio, clipping, k3
  KL and its bias correction, every loss type's reduction and normaliser, the clip and KL metrics) is TRL's.
  Tensors are float64 (TRL's loss code is dtype-generic; TRL itself would hand it float32 log-probs).
- ``trl_advantages_and_metrics`` runs ``GRPOTrainer._generate_and_score_completions(inputs)`` with only
  ``_generate`` patched (fixed one-token prompts, two-token completions ending in EOS, no model call). The reward
  functions are real ones passed to the trainer (``reward_0``, ``reward_1``, ...) that return our values from a
  dataset column (``None`` where the value is NaN), so TRL's own ``_calculate_rewards`` (None -> NaN, float32),
  the aggregation, group/batch scaling, the unscorable-completion rule and the reward metrics all run. Rewards
  and advantages are therefore float32, as in TRL (returned as float64 numpy).

No test lives here; tests import it (it needs ``trl``, ``transformers``, ``datasets`` and ``tokenizers``).
"""

from __future__ import annotations

import atexit
import functools
import math
import os
import shutil
import tempfile
from typing import Any, Optional, Sequence

import numpy as np

from tests.torch_backend._trl_tiny import EOS, TOKEN, tiny_llama, tokenizer

REWARD_COLUMN = "twinseq_reward_{}"
"""The dataset column reward function ``reward_{i}`` reads its values from."""


def _model(folder: str):
    """The tiny Llama, saved to ``folder`` and loaded back: with ``beta != 0`` TRL builds its reference model
    from the policy's ``config._name_or_path`` (``create_model_from_path``), which must then be a local folder."""
    from transformers import AutoModelForCausalLM

    tiny_llama().save_pretrained(folder)
    return AutoModelForCausalLM.from_pretrained(folder, dtype="float32")


def _reward_func(i: int):
    column = REWARD_COLUMN.format(i)

    def reward(prompts, completions, **kwargs):
        return [None if v is None or math.isnan(v) else float(v) for v in kwargs[column]]

    reward.__name__ = f"reward_{i}"
    return reward


@functools.lru_cache(maxsize=None)
def _trainer(num_reward_funcs: int, config_items: tuple):
    """One ``GRPOTrainer`` per (number of reward functions, GRPOConfig keyword items), kept for the session."""
    return online_trainer("GRPO", num_reward_funcs, config_items)


def online_trainer(method: str, num_reward_funcs: int, config_items: tuple):
    """A real ``trl.<method>Trainer`` (``GRPO``, ``RLOO``) on the tiny Llama, its ``<method>Config`` from
    ``config_items``; callers cache it."""
    import trl
    from datasets import Dataset
    from transformers.utils import logging as hf_logging

    config_class, trainer_class = getattr(trl, f"{method}Config"), getattr(trl, f"{method}Trainer")
    out_dir = tempfile.mkdtemp(prefix=f"twinseq_trl_{method.lower()}_")
    atexit.register(shutil.rmtree, out_dir, ignore_errors=True)
    options = {k: list(v) if isinstance(v, tuple) else v for k, v in config_items}  # reward_weights: a list
    args = config_class(
        output_dir=out_dir,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        seed=0,
        **options,
    )
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # "Writing model shards", "Loading weights": noise in a test's output
    try:
        prompts = Dataset.from_list([{"prompt": f"w{3 + i} w{4 + i}"} for i in range(8)])
        trainer = trainer_class(
            model=_model(os.path.join(out_dir, "policy")),  # beta != 0: the reference is loaded from this folder
            reward_funcs=[_reward_func(i) for i in range(num_reward_funcs)],
            args=args,
            train_dataset=prompts,
            processing_class=tokenizer(),
        )
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    trainer.model.train()  # _compute_loss and the scoring read mode "train" from model.training
    return trainer


def _as_tensor(x, dtype) -> Any:
    import torch

    return torch.as_tensor(np.asarray(x, np.float64)).to(dtype)


def _mean_metrics(metrics: dict[str, list]) -> dict[str, float]:
    """As ``GRPOTrainer.log`` averages one logging window: the NaN-free mean of each metric's values."""
    out = {}
    for key, values in metrics.items():
        valid = [float(v) for v in values if not math.isnan(v)]
        out[key] = sum(valid) / len(valid) if valid else float("nan")
    return out


def trl_loss_and_grad(
    logps_NC,
    old_logps_NC,
    ref_logps_NC,
    advantages_N,
    mask_NC,
    *,
    loss_type: str = "dapo",
    beta: float = 0.0,
    epsilon: float = 0.2,
    epsilon_high: Optional[float] = None,
    use_bias_correction_kl: bool = True,
    max_completion_length: Optional[int] = None,
    grad_accum: int = 1,
    entropies_NC=None,
    is_ratio_NC=None,
    steps_per_generation: Optional[int] = None,
    out: Optional[dict] = None,
    **options: Any,
) -> tuple[float, np.ndarray, dict]:
    """TRL's GRPO loss over one generation batch: (loss, d loss / d logps_NC as float64 [N, C], TRL's metrics).

    ``logps_NC`` (the policy's completion log-probs), ``old_logps_NC`` (None: TRL's on-policy path, where
    ``_compute_loss`` takes ``per_token_logps.detach()``), ``ref_logps_NC`` (needed when ``beta != 0``),
    ``advantages_N`` and ``mask_NC`` (the completion mask; nonzero = a scored token) describe the whole
    generation batch of one optimizer step. As TRL does in ``_prepare_inputs`` (bar the shuffle: rows stay in
    order), it is split with TRL's ``split_tensor_dict`` into ``grad_accum`` micro-batches of N / grad_accum
    contiguous rows, ``num_items_in_batch`` being the batch's mask total, and ``_compute_loss`` runs on each with
    ``current_gradient_accumulation_steps = grad_accum`` (``steps_per_generation`` = ``grad_accum``, TRL's default).
    The returned loss is the sum of the micro-batch losses and the gradient their accumulated gradient (what the
    optimizer step sees); the metrics are each metric's mean over the micro-batches (as ``GRPOTrainer.log``
    averages a window): ``clip_ratio/low_mean``, ``clip_ratio/high_mean``, ``clip_ratio/region_mean``,
    ``clip_ratio/low_min``, ``clip_ratio/high_max`` (clipped loss types), ``cispo_clip_ratio`` (cispo), ``kl``
    (``beta != 0``). ``max_completion_length`` None leaves TRL's default (512; ``dr_grpo`` divides by it).
    ``entropies_NC``: what the stubbed forward returns as the tokens' entropies (None: zeros), which
    ``top_entropy_quantile`` reads. ``options``: further ``GRPOConfig`` fields (``importance_sampling_level``,
    ``delta``, ``sapo_temperature_pos``...). ``is_ratio_NC``: vLLM's importance ratios ([N, C] or [N, 1]) as
    ``_generate_and_score_completions`` hands them to the loss, with the trainer's ``use_vllm`` and
    ``vllm_importance_sampling_correction`` set for the call (no engine is built).
    All float tensors are float64 (TRL's loss code does not fix a dtype); the mask is int64, as TRL builds it.

    ``steps_per_generation`` S (a multiple of ``grad_accum``): the batch is one generation split into S micro-batches
    (``num_items_in_batch`` its whole mask), run as S / grad_accum optimizer steps of ``grad_accum`` micro-batches;
    the loss returned is their sum. ``out``: a dict that receives ``step_losses`` (each optimizer step's loss),
    ``entropy_grad`` (d loss / d entropies, float64 [N, C], when ``entropies_NC`` is given) and ``entropy_coef``
    (TRL's coefficient after each optimizer step). Accelerate's ``sync_gradients`` is True on each step's last
    micro-batch only, as in training, so the adaptive entropy controller updates at step boundaries. The
    controller's state is reset to the config's before the call.
    """
    import torch
    from trl.trainer.utils import split_tensor_dict

    logps = np.asarray(logps_NC, np.float64)
    if logps.ndim != 2:
        raise ValueError(f"logps_NC must be [N, C], got shape {logps.shape}")
    n, c = logps.shape
    if grad_accum < 1 or n % grad_accum:
        raise ValueError(f"N={n} rows do not split into grad_accum={grad_accum} equal micro-batches")
    if beta != 0.0 and ref_logps_NC is None:
        raise ValueError(f"beta={beta} needs ref_logps_NC")
    splits = grad_accum if steps_per_generation is None else int(steps_per_generation)
    if splits % grad_accum or n % splits:
        raise ValueError(f"steps_per_generation={splits} must be a multiple of grad_accum and divide N={n}")
    micro = n // splits
    config = {
        "loss_type": loss_type,
        "beta": float(beta),
        "epsilon": float(epsilon),
        "epsilon_high": epsilon_high,
        "use_bias_correction_kl": bool(use_bias_correction_kl),
        "gradient_accumulation_steps": grad_accum,
        **({} if steps_per_generation is None else {"steps_per_generation": splits}),
        # _compute_loss reads neither (N need not be a multiple of either): any pair GRPOConfig accepts
        "per_device_train_batch_size": 2,
        "num_generations": 2,
        **options,
    }
    if max_completion_length is not None:
        config["max_completion_length"] = int(max_completion_length)
    trainer = _trainer(1, tuple(sorted(config.items())))

    dtype = torch.float64
    leaf = torch.tensor(logps, dtype=dtype, requires_grad=True)
    mask = torch.as_tensor(np.asarray(mask_NC) != 0).to(torch.long)
    if mask.shape != (n, c):
        raise ValueError(f"mask_NC has shape {tuple(mask.shape)}, logps_NC {(n, c)}")
    batch: dict[str, Any] = {
        "prompt_ids": torch.full((n, 1), TOKEN, dtype=torch.long),
        "prompt_mask": torch.ones((n, 1), dtype=torch.long),
        "completion_ids": torch.full((n, c), TOKEN, dtype=torch.long),
        "completion_mask": mask,
        "advantages": _as_tensor(advantages_N, dtype).reshape(n),
        "num_items_in_batch": mask.sum(),  # TRL: gather(loss_mask.sum()).sum(), over the generation batch
    }
    if old_logps_NC is not None:
        batch["old_per_token_logps"] = _as_tensor(old_logps_NC, dtype)
    if beta != 0.0:
        batch["ref_per_token_logps"] = _as_tensor(ref_logps_NC, dtype)
    if is_ratio_NC is not None:
        batch["importance_sampling_ratio"] = _as_tensor(is_ratio_NC, dtype)
    micro_batches = split_tensor_dict(batch, splits)
    ent_leaf = None
    if entropies_NC is not None:
        ent_leaf = torch.tensor(np.asarray(entropies_NC, np.float64), dtype=dtype, requires_grad=True)

    trainer._metrics["train"].clear()
    trainer.entropy_coef, trainer._last_world_entropy = trainer.args.entropy_coef, math.inf  # a fresh controller
    trainer._entropy_window_stats = None
    step_losses, coefs = [], []
    sync = trainer.accelerator.gradient_state
    trainer.current_gradient_accumulation_steps = grad_accum
    saved = {k: getattr(trainer, k) for k in ("use_vllm", "vllm_importance_sampling_correction")}
    if is_ratio_NC is not None:
        trainer.use_vllm, trainer.vllm_importance_sampling_correction = True, True
    total = 0.0
    try:
        for k, inputs in enumerate(micro_batches):
            rows = leaf[k * micro : (k + 1) * micro]
            ent = torch.zeros_like(rows.detach()) if ent_leaf is None else ent_leaf[k * micro : (k + 1) * micro]

            def stub(model, input_ids, attention_mask, logits_to_keep, *args, _rows=rows, _ent=ent, **kwargs):
                assert input_ids.shape[0] == _rows.shape[0] and logits_to_keep == _rows.shape[1]
                return _rows, (_ent if kwargs.get("compute_entropy") else None), None

            trainer._get_per_token_logps_and_entropies = stub
            last = (k + 1) % grad_accum == 0
            sync._set_sync_gradients(last)
            loss = trainer._compute_loss(trainer.model, inputs)
            loss.backward()
            total += float(loss.detach())
            if k % grad_accum == 0:
                step_losses.append(0.0)
            step_losses[-1] += float(loss.detach())
            if last:
                coefs.append(float(trainer.entropy_coef))
    finally:
        sync._set_sync_gradients(True)
        trainer.__dict__.pop("_get_per_token_logps_and_entropies", None)
        for k, v in saved.items():
            setattr(trainer, k, v)
    metrics = _mean_metrics(trainer._metrics["train"])
    trainer._metrics["train"].clear()
    metrics.pop("entropy", None)  # the stub's zeros, not a model's entropy
    grad = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
    if out is not None:
        out["step_losses"], out["entropy_coef"] = step_losses, coefs
        if ent_leaf is not None:
            eg = ent_leaf.grad if ent_leaf.grad is not None else torch.zeros_like(ent_leaf)
            out["entropy_grad"] = eg.detach().numpy().astype(np.float64)
    return total, grad.detach().numpy().astype(np.float64), metrics


def rewards_in_groups(rewards_NF, num_generations: int) -> np.ndarray:
    """float64 [N, F] (a 1-D input is one reward function), checked to hold whole groups of ``num_generations``."""
    rewards = np.asarray(rewards_NF, np.float64)
    if rewards.ndim == 1:
        rewards = rewards[:, None]
    if rewards.ndim != 2:
        raise ValueError(f"rewards_NF must be [N, F], got shape {rewards.shape}")
    n = rewards.shape[0]
    if num_generations < 2 or n % num_generations:
        raise ValueError(f"N={n} completions do not hold whole groups of num_generations={num_generations} (>= 2)")
    return rewards


def trl_advantages_and_metrics(
    rewards_per_func_NF,
    num_generations: int,
    *,
    reward_weights: Optional[Sequence[float]] = None,
    scale_rewards: str = "group",
    multi_objective_aggregation: str = "sum_then_normalize",
) -> tuple[np.ndarray, dict]:
    """TRL's advantages (float64 numpy [N]) and reward metrics for rewards ``[N, F]`` (NaN: the function gave None).

    Runs the real ``GRPOTrainer._generate_and_score_completions`` on N one-prompt rows (rows
    ``g*G .. g*G+G-1`` are prompt g's group, TRL's order) with ``_generate`` stubbed to fixed short prompts
    and completions; F reward functions ``reward_0 .. reward_{F-1}`` return column i of the rewards (None where
    NaN), through TRL's own ``_calculate_rewards``, so the values are float32 as in TRL. The metrics are those the
    call logs in ``trainer._metrics["train"]``: ``reward``, ``reward_std``, ``frac_reward_zero_std`` and
    ``rewards/reward_{i}/mean``, ``rewards/reward_{i}/std`` (NaN where TRL logs NaN). Only beta 0 is built, so no
    reference forward runs (the advantages do not depend on beta).
    """
    rewards = rewards_in_groups(rewards_per_func_NF, num_generations)
    n, f = rewards.shape
    config = {
        "per_device_train_batch_size": n,
        "num_generations": int(num_generations),
        "beta": 0.0,
        "scale_rewards": scale_rewards,
        "multi_objective_aggregation": multi_objective_aggregation,
        "reward_weights": None if reward_weights is None else [float(w) for w in reward_weights],
    }
    trainer = _trainer(f, tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in sorted(config.items())))

    inputs = [
        {
            "prompt": f"w{3 + (i // num_generations) % 8}",
            **{REWARD_COLUMN.format(j): float(rewards[i, j]) for j in range(f)},
        }
        for i in range(n)
    ]

    def generate(prompts):
        completion_ids = [[TOKEN, EOS] for _ in prompts]
        completions = [f"w{TOKEN}" for _ in prompts]
        return [[TOKEN] for _ in prompts], completion_ids, None, completions, None, {}, None, []

    trainer._metrics["train"].clear()
    trainer._generate = generate
    try:
        out = trainer._generate_and_score_completions(inputs)
    finally:
        trainer.__dict__.pop("_generate", None)
    metrics = _mean_metrics(trainer._metrics["train"])
    trainer._metrics["train"].clear()
    return out["advantages"].detach().double().numpy(), metrics


def trl_vllm_importance_ratio(
    old_logps_NC, sampling_logps_N: Sequence[Sequence[float]], *, mode: str, clip_min=None, clip_max=3.0
) -> tuple[np.ndarray, dict]:
    """TRL's vLLM importance-sampling ratio and its ``sampling/*`` metrics (float64 numpy; [N, C] or [N, 1]).

    Runs the real ``GRPOTrainer._generate_and_score_completions`` on N rows as if vLLM had generated them: the
    trainer's ``use_vllm`` and ``vllm_importance_sampling_*`` attributes are set (no engine is built: ``_generate``
    is stubbed to return completions of ``len(sampling_logps_N[i])`` tokens, NaN -> None as vLLM reports an
    unscored token, with those log-probs), and the trainer's forward is stubbed to return ``old_logps_NC`` (padded
    to the longest completion) as the sampling policy's log-probs.
    """
    import torch

    n = len(sampling_logps_N)
    trainer = _trainer(1, (("beta", 0.0), ("num_generations", n), ("per_device_train_batch_size", n)))
    old = torch.as_tensor(np.asarray(old_logps_NC, np.float64), dtype=torch.float32)
    saved = {k: getattr(trainer, k) for k in ("use_vllm", "vllm_importance_sampling_correction")}
    trainer.use_vllm, trainer.vllm_importance_sampling_correction = True, True
    trainer.vllm_importance_sampling_mode = mode
    trainer.vllm_importance_sampling_clip_min, trainer.vllm_importance_sampling_clip_max = clip_min, clip_max

    def generate(prompts):
        ids = [[TOKEN] * len(s) for s in sampling_logps_N]
        logps = [[None if math.isnan(x) else float(x) for x in s] for s in sampling_logps_N]
        return [[TOKEN] for _ in prompts], ids, None, [f"w{TOKEN}" for _ in prompts], logps, {}, None, []

    def forward(model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        return old[:, :logits_to_keep], None, None

    inputs = [{"prompt": f"w{3 + i % 8}", REWARD_COLUMN.format(0): 1.0} for i in range(n)]
    trainer._metrics["train"].clear()
    trainer._generate, trainer._get_per_token_logps_and_entropies = generate, forward
    try:
        out = trainer._generate_and_score_completions(inputs)
    finally:
        for k in ("_generate", "_get_per_token_logps_and_entropies"):
            trainer.__dict__.pop(k, None)
        for k, v in saved.items():
            setattr(trainer, k, v)
    metrics = {k: v for k, v in _mean_metrics(trainer._metrics["train"]).items() if k.startswith("sampling/")}
    trainer._metrics["train"].clear()
    return out["importance_sampling_ratio"].detach().double().numpy(), metrics
