"""KTO on the torch backend: the loss of an unpaired micro-batch, its reference, the trainer and its builder.

A micro-batch (``common.data.unpaired.KTOBatch``) holds N completions then N mismatched pairs (none for
``apo_zero_unpaired``), padded or padding-free; their sequence log-probs come from DPO's
``logprobs.sequence_logps`` (chunked or fused, never ``[B, T, V]``). The loss family is
``common.objectives.kto.kto_family``, run with torch ops; the KL estimate is computed without gradient. A
micro-batch's loss is its rows' summed losses over the rows of the whole optimizer step. The reference is a frozen
copy of the initial policy, the policy with its adapters disabled (PEFT, as TRL), or precomputed columns.
``loss_type='liger'`` runs Liger's ``LigerFusedLinearKTOLoss`` on the completion rows (``liger_kto_forward``), the
KL estimate and the metrics from a no-grad fused pass beside it.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch

from twinseq.common.config import DEFAULT_CHUNK_SIZE, TrainConfig
from twinseq.common.data.unpaired import (
    KTOBatch,
    build_kto_iterator,
    iter_unpaired_batches,
    prepare_kto_dataset,
    with_kto_ref_logps,
)
from twinseq.common.errors import ConfigError
from twinseq.common.objectives.kto import (
    KTOLossConfig,
    check_liger_kto_config,
    kto_family,
    kto_step_metrics,
    validate_kto_config,
)
from twinseq.common.run.inputs import NO_INPUTS, RunInputs
from twinseq.common.run.schedule import with_resolved_max_steps
from twinseq.common.run.trainer import reference_description
from twinseq.torch_backend.attention import forward_hidden
from twinseq.torch_backend.distributed import Runtime
from twinseq.torch_backend.dpo import TORCH_OPS, frozen_reference, reference_logps
from twinseq.torch_backend.logprobs import sequence_logps
from twinseq.torch_backend.losses import final_logit_softcap, liger_chunked_loss
from twinseq.torch_backend.parallel import parallelize
from twinseq.torch_backend.peft import reference_mode
from twinseq.torch_backend.trainer import DPOTrainer, add_peft, autocast, build_causal_lm, describe, offload_context
from twinseq.torch_backend.unwrap import lm_head_weight

logger = logging.getLogger(__name__)


@dataclass
class KTOOutput:
    """One micro-batch: the scalar loss (normalised by the step's rows) and per-row tensors [N]."""

    loss: torch.Tensor
    losses: torch.Tensor
    logps: torch.Tensor
    rewards: torch.Tensor
    kl: float


def kto_from_logps(
    logps_D: torch.Tensor,
    kbatch: KTOBatch,
    config: KTOLossConfig,
    *,
    ref_logps_D: Optional[torch.Tensor] = None,
    num_examples_in_step: Optional[int] = None,
) -> KTOOutput:
    """KTO loss from the policy's sequence log-probs (completions, then mismatched pairs); the reference's come
    from ``ref_logps_D`` (same layout), else from the batch's precomputed ``ref_logps`` / ``ref_KL_logps``."""
    n = kbatch.num_examples
    if ref_logps_D is None:
        if kbatch.ref_chosen_logps is None:
            raise ConfigError(
                "no reference log-probs: pass ref_logps_D (a reference model's sequence_logps) or precompute them "
                "into the rows (precompute_ref_log_probs=True)."
            )
        mismatched = kbatch.ref_rejected_logps if kbatch.num_kl and kbatch.ref_rejected_logps is not None else None
        parts = np.concatenate([kbatch.ref_chosen_logps, np.zeros(0) if mismatched is None else mismatched])
        ref_logps_D = torch.as_tensor(parts, device=logps_D.device)
    ref_logps_D = ref_logps_D.to(logps_D.dtype).reshape(-1)
    policy, ref = logps_D[:n], ref_logps_D[:n]
    kl = 0.0
    if config.uses_kl and kbatch.num_kl:
        kl = max(0.0, float((logps_D[n:].detach() - ref_logps_D[n:]).mean()))
    labels = torch.as_tensor(kbatch.labels, device=logps_D.device).to(logps_D.dtype)
    losses, rewards = kto_family(policy - ref, labels, kl, config, TORCH_OPS)
    denom = n if num_examples_in_step is None else int(num_examples_in_step)
    if denom < n:
        raise ConfigError(
            f"num_examples_in_step={denom} is smaller than this micro-batch's {n} rows; pass the count of rows of "
            f"the whole optimizer step."
        )
    return KTOOutput(losses.sum() / max(denom, 1), losses, policy, rewards.detach(), kl)


def kto_forward(
    model: torch.nn.Module,
    kbatch: KTOBatch,
    config: KTOLossConfig,
    *,
    ref_logps_D: Optional[torch.Tensor] = None,
    loss_type: str = "fused_linear",
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    num_examples_in_step: Optional[int] = None,
    attn_implementation: Optional[str] = None,
) -> KTOOutput:
    """Policy forward + KTO loss of one micro-batch (graph kept for ``.backward()``)."""
    hidden_BTH = forward_hidden(model, kbatch.batch, attn_implementation)
    logps_D = sequence_logps(
        hidden_BTH, lm_head_weight(model), kbatch, loss_type, chunk_size, logit_softcap=final_logit_softcap(model)
    )
    return kto_from_logps(logps_D, kbatch, config, ref_logps_D=ref_logps_D, num_examples_in_step=num_examples_in_step)


def liger_kto_loss(
    hidden_BTH: torch.Tensor,
    weight_VH: torch.Tensor,
    ref_hidden_BTH: torch.Tensor,
    ref_weight_VH: torch.Tensor,
    kbatch: KTOBatch,
    config: KTOLossConfig,
    kl: float,
    num_examples_in_step: int,
) -> torch.Tensor:
    """Liger's ``LigerFusedLinearKTOLoss`` on the completion rows of a padded ``KTOBatch`` (row i: completion i), with
    the KL estimate ``kl`` (a constant, from the mismatched pairs), as a micro-batch's share of the step's rows.
    Liger's chunked loss is plain torch: it runs wherever torch does (``torch.compile`` on CUDA only); a run asks for
    CUDA (``common.run.capabilities``). ``check_liger_kto_config`` holds what it computes exactly."""
    LigerFusedLinearKTOLoss = liger_chunked_loss("LigerFusedLinearKTOLoss")

    check_liger_kto_config(config, padding_free=kbatch.batch.shape[0] != kbatch.num_docs, precompute=False)
    n = kbatch.num_examples
    labels_BT = torch.as_tensor(kbatch.batch.labels[:n], dtype=torch.long, device=hidden_BTH.device)
    loss_fn = LigerFusedLinearKTOLoss(
        ignore_index=-100,
        beta=config.beta,
        compiled=hidden_BTH.device.type == "cuda",
        use_ref_model=True,
        average_log_prob=False,
    )
    out = loss_fn(
        hidden_BTH[:n, :-1],  # [n, T - 1, H] and the targets [n, T - 1]: Liger shifts nothing
        weight_VH,
        labels_BT[:, 1:],
        preference_labels=torch.as_tensor(kbatch.labels, device=hidden_BTH.device),
        ref_input=ref_hidden_BTH[:n, :-1],
        ref_weight=ref_weight_VH,
        kl=torch.tensor(kl, dtype=torch.float32, device=hidden_BTH.device) if config.uses_kl else None,
    )
    loss = out[0] if isinstance(out, tuple) else out
    return loss * (n / num_examples_in_step)  # Liger divides by this micro-batch's rows


def liger_kto_forward(
    model: torch.nn.Module,
    ref_hidden_BTH: torch.Tensor,
    ref_weight_VH: torch.Tensor,
    kbatch: KTOBatch,
    config: KTOLossConfig,
    *,
    num_examples_in_step: int,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    attn_implementation: Optional[str] = None,
) -> KTOOutput:
    """``kto_forward`` with Liger's fused KTO loss; the KL estimate and the per-row outputs of the metrics come from
    one no-grad ``fused_linear`` pass over the policy's and the reference's hidden states (Liger returns none)."""
    if final_logit_softcap(model) is not None:
        raise ConfigError(
            f"loss_type='liger' for KTO: Liger's fused KTO loss has no final logit soft-cap, and this model caps its "
            f"logits (final_logit_softcapping={final_logit_softcap(model)}); use --loss-type fused_linear."
        )
    weight = lm_head_weight(model)
    hidden_BTH = forward_hidden(model, kbatch.batch, attn_implementation)
    with torch.no_grad():
        policy_D = sequence_logps(hidden_BTH.detach(), weight, kbatch, "fused_linear", chunk_size)
        ref_D = sequence_logps(ref_hidden_BTH, ref_weight_VH, kbatch, "fused_linear", chunk_size)
        out = kto_from_logps(policy_D, kbatch, config, ref_logps_D=ref_D, num_examples_in_step=num_examples_in_step)
    loss = liger_kto_loss(
        hidden_BTH, weight, ref_hidden_BTH, ref_weight_VH, kbatch, config, out.kl, num_examples_in_step
    )
    return KTOOutput(loss, out.losses, out.logps, out.rewards, out.kl)


def reference_logps_D(ref_model: torch.nn.Module, kbatch: KTOBatch, **kw: Any) -> torch.Tensor:
    """The reference's [N + M] sequence log-probs, no graph."""
    completions, mismatched = reference_logps(ref_model, kbatch, **kw)
    return torch.cat([completions, mismatched])


def precompute_kto_ref_logps(ref_model: torch.nn.Module, rows: Any, cfg: TrainConfig, pad_token_id: int) -> Any:
    """``rows`` plus ``ref_logps`` (and ``ref_KL_logps`` with the KL term), from one no-grad pass."""
    with_kl = cfg.kto.kto_loss_type == "kto"
    main, mismatched = [], []
    for _, kbatch in iter_unpaired_batches(
        rows, cfg.data.per_device_train_batch_size, with_kl=with_kl, cfg=cfg, pad_token_id=pad_token_id
    ):
        c, r = reference_logps(
            ref_model,
            kbatch,
            loss_type=cfg.loss.loss_type,
            chunk_size=cfg.loss.loss_chunk_size,
            attn_implementation=cfg.model.attn_implementation,
        )
        main.append(c.double().cpu().numpy())
        mismatched.append(r.double().cpu().numpy())
    return with_kto_ref_logps(rows, np.concatenate(main), np.concatenate(mismatched) if with_kl else None)


class KTOTrainer(DPOTrainer):
    """KTO of the policy (``module.causal_lm``) with ``DPOTrainer``'s reference (a frozen copy of the initial policy,
    the adapter-free base, or precomputed log-probs) and its evaluation hook: a ``KTOBatch`` has DPO's layout, its
    completions where DPO has the chosen sequences and its mismatched pairs where DPO has the rejected ones."""

    def micro_step(self, kbatch: Any) -> KTOOutput:
        if self.cfg.loss.loss_type == "liger":
            return self._liger_micro_step(kbatch)
        c, loss = self.cfg, self.cfg.loss
        kw: dict[str, Any] = dict(
            loss_type=loss.loss_type, chunk_size=loss.loss_chunk_size, attn_implementation=c.model.attn_implementation
        )
        ref = None
        if self.ref_model is not None or self.adapter_reference:
            reference = self.causal_lm if self.ref_model is None else self.ref_model
            context = reference_mode(self.causal_lm) if self.ref_model is None else contextlib.nullcontext()
            with autocast(c, self.device), context:
                ref = reference_logps_D(reference, kbatch, **kw)
        with offload_context(c, self.causal_lm):
            with autocast(c, self.device):
                out = kto_forward(
                    self.causal_lm,
                    kbatch,
                    self.config,
                    ref_logps_D=ref,
                    num_examples_in_step=kbatch.num_examples_in_step or self.examples_per_step,
                    **kw,
                )
            out.loss.backward()
        return out

    def _liger_micro_step(self, kbatch: Any) -> KTOOutput:
        """Liger's fused KTO loss (``liger_kto_forward``): the reference's hidden states, then the policy's step."""
        c = self.cfg
        reference = self.causal_lm if self.ref_model is None else self.ref_model
        context = reference_mode(self.causal_lm) if self.ref_model is None else contextlib.nullcontext()
        with torch.no_grad(), autocast(c, self.device), context:
            ref_hidden = forward_hidden(reference, kbatch.batch, c.model.attn_implementation)
            ref_weight = lm_head_weight(reference).detach()
        with offload_context(c, self.causal_lm):
            with autocast(c, self.device):
                out = liger_kto_forward(
                    self.causal_lm,
                    ref_hidden,
                    ref_weight,
                    kbatch,
                    self.config,
                    num_examples_in_step=kbatch.num_examples_in_step or self.examples_per_step,
                    chunk_size=c.loss.loss_chunk_size,
                    attn_implementation=c.model.attn_implementation,
                )
            out.loss.backward()
        return out

    def summarize(self, records: list[Any], micro_batches: list[Any]) -> dict[str, Any]:
        per_row = {
            "labels": [kb.labels for kb in micro_batches],
            "rewards": [o.rewards.double().cpu().numpy() for o in records],
            "logps": [o.logps.detach().double().cpu().numpy() for o in records],
        }
        return kto_step_metrics(
            self.micro_losses(records),
            per_row,
            [o.kl for o, kb in zip(records, micro_batches) if kb.num_examples],
            num_tokens=sum(kb.batch.num_tokens for kb in micro_batches),
            num_label_tokens=sum(kb.batch.num_label_tokens for kb in micro_batches),
        )


def build_kto(cfg: TrainConfig, device: torch.device, runtime: Optional[Runtime], inputs: RunInputs = NO_INPUTS):
    """(trainer, step source, tokenizer, announce lines) of a KTO run (one process)."""
    if runtime is not None:
        raise ConfigError("task='kto' runs in one process here (as DPO); launch it without torchrun / --fsdp.")
    config = validate_kto_config(
        cfg.kto.kto_loss_type, cfg.dpo.beta, cfg.kto.desirable_weight, cfg.kto.undesirable_weight
    )
    rows, tokenizer, stats = prepare_kto_dataset(cfg, inputs.train_dataset, inputs.tokenizer)
    causal_lm = build_causal_lm(cfg, tokenizer.vocab_size, device, inputs.model)
    if cfg.peft.use_peft:
        causal_lm = add_peft(cfg, causal_lm)
        ref_model = None  # the base: the policy with its adapters disabled (TRL's way)
    else:
        ref_model = frozen_reference(causal_lm)
    if cfg.dpo.precompute_ref_log_probs:
        t0 = time.perf_counter()
        with autocast(cfg, device), reference_mode(causal_lm) if ref_model is None else contextlib.nullcontext():
            rows = precompute_kto_ref_logps(
                causal_lm if ref_model is None else ref_model, rows, cfg, tokenizer.pad_token_id
            )
        logger.info("precomputed reference log-probs of %d rows in %.1fs", len(rows), time.perf_counter() - t0)
        ref_model = None
    source = build_kto_iterator(cfg, rows, tokenizer.pad_token_id, with_kl=config.uses_kl)
    cfg = with_resolved_max_steps(cfg, source)
    module = parallelize(causal_lm, None, cfg)
    announce = [
        describe(cfg, causal_lm, device),
        f"kto_loss_type={config.loss_type}, beta={config.beta}, desirable_weight={config.desirable_weight}, "
        f"undesirable_weight={config.undesirable_weight}, reference="
        f"{reference_description(cfg, precomputed=cfg.dpo.precompute_ref_log_probs)}, "
        f"{source.examples_per_step} rows per step; data: {stats}",
    ]
    trainer = KTOTrainer(
        cfg, module, device, ref_model=ref_model, config=config, examples_per_step=source.examples_per_step
    )
    return trainer, source, tokenizer, announce
