"""GRPO on the torch backend: completion log-probs from hidden states, the loss family, and the step trainer.

One optimizer step (``GRPOTrainer``: ``common.run.rollout.GroupRollout`` on ``common.run.trainer.TrainerTemplate``):

1. every ``num_iterations`` steps, the common rollout generates ``num_generations`` completions per
   prompt (here: ``generation.generate``, KV cache, left-padded prompts, or a colocated vLLM), scores
   them with the reward functions and turns the rewards into group advantages (``common.objectives.grpo``); with
   ``num_iterations > 1`` keep the sampling policy's log-probs, with ``grpo_beta > 0`` the
   reference's (the policy with its adapters disabled under PEFT, else a frozen copy);
2. split the completions into micro-batches of ``per_device_train_batch_size``; each
   computes its completion-token log-probs chunk by chunk from hidden states
   (``logprobs.token_logps``: the token-loss kernel ``loss_type``; ``fused_linear`` never
   holds a ``[tokens, V]`` tensor), over a padded or a padding-free batch
   (``common.objectives.grpo.collate_completions``), and back-propagates its share of the step loss.

The loss is ``common.objectives.grpo_loss.grpo_loss`` written with torch ops (``grpo_loss_torch``); both are
tested equal. Logits are divided by the sampling ``temperature`` before the softmax, as TRL
does, so that the ratio compares the distribution the completions were drawn from.
"""

from __future__ import annotations

import copy
import importlib.util
import logging
import time
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist

from twinseq.common.config import DEFAULT_CHUNK_SIZE, TrainConfig
from twinseq.common.data.prefix_sharing import shares_prefix
from twinseq.common.data.prepare import run_tokenizer
from twinseq.common.data.prompts import prepare_grpo_prompts, resolve_reward_funcs
from twinseq.common.errors import ConfigError, MissingDependencyError
from twinseq.common.objectives.grpo import CompletionBatch, collate_completions, reward_func_name
from twinseq.common.objectives.grpo_loss import (
    CLIP_LOSS_TYPES,
    VESPO_LOG_W_MIN,
    LossSpec,
    StepShare,
    vllm_importance_ratios,
)
from twinseq.common.run.capabilities import GPU_EXTRA
from twinseq.common.run.inputs import NO_INPUTS, RunInputs
from twinseq.common.run.rollout import GroupRollout, bonus_sums, generation_source, loss_description, token_record
from twinseq.common.run.schedule import with_resolved_max_steps
from twinseq.common.run.trainer import reference_description
from twinseq.torch_backend import triton_ce
from twinseq.torch_backend.attention import forward_hidden
from twinseq.torch_backend.distributed import Runtime
from twinseq.torch_backend.generation import generate
from twinseq.torch_backend.grpo_context_parallel import CPCompletionShard, completion_shard, cp_completion_logps
from twinseq.torch_backend.logprobs import TargetRows, token_logps, token_logps_entropy
from twinseq.torch_backend.losses import apply_logit_softcap, final_logit_softcap, liger_chunked_loss
from twinseq.torch_backend.parallel import parallelize
from twinseq.torch_backend.peft import reference_mode
from twinseq.torch_backend.trainer import (
    TorchTrainer,
    add_peft,
    autocast,
    build_causal_lm,
    cp_reference,
    describe,
    offload_context,
)
from twinseq.torch_backend.unwrap import lm_head_weight
from twinseq.torch_backend.vllm_engine import check_vllm, engine_for_grpo

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------
# Log-probs and entropy of completion tokens
# --------------------------------------------------------------------------------------


@torch.no_grad()
def chunked_entropy(
    hidden_nH: torch.Tensor,
    weight_VH: torch.Tensor,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    logit_softcap: Optional[float] = None,
) -> torch.Tensor:
    """[n] entropy of ``softmax(softcap(hidden @ W.T))`` per row, ``chunk_size`` rows of logits at a time (no graph).

    Naive equivalent: ``-(softmax(z) * log_softmax(z)).sum(-1)`` with ``z = c * tanh(h @ W.T / c)`` for a
    ``logit_softcap`` c (the distribution the model samples from), ``z = h @ W.T`` without one.
    """
    acc = torch.promote_types(hidden_nH.dtype, torch.float32)  # fp32, or fp64 for an fp64 model (tests)
    out = torch.empty(hidden_nH.shape[0], dtype=acc, device=hidden_nH.device)
    for s in range(0, hidden_nH.shape[0], chunk_size):
        logits_cV = torch.nn.functional.linear(hidden_nH[s : s + chunk_size], weight_VH).to(acc)
        logp_cV = torch.log_softmax(apply_logit_softcap(logits_cV, logit_softcap), -1)
        out[s : s + chunk_size] = -(logp_cV.exp() * logp_cV).sum(-1)
        del logp_cV
    return out


def _scatter_NC(values_n: torch.Tensor, cb: CompletionBatch) -> torch.Tensor:
    out = values_n.new_zeros((cb.num_docs, cb.num_columns))
    rows = torch.as_tensor(cb.token_row_n, device=values_n.device)
    cols = torch.as_tensor(cb.token_col_n, device=values_n.device)
    return out.index_put((rows, cols), values_n)


_logged_entropy_fallback: list[bool] = []


def completion_logps(
    model: torch.nn.Module,
    cb: CompletionBatch,
    *,
    loss_type: str = "fused_linear",
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    temperature: float = 1.0,
    attn_implementation: Optional[str] = None,
    with_entropy: bool = False,
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(log-probs [N, C], entropy [N, C] or None) of each completion token under ``model``; 0 past a completion.
    ``entropy_grad``: the entropy keeps its gradient (the entropy bonus; ``logprobs.token_logps_entropy``), else it
    is a constant.

    Naive equivalent, for completion i and its token j at flattened position t + 1::

        logp[i, j] = log_softmax(hidden[t] @ W.T / temperature)[input_ids[t + 1]]

    The graph is kept (for ``.backward()``) when grad is enabled.
    """
    cap = final_logit_softcap(model)
    if cap is not None and temperature != 1.0:
        raise ConfigError(
            f"temperature={temperature} with a model that soft-caps its logits (final_logit_softcapping="
            f"{cap}): the temperature would have to divide the capped logits, which the fused "
            f"kernels do not do; use --temperature 1.0 with this model."
        )
    hidden_BTH = forward_hidden(model, cb.batch, attn_implementation)
    if temperature != 1.0:
        hidden_BTH = hidden_BTH / temperature  # (h / T) @ W.T = logits / T, exactly the sampled distribution
    weight = lm_head_weight(model)
    rows = TargetRows.of(cb, weight.shape[0], hidden_BTH.device)
    if with_entropy and entropy_grad:
        if loss_type == "triton" and not _logged_entropy_fallback:
            _logged_entropy_fallback.append(True)
            logger.info(
                "entropy bonus: the Triton kernel has no entropy gradient; the log-probs and entropies come from "
                "fused_linear's chunked kernel (FusedLinearLogpsEntropy)"
            )
        logps_n, ent_n = token_logps_entropy(hidden_BTH, weight, rows, loss_type, chunk_size, logit_softcap=cap)
        return _scatter_NC(logps_n, cb), _scatter_NC(ent_n, cb)
    if with_entropy and loss_type == "triton" and triton_ce.kernel_runs(hidden_BTH):
        # the kernel's forward yields the entropy in the same pass over the vocabulary
        hidden_nH = hidden_BTH.reshape(-1, hidden_BTH.shape[-1]).index_select(0, rows.idx_n)
        logps_n, ent_n, _ = triton_ce.linear_logps(
            hidden_nH, weight, rows.targets_n, logit_softcap=cap, with_entropy=True
        )
        return _scatter_NC(logps_n, cb), _scatter_NC(ent_n.detach(), cb)
    logps_n = token_logps(hidden_BTH, weight, rows, loss_type, chunk_size, logit_softcap=cap)
    entropy = None
    if with_entropy:
        hidden_nH = hidden_BTH.detach().reshape(-1, hidden_BTH.shape[-1]).index_select(0, rows.idx_n)
        entropy = _scatter_NC(chunked_entropy(hidden_nH, weight.detach(), chunk_size, cap), cb)
    return _scatter_NC(logps_n, cb), entropy


# --------------------------------------------------------------------------------------
# The loss (common.objectives.grpo_loss.grpo_loss with torch ops)
# --------------------------------------------------------------------------------------


def vespo_weights_torch(
    log_ratio_NC: torch.Tensor,
    adv_N1: torch.Tensor,
    m: torch.Tensor,
    spec: LossSpec,
    is_ratio_NC: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """VESPO's gamma weight per completion [N, 1] (``common.objectives.grpo_loss.vespo_weights_np``), without
    gradient."""
    seq = (log_ratio_NC.clamp(-20.0, 20.0) * m).sum(-1, keepdim=True)
    if is_ratio_NC is not None:
        seq = seq + torch.log(is_ratio_NC.to(seq.dtype)).clamp(VESPO_LOG_W_MIN, 20.0).sum(-1, keepdim=True)
    log_w = seq.clamp(VESPO_LOG_W_MIN, 20.0)
    nonneg = adv_N1 >= 0
    k = torch.where(nonneg, spec.vespo_k_pos, spec.vespo_k_neg).to(log_w.dtype)
    lam = torch.where(nonneg, spec.vespo_lambda_pos, spec.vespo_lambda_neg).to(log_w.dtype).clamp(min=1e-4)
    return torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def grpo_loss_torch(
    logps_NC: torch.Tensor,
    advantages_N: torch.Tensor,
    mask_NC: torch.Tensor,
    spec: LossSpec,
    share: StepShare = StepShare(),  # noqa: B008 (an immutable NamedTuple)
    *,
    old_logps_NC: Optional[torch.Tensor] = None,
    ref_logps_NC: Optional[torch.Tensor] = None,
    entropy_NC: Optional[torch.Tensor] = None,
    is_ratio_NC: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """(this micro-batch's ``share`` of the step loss, metrics): ``common.objectives.grpo_loss.grpo_loss`` in torch;
    ``is_ratio_NC``: vLLM's importance ratios (a constant), None without vLLM. With ``spec.entropy_bonus`` the
    entropy's gradient flows through the bonus ``-share.entropy_coef x`` its token mean (the quantile mask, as the
    policy loss's, is a constant); the metrics then add ``common.run.rollout.bonus_sums`` (the policy loss's share,
    the bonus tokens' entropy sum and count: step sums, not token means)."""
    m = mask_NC.to(logps_NC.dtype)
    old = logps_NC.detach() if old_logps_NC is None else old_logps_NC.to(logps_NC.dtype)
    adv = advantages_N.to(logps_NC.dtype)[:, None]
    log_ratio = logps_NC - old
    if spec.loss_type == "rloo":  # one ratio per completion, of its summed log-ratio
        log_ratio = (log_ratio * m).sum(-1, keepdim=True)
    elif spec.importance_sampling_level == "sequence":
        log_ratio = (log_ratio * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1.0)
    ratio = torch.exp(log_ratio)
    count = m.sum().clamp(min=1.0)
    metrics: dict[str, float] = {}
    kl = None
    if spec.beta > 0:
        if ref_logps_NC is None:
            raise ConfigError(
                f"grpo_beta={spec.beta} > 0 needs the reference model's log-probs: pass ref_logps_NC, or set "
                f"grpo_beta=0."
            )
        delta = ref_logps_NC.to(logps_NC.dtype) - logps_NC
        kl = torch.exp(delta) - delta - 1
        if spec.use_bias_correction_kl:  # times the (differentiable) ratio: the unbiased reverse-KL gradient
            kl = kl * ratio
        metrics["kl"] = float((kl.detach() * m).sum() / count)
    if spec.loss_type == "cispo":
        per_token = -torch.clamp(ratio, max=spec.eps_high).detach() * adv * logps_NC
    elif spec.loss_type == "sapo":
        tau = torch.where(adv > 0, spec.sapo_temperature_pos, spec.sapo_temperature_neg).to(logps_NC.dtype)
        per_token = -torch.sigmoid(tau * (ratio - 1)) * (4 / tau) * adv
    elif spec.loss_type == "vespo":
        phi = vespo_weights_torch((logps_NC - old).detach(), adv, m, spec, is_ratio_NC)
        metrics["vespo/phi_seq_mean"] = float(phi.mean())
        per_token = -phi * adv * logps_NC
    else:
        clipped = torch.clamp(ratio, 1 - spec.epsilon, 1 + spec.eps_high)
        if spec.delta is not None:
            ratio = torch.clamp(ratio, max=spec.delta)
        per_token = -torch.minimum(ratio * adv, clipped * adv)
    if spec.off_policy_mask_threshold is not None:  # TRL's get_off_policy_mask, on the sampling policy's log-probs
        with torch.no_grad():
            gap = torch.nan_to_num(old - logps_NC.detach(), nan=0.0)
            mean_gap = (gap * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1.0)
            keep = ((adv >= 0) | (mean_gap <= spec.off_policy_mask_threshold)).to(per_token.dtype)
        per_token = per_token * keep
    if spec.top_entropy_quantile < 1.0:  # TRL's get_high_entropy_mask over this (one-process) micro-batch
        if entropy_NC is None:
            raise ConfigError(
                f"top_entropy_quantile={spec.top_entropy_quantile} masks tokens by entropy and needs entropy_NC: "
                f"pass the completion tokens' entropies, or set top_entropy_quantile=1.0."
            )
        with torch.no_grad():
            valid = m > 0
            e = entropy_NC.detach().to(per_token.dtype)
            high = torch.zeros_like(e)
            if valid.any():  # every completion masked (mask_truncated_completions): no token keeps a loss
                high = ((e * m >= torch.quantile(e[valid], 1.0 - spec.top_entropy_quantile)) & valid).to(e.dtype)
        per_token = per_token * high
        bonus_mask = m * high
    else:
        bonus_mask = m
    if is_ratio_NC is not None and spec.loss_type != "vespo":
        per_token = per_token * is_ratio_NC.to(per_token.dtype)
    if kl is not None:
        per_token = per_token + spec.beta * kl
    n = logps_NC.shape[0]
    summed = per_token * m
    if spec.loss_type in ("grpo", "sapo"):
        loss = (summed.sum(-1) / m.sum(-1).clamp(min=1.0)).sum() / (share.num_sequences_in_step or n)
    elif spec.loss_type == "luspo":
        loss = summed.sum() / (share.num_sequences_in_step or n)
    elif spec.loss_type == "rloo":  # one loss per completion, masked or not
        loss = per_token[:, 0].sum() / (share.num_sequences_in_step or n)
    elif spec.loss_type == "bnpo":
        loss = summed.sum() / count / share.num_micro_batches
    elif spec.loss_type == "dr_grpo":
        assert spec.max_completion_length is not None  # LossSpec refuses dr_grpo without it
        loss = summed.sum() / ((share.num_sequences_in_step or n) * spec.max_completion_length)
    else:  # dapo, cispo, vespo (LossSpec refuses any other)
        loss = summed.sum() / max(float(share.num_tokens_in_step or m.sum()), 1.0)
    if spec.entropy_bonus:  # TRL's: a token mean of this micro-batch, divided for accumulation only
        if entropy_NC is None:
            raise ConfigError(
                f"entropy_coef={share.entropy_coef} adds an entropy bonus and needs entropy_NC: pass the completion "
                f"tokens' entropies, or set entropy_coef=0."
            )
        ent = entropy_NC.to(loss.dtype) * bonus_mask
        count = bonus_mask.sum()
        metrics.update(bonus_sums(float(loss.detach()), float(ent.detach().sum()), float(count)))
        loss = loss - share.entropy_coef * ent.sum() / count.clamp(min=1.0) / share.num_micro_batches
    with torch.no_grad():
        r = ratio.detach()
        mm = m > 0 if r.shape[1] > 1 else torch.ones_like(r, dtype=torch.bool)
        seen = max(int(mm.sum()), 1)
        if spec.loss_type == "cispo":
            metrics["cispo_clip_ratio"] = int(((r > spec.eps_high) & (adv > 0) & mm).sum()) / seen
        elif spec.loss_type in CLIP_LOSS_TYPES:
            low = (r < 1 - spec.epsilon) & (adv < 0) & mm
            high = (r > 1 + spec.eps_high) & (adv > 0) & mm
            metrics["clip_ratio/low_mean"] = int(low.sum()) / seen
            metrics["clip_ratio/high_mean"] = int(high.sum()) / seen
            metrics["clip_ratio/region_mean"] = int((low | high).sum()) / seen
    return loss, metrics


# --------------------------------------------------------------------------------------
# Liger (CUDA)
# --------------------------------------------------------------------------------------


def check_liger_grpo(device: Any) -> None:
    """Raise (and log) unless Liger's fused GRPO loss can run here: a CUDA device and the liger-kernel package."""
    if torch.device(device).type != "cuda":
        msg = (
            "use_liger_kernel=True (loss_type='liger') for GRPO runs Liger's fused GRPO loss, which needs a CUDA "
            f"GPU with liger-kernel (`{GPU_EXTRA}`); on CPU use --loss-type fused_linear, the same chunked "
            "log-probs without a [tokens, vocab] tensor."
        )
        logger.error(msg)
        raise ConfigError(msg)
    if importlib.util.find_spec("liger_kernel") is None:
        raise MissingDependencyError(
            f"loss_type='liger' needs the liger-kernel package; install the gpu extra "
            f"with `{GPU_EXTRA}`, or use --loss-type fused_linear."
        )


def liger_grpo_loss(
    model: torch.nn.Module,
    micro: "GRPOMicroBatch",
    spec: LossSpec,
    share: StepShare,
    temperature: float,
    attn_implementation: Optional[str] = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Liger's ``LigerFusedLinearGRPOLoss`` on the padded completion positions of a micro-batch (CUDA).

    Liger normalises by its own micro-batch; its loss is rescaled to this micro-batch's share of
    the step (``dapo``: tokens of the step; the others: as TRL's trainer does with Liger)."""
    LigerFusedLinearGRPOLoss = liger_chunked_loss("LigerFusedLinearGRPOLoss")

    cb = micro.cb
    hidden_BTH = forward_hidden(model, cb.batch, attn_implementation)
    rows = TargetRows.of(cb, lm_head_weight(model).shape[0], hidden_BTH.device)
    hidden_nH = hidden_BTH.reshape(-1, hidden_BTH.shape[-1]).index_select(0, rows.idx_n)
    hidden_NCH = _scatter_rows(hidden_nH, cb)
    ids_NC = _scatter_NC(rows.targets_n, cb)
    mask_NC = micro.mask_NC
    eps_low, eps_high = spec.epsilon, spec.epsilon if spec.epsilon_high is None else spec.epsilon_high
    loss_fn = LigerFusedLinearGRPOLoss(
        compiled=hidden_BTH.device.type == "cuda",  # plain torch elsewhere (tests run it on CPU)
        beta=spec.beta,
        epsilon_low=eps_low,
        epsilon_high=eps_high,
        temperature=temperature,
        use_ref_model=spec.beta > 0,
        use_bias_correction_kl=spec.use_bias_correction_kl,
        loss_type=spec.loss_type,
        max_completion_length=spec.max_completion_length,
    )
    out = loss_fn(
        hidden_NCH,
        lm_head_weight(model),
        ids_NC,
        mask_NC.to(hidden_NCH.dtype),
        micro.advantages_N,
        ref_per_token_logps=micro.ref_logps_NC,
        old_per_token_logps=micro.old_logps_NC,
    )
    loss, extra = (out[0], out[1]) if isinstance(out, tuple) else (out, [])
    n, tokens = mask_NC.shape[0], float(mask_NC.sum().clamp(min=1))
    scale = {
        "dapo": tokens / max(share.num_tokens_in_step or tokens, 1.0),
        "grpo": n / (share.num_sequences_in_step or n),
        "dr_grpo": n / (share.num_sequences_in_step or n),
        "bnpo": 1.0 / share.num_micro_batches,
    }[spec.loss_type]
    metrics = {}
    if spec.beta > 0 and len(extra) > 0:
        metrics["kl"] = float(extra[0])
    return loss * scale, metrics


def _scatter_rows(values_nH: torch.Tensor, cb: CompletionBatch) -> torch.Tensor:
    out = values_nH.new_zeros((cb.num_docs, cb.num_columns, values_nH.shape[-1]))
    rows = torch.as_tensor(cb.token_row_n, device=values_nH.device)
    cols = torch.as_tensor(cb.token_col_n, device=values_nH.device)
    return out.index_put((rows, cols), values_nH)


# --------------------------------------------------------------------------------------
# The generated batch and its micro-batches
# --------------------------------------------------------------------------------------


@dataclass
class GRPOMicroBatch:
    """One micro-batch of completions: its collated batch, loss mask, advantages and kept log-probs."""

    cb: CompletionBatch
    mask_NC: torch.Tensor
    advantages_N: torch.Tensor
    old_logps_NC: Optional[torch.Tensor] = None
    ref_logps_NC: Optional[torch.Tensor] = None
    is_ratio_NC: Optional[torch.Tensor] = None  # vLLM's importance ratios, [N, C] or [N, 1]


def split_micro_batches(
    prompt_ids: Sequence[Sequence[int]],
    completions: Sequence[np.ndarray],
    mask_NC: np.ndarray,
    advantages_N: np.ndarray,
    micro_size: int,
    *,
    padding_free: bool,
    pad_token_id: int,
    device: torch.device,
    num_columns: int,
    pad_to_multiple_of: Optional[int] = None,
    share_prefix: bool = False,
) -> list[GRPOMicroBatch]:
    """Consecutive slices of ``micro_size`` completions, collated (``collate_completions``; ``share_prefix``: the
    completions of one prompt in a slice share it)."""
    out = []
    for s in range(0, len(completions), micro_size):
        sl = slice(s, s + micro_size)
        cb = collate_completions(
            prompt_ids[sl],
            completions[sl],
            padding_free=padding_free,
            pad_token_id=pad_token_id,
            num_columns=num_columns,
            pad_to_multiple_of=pad_to_multiple_of,
            share_prefix=share_prefix,
        )
        out.append(
            GRPOMicroBatch(
                cb,
                torch.as_tensor(mask_NC[sl], device=device),
                torch.as_tensor(advantages_N[sl], dtype=torch.float32, device=device),
            )
        )
    return out


# --------------------------------------------------------------------------------------
# The step trainer
# --------------------------------------------------------------------------------------


class GRPOTrainer(GroupRollout, TorchTrainer):
    """GRPO's torch trainer: ``common.run.rollout.GroupRollout`` (generation every ``num_iterations`` steps, rewards,
    advantages, the step's metrics) on ``TorchTrainer``'s hooks; here only what is torch: sampling (HF generate
    with a KV cache, or a colocated vLLM engine), the kept log-probs, and the micro-step.

    Under context parallelism (``runtime`` with ``cp > 1``: FSDP2 over exactly the cp ranks) every rank generates
    the same completions (the same seed and weights, the model's own attention, ``synced_gpus``) and keeps rank 0's
    (broadcast: exactly one set); the log-prob forwards run sharded (``grpo_context_parallel``)."""

    def __init__(
        self,
        cfg: TrainConfig,
        module: torch.nn.Module,
        device: torch.device,
        *,
        tokenizer: Any,
        reward_funcs: Sequence[Any],
        ref_model: Optional[torch.nn.Module] = None,
        vllm: Optional[Any] = None,
        runtime: Optional[Runtime] = None,
        generation_attn: Optional[str] = None,
    ) -> None:
        super().__init__(cfg, module, device, runtime)
        self.generation_attn = generation_attn  # under cp: the HF attention generation runs (the cp one needs shards)
        self.init_rollout(cfg, tokenizer, reward_funcs)
        self.ref_model = ref_model
        self.vllm = vllm  # a vllm_engine.ColocatedVLLM: generation by vLLM instead of HF generate
        self._vllm_sync_seconds: Optional[float] = None
        self._sampling_logps: Optional[list] = None  # the engine's log-prob of each sampled token, per row
        self._is_metrics: dict[str, float] = {}

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), **self.rollout_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.load_rollout_state(state)

    # -- GroupRollout's backend hooks ----------------------------------------------------------

    def sample(self, prompt_ids: list[list[int]], **extra: Any) -> np.ndarray:
        """``generation.generate`` on the training model (KV cache, left-padded prompts); ``extra``: its other
        keywords (``synced_gpus``). With a vLLM engine: the policy's weights are synced into it, it generates,
        and (sleep mode) it sleeps through the update."""
        g, tok = self.cfg.grpo, self.tokenizer
        if self.vllm is not None:
            return self._vllm_sample(prompt_ids)
        if self.runtime is not None and not extra:
            return self._cp_sample(prompt_ids)
        return generate(
            self.causal_lm,
            prompt_ids,
            max_completion_length=self.max_completion_length,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
            temperature=g.temperature,
            top_p=g.top_p,
            top_k=g.top_k,
            greedy=g.generation_greedy,
            **extra,
        ).completion_ids

    def _cp_sample(self, prompt_ids: list[list[int]]) -> np.ndarray:
        """Generation under context parallelism: inside the FSDP2 root's forward (which gathers the root parameters),
        with the model's own attention in place of the cp one, every rank stepping until all are done; rank 0's
        completions are broadcast to the others."""
        assert self.generation_attn is not None, "build_grpo passes the generation attention under cp"
        model_config: Any = self.causal_lm.config
        cp_attn = model_config._attn_implementation

        def run(causal_lm: Any) -> np.ndarray:
            causal_lm.set_attn_implementation(self.generation_attn)
            try:
                with autocast(self.cfg, self.device):
                    return self.sample(prompt_ids, synced_gpus=True)
            finally:
                causal_lm.set_attn_implementation(cp_attn)

        try:
            ids = [self.module(run)]
        finally:
            self.reshard()
        dist.broadcast_object_list(ids, src=0)
        return ids[0]

    def _vllm_sample(self, prompt_ids: list[list[int]]) -> np.ndarray:
        """Sync the weights (every generation follows at least one optimizer step, or is the first), generate
        with vLLM, put it to sleep; the completions right-padded as ``generation.generate`` returns them."""
        g, tok = self.cfg.grpo, self.tokenizer
        assert self.vllm is not None
        t0 = time.perf_counter()
        self.vllm.sync_weights(self.causal_lm)
        self._vllm_sync_seconds = time.perf_counter() - t0
        self._sampling_logps = [] if self.vllm_is else None
        rows = self.vllm.generate(
            prompt_ids,
            logprobs=self._sampling_logps,
            max_new_tokens=self.max_completion_length,
            temperature=g.temperature,
            top_p=g.top_p,
            top_k=g.top_k,
            do_sample=not g.generation_greedy,
            seed=(self.cfg.seed + self.num_generations_done) * 100_003,
            eos_token_id=tok.eos_token_id,
        )
        self.vllm.sleep()
        ids = np.full((len(rows), max(map(len, rows))), tok.pad_token_id, dtype=np.int64)
        for i, row in enumerate(rows):
            ids[i, : len(row)] = row
        return ids

    def generation_metrics(self) -> dict[str, float]:
        sync = {} if self._vllm_sync_seconds is None else {"vllm/weight_sync_seconds": self._vllm_sync_seconds}
        return {**sync, **self._is_metrics}

    def build_micro_batches(
        self,
        prompt_ids: list[list[int]],
        completions: list[np.ndarray],
        loss_mask_NC: np.ndarray,
        advantages_N: np.ndarray,
        num_columns: int,
    ) -> list[GRPOMicroBatch]:
        d = self.cfg.data
        micro = split_micro_batches(
            prompt_ids,
            completions,
            loss_mask_NC,
            advantages_N,
            d.per_device_train_batch_size,
            padding_free=d.padding_free,
            pad_token_id=self.tokenizer.pad_token_id,
            device=self.device,
            num_columns=num_columns,
            pad_to_multiple_of=d.pad_to_multiple_of,
            share_prefix=shares_prefix(self.cfg),
        )
        self._kept_logps(micro)
        if self.vllm_is and self._sampling_logps is not None:
            self._importance_ratios(micro, self._sampling_logps)
        return micro

    def _importance_ratios(self, micro: list[GRPOMicroBatch], sampling: list) -> None:
        """vLLM's importance-sampling correction (``common.objectives.grpo_loss.vllm_importance_ratios``): each
        micro-batch's ratios, and TRL's ``sampling/*`` metrics of the generation."""
        assert all(mb.old_logps_NC is not None for mb in micro)  # keeps_old_logps is on with the correction
        old = np.concatenate([mb.old_logps_NC.double().cpu().numpy() for mb in micro])  # type: ignore[union-attr]
        mask = np.concatenate([mb.mask_NC.double().cpu().numpy() for mb in micro])
        ratio, self._is_metrics = vllm_importance_ratios(old, mask, sampling, self.cfg.grpo)
        s = 0
        for mb in micro:
            n = mb.mask_NC.shape[0]
            mb.is_ratio_NC = torch.as_tensor(ratio[s : s + n], dtype=torch.float32, device=self.device)
            s += n

    def kl_sums(self, micro: list[GRPOMicroBatch]) -> np.ndarray:
        out = []
        for mb in micro:
            assert mb.old_logps_NC is not None and mb.ref_logps_NC is not None  # kept when kl_beta > 0
            gap = (mb.old_logps_NC.double() - mb.ref_logps_NC.double()) * mb.mask_NC.double()
            out.append(gap.sum(-1).cpu().numpy())
        return np.concatenate(out)

    def set_advantages(self, micro: list[GRPOMicroBatch], advantages_N: np.ndarray) -> None:
        s = 0
        for mb in micro:
            n = mb.mask_NC.shape[0]
            mb.advantages_N = torch.as_tensor(advantages_N[s : s + n], dtype=torch.float32, device=self.device)
            s += n

    # -- what a multi-rank engine overrides (zero3_grpo.Zero3GRPOTrainer) ------------------

    def _forward(self, fn: Any) -> Any:
        """``fn(causal_lm)``: the policy forward of a micro-batch (a ZeRO-3 engine runs it in its root forward,
        where the LM head's weight is gathered; FSDP2's root forward gathers the root parameters alike)."""
        return fn(self.causal_lm) if self.runtime is None else self.module(fn)

    def _backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    @torch.no_grad()
    def _kept_logps(self, micro: list[GRPOMicroBatch]) -> None:
        """The sampling policy's log-probs (``keeps_old_logps``) and the reference's (``kl_beta > 0``)."""
        c, g = self.cfg, self.cfg.grpo
        kw: dict[str, Any] = dict(
            loss_type="fused_linear" if c.loss.loss_type == "liger" else c.loss.loss_type,
            chunk_size=c.loss.loss_chunk_size,
            temperature=g.temperature,
            attn_implementation=c.model.attn_implementation,
        )
        if self.runtime is not None:
            return self._cp_kept_logps(micro, kw)
        for mb in micro:
            with autocast(c, self.device):
                if self.keeps_old_logps:
                    mb.old_logps_NC = self._forward(lambda lm, cb=mb.cb: completion_logps(lm, cb, **kw)[0]).float()
                if self.kl_beta > 0:
                    if self.ref_model is not None:
                        mb.ref_logps_NC = completion_logps(self.ref_model, mb.cb, **kw)[0].float()
                    else:
                        with reference_mode(self.causal_lm):
                            mb.ref_logps_NC = completion_logps(self.causal_lm, mb.cb, **kw)[0].float()

    # -- context parallelism ----------------------------------------------------------------

    @property
    def cp(self) -> int:
        return 1 if self.runtime is None else self.runtime.mesh_cfg.cp

    def _cp_logps(self, lm: torch.nn.Module, shard: CPCompletionShard, **kw: Any):
        assert self.runtime is not None
        return cp_completion_logps(lm, shard, self.runtime.cp_group, self.cfg.parallel.context_parallel_strategy, **kw)

    def _cp_kept_logps(self, micro: list[GRPOMicroBatch], kw: dict[str, Any]) -> None:
        """``_kept_logps`` under context parallelism: this rank's shard of each micro-batch through the sampling
        policy (inside the FSDP2 root's forward) and the reference, the per-token log-probs summed over the cp group."""
        assert self.runtime is not None
        c = self.cfg
        kw = {k: v for k, v in kw.items() if k != "attn_implementation"}
        for mb in micro:
            shard = completion_shard(mb.cb, self.cp, self.runtime.cp_rank, self.device)
            with autocast(c, self.device):
                if self.keeps_old_logps:
                    mb.old_logps_NC = self.module(lambda lm, s=shard: self._cp_logps(lm, s, **kw)[0]).float()
                if self.kl_beta > 0:
                    if self.ref_model is not None:
                        mb.ref_logps_NC = self._cp_logps(self.ref_model, shard, **kw)[0].float()
                    else:
                        with reference_mode(self.causal_lm):
                            mb.ref_logps_NC = self.module(lambda lm, s=shard: self._cp_logps(lm, s, **kw)[0]).float()
        self.reshard()

    def _cp_policy(self, mb: GRPOMicroBatch, **kw: Any):
        """The policy's log-probs of ``mb`` under context parallelism, as ``completion_logps`` returns them."""
        assert self.runtime is not None
        shard = completion_shard(mb.cb, self.cp, self.runtime.cp_rank, self.device)
        return lambda lm: self._cp_logps(lm, shard, **kw)

    # -- the micro-step --------------------------------------------------------------------

    def micro_step(self, mb: GRPOMicroBatch) -> dict[str, float]:
        c = self.cfg
        with offload_context(c, self.causal_lm):
            with autocast(c, self.device):
                if c.loss.loss_type == "liger":
                    loss, metrics = liger_grpo_loss(
                        self.causal_lm, mb, self.loss_spec, self.share, c.grpo.temperature, c.model.attn_implementation
                    )
                    entropy = None
                else:
                    kw: dict[str, Any] = dict(
                        loss_type=c.loss.loss_type,
                        chunk_size=c.loss.loss_chunk_size,
                        temperature=c.grpo.temperature,
                        with_entropy=True,
                        entropy_grad=self.loss_spec.entropy_bonus,
                    )
                    logps_of = (
                        (lambda lm: completion_logps(lm, mb.cb, attn_implementation=c.model.attn_implementation, **kw))
                        if self.runtime is None
                        else self._cp_policy(mb, **kw)
                    )

                    def policy(lm: torch.nn.Module) -> tuple[torch.Tensor, dict, Optional[torch.Tensor]]:
                        logps, entropy = logps_of(lm)
                        loss, metrics = grpo_loss_torch(
                            logps.float(),
                            mb.advantages_N,
                            mb.mask_NC,
                            self.loss_spec,
                            self.share,
                            old_logps_NC=mb.old_logps_NC,
                            ref_logps_NC=mb.ref_logps_NC,
                            entropy_NC=entropy,
                            is_ratio_NC=mb.is_ratio_NC,
                        )
                        return loss, metrics, entropy

                    loss, metrics, entropy = self._forward(policy)
            self._backward(loss)
        m = mb.mask_NC.float()
        record = token_record(float(loss.detach()), float(m.sum()), mb.cb.batch.num_tokens, metrics)
        if entropy is not None:
            record["entropy_sum"] = float((entropy.detach() * m).sum())
        return record


# --------------------------------------------------------------------------------------
# `twinseq train --task grpo --backend torch`
# --------------------------------------------------------------------------------------


def build_grpo(
    cfg: TrainConfig,
    device: torch.device,
    runtime: Any,
    reward_funcs: Optional[Sequence[Any]] = None,
    inputs: RunInputs = NO_INPUTS,
):
    """(trainer, source, tokenizer, announce lines) of a GRPO run, in one process or under FSDP2 + context parallelism
    over exactly ``cp`` ranks (``common.run.capabilities`` refuses the rest); ``reward_funcs`` (names or callables;
    else ``inputs.reward_funcs``) overrides ``cfg.grpo.reward_funcs``."""
    if runtime is not None and cfg.parallel.context_parallel_size == 1:
        raise ConfigError(
            f"task={cfg.task} runs in one process on the torch backend here (generation is not sharded); "
            "launch it without torchrun/accelerate."
        )
    g = cfg.grpo
    if g.use_vllm:  # before anything loads
        check_vllm(
            enable_sleep_mode=g.vllm_enable_sleep_mode,
            sleep_level=g.vllm_sleep_level,
            gpu_memory_utilization=g.vllm_gpu_memory_utilization,
            cuda_available=device.type == "cuda",
        )
    if not g.ds3_gather_for_generation:
        logger.warning(
            "ds3_gather_for_generation=False only changes generation under DeepSpeed ZeRO-3; this run "
            "holds the full weights, so it has no effect"
        )
    if cfg.loss.loss_type == "liger":
        check_liger_grpo(device)
    tokenizer = run_tokenizer(cfg, inputs.tokenizer)
    funcs = resolve_reward_funcs(reward_funcs or inputs.reward_funcs or g.reward_funcs)
    rows = prepare_grpo_prompts(cfg, tokenizer, inputs.train_dataset)
    causal_lm = build_causal_lm(cfg, tokenizer.vocab_size, device, inputs.model)
    ref_model = None
    if cfg.peft.use_peft:
        causal_lm = add_peft(cfg, causal_lm)  # the reference is the base: adapters disabled
    elif cfg.reference_kl_beta > 0:
        ref_model = copy.deepcopy(causal_lm).requires_grad_(False).eval()
        if runtime is not None:
            ref_model = cp_reference(ref_model, cfg, runtime)
    model_config: Any = causal_lm.config
    generation_attn = model_config._attn_implementation  # before parallelize switches to the cp attention
    module = parallelize(causal_lm, runtime, cfg)
    source, generation_batch = generation_source(cfg, rows)
    cfg = with_resolved_max_steps(cfg, source)  # max_steps=-1: num_train_epochs passes over the source
    engine = None
    if g.use_vllm:
        engine = engine_for_grpo(cfg, causal_lm, max(len(r["prompt_input_ids"]) for r in rows), generation_batch)
    generation = (
        "HF generate (KV cache)"
        if engine is None
        else f"vLLM colocate, sleep {'level ' + str(g.vllm_sleep_level) if g.vllm_enable_sleep_mode else 'off'}"
    )
    trainer = GRPOTrainer(
        cfg,
        module,
        device,
        tokenizer=tokenizer,
        reward_funcs=funcs,
        ref_model=ref_model,
        vllm=engine,
        runtime=runtime,
        generation_attn=generation_attn,
    )
    announce = [
        describe(cfg, causal_lm, device),
        f"{cfg.task}: {len(rows)} prompts, {source.prompts_per_step} prompts x {g.num_generations} generations = "
        f"{generation_batch} completions per generation, {trainer.generation_parts} optimizer step(s) each, "
        f"max_completion_length={trainer.max_completion_length}, "
        f"{loss_description(cfg)}, reference={reference_description(cfg)}, num_iterations="
        f"{g.num_iterations}, rewards={[reward_func_name(f) for f in funcs]}, generation={generation}",
    ]
    if runtime is not None:
        m = runtime.mesh_cfg
        announce.append(
            f"mesh: cp={m.cp} on {m.world_size} ranks ({dist.get_backend()}), FSDP2 over the cp ranks, cp strategy="
            f"{cfg.parallel.context_parallel_strategy}; every rank generates the same completions (rank 0's are "
            f"broadcast) and scores T/cp tokens of each row, the per-token log-probs summed over the cp group"
        )
    return trainer, source, tokenizer, announce
