"""TRL 1.16's own DPO loss code, run in-process on log-probs we choose: the reference twinseq's DPO is compared with.

``trl_dpo_loss_and_grads`` runs the real ``DPOTrainer._compute_loss(model, inputs, return_outputs=False)`` (what
``DPOTrainer.compute_loss`` calls) of one real ``trl.DPOTrainer``: a tiny random ``LlamaForCausalLM`` built from
``LlamaConfig`` in memory, an in-memory word-level tokenizer, ``use_cpu=True``, no download. Trainers are cached per
configuration (``functools.lru_cache``): the first call imports TRL and builds, about 9 s; another configuration's
trainer builds in about 0.15 s, and a call on a built trainer takes about 8 ms (CPU).

What is patched: only the model forward. ``DPOTrainer.__init__`` gives the model a fused LM head
(``trl.trainer.utils.add_fused_lm_head``, an instance ``forward``), and ``_compute_loss`` calls
``model(input_ids=..., attention_mask=..., use_cache=False, labels=labels, fused_lm_head=True)`` and reads
``outputs.log_probs[:, -seq_len:]`` (then sums it over the sequence: the fused head returns 0 wherever the label is
-100, so that sum is over the completion tokens). For the duration of the call, the instance's ``forward`` is replaced
by a stub returning TRL's own ``FusedCausalLMOutput`` whose ``log_probs`` is our float64 leaf tensor, rows
``[chosen; rejected]`` (TRL's batch is ``[chosen, rejected]``), zeroed where the shifted label is -100 exactly as the
fused head does (``masked_fill(~mask, 0)``); ``entropy``, ``mean_logits`` and ``is_top1`` are zeros/False (they only
feed the ``entropy``, ``logits/*`` and ``mean_token_accuracy`` metrics, which are therefore left out of the returned
metrics, with the cumulative ``num_tokens``). ``use_weighting`` stays False, so ``log_sum_sq_probs`` is never read;
``ld_alpha`` is None, ``f_divergence_type`` is TRL's default ``"reverse_kl"``, no Liger, no MoE aux loss.

The batch handed to ``_compute_loss`` is what ``DataCollatorForPreference`` would build for one-token prompts:
``input_ids`` [2N, 1 + T] (a prompt token then T completion tokens), ``completion_mask`` [2N, 1 + T] = ``[0, mask]``
(so ``shift_completion_mask`` is our [2N, T] mask, which TRL uses for ``ipo``/``sigmoid_norm`` lengths and ``sft``),
``attention_mask`` of ones, and the reference log-probs.

Reference log-probs: the trainer is built with ``precompute_ref_log_probs=True``, so ``ref_model`` is None and
``_compute_loss`` takes ``inputs["ref_chosen_logps"]`` / ``inputs["ref_rejected_logps"]`` (sequence sums, [N]) from
the batch, where we put ours: no reference forward runs. ``DPOTrainer.__init__`` does run its precompute pass
(``_precompute_ref_logps``) over the train dataset; it is made cheap and harmless by giving the trainer a 2-row
dataset of one-token prompts and completions (one tiny forward; the dataset is in memory, so its cache file goes
to ``datasets``' temporary directory, removed at exit); the values it computes are never used: we pass our own batch.

Dtype: every float tensor is float64 (TRL's loss code is dtype-generic; TRL itself would hand it float32 log-probs).
One exception is TRL's: ``exo_pair`` builds ``epsilon = torch.tensor(label_smoothing)`` (float32), so its
``log(eps)`` and ``log1p(-eps)`` constants are float32-rounded before entering the float64 loss.

No test lives here; tests import it (it needs ``trl``, ``transformers``, ``datasets`` and ``tokenizers``).
"""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import tempfile
from typing import Optional, Sequence, Union

import numpy as np

from tests.torch_backend._trl_tiny import TOKEN, tiny_llama, tokenizer

STUB_METRICS = ("entropy", "num_tokens", "logits/chosen", "logits/rejected", "mean_token_accuracy")
"""Metrics ``_compute_loss`` logs from the stub's placeholder outputs (or a running token count): not returned."""


@functools.lru_cache(maxsize=None)
def _trainer(config_items: tuple):
    """One ``DPOTrainer`` per tuple of DPOConfig keyword items, kept for the session."""
    from datasets import Dataset
    from datasets.utils import logging as ds_logging
    from transformers.utils import logging as hf_logging
    from trl import DPOConfig, DPOTrainer

    out_dir = tempfile.mkdtemp(prefix="twinseq_trl_dpo_")
    atexit.register(shutil.rmtree, out_dir, ignore_errors=True)
    options = {k: list(v) if isinstance(v, tuple) else v for k, v in config_items}  # loss_type, loss_weights: lists
    args = DPOConfig(
        output_dir=out_dir,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        seed=0,
        precompute_ref_log_probs=True,  # ref_model None; _compute_loss reads inputs["ref_*_logps"]
        use_weighting=False,
        ld_alpha=None,
        f_divergence_type="reverse_kl",
        **options,
    )
    bars = hf_logging.is_progress_bar_enabled()
    ds_bars = ds_logging.is_progress_bar_enabled()
    tqdm_env = os.environ.get("TQDM_DISABLE")
    hf_logging.disable_progress_bar()  # dataset maps and the precompute pass: noise in a test's output
    ds_logging.disable_progress_bar()
    os.environ["TQDM_DISABLE"] = "1"  # _precompute_ref_logps's own tqdm reads it
    try:
        # two rows, one-token prompt and completions ending in EOS: the __init__ precompute pass is one tiny forward
        pairs = Dataset.from_list(
            [{"prompt": f"w{3 + i}", "chosen": f" w{5 + i} <eos>", "rejected": f" w{7 + i} <eos>"} for i in range(2)]
        )
        # a tiny random Llama, in memory: with precomputed reference log-probs TRL builds no reference model
        trainer = DPOTrainer(model=tiny_llama(), args=args, train_dataset=pairs, processing_class=tokenizer())
    finally:
        if tqdm_env is None:
            os.environ.pop("TQDM_DISABLE", None)
        else:
            os.environ["TQDM_DISABLE"] = tqdm_env
        if bars:
            hf_logging.enable_progress_bar()
        if ds_bars:
            ds_logging.enable_progress_bar()
    if trainer.ref_model is not None or not trainer.precompute_ref_logps:
        raise RuntimeError("expected a DPOTrainer with precomputed reference log-probs and no reference model")
    trainer.model.train()  # _compute_loss reads mode "train" from self.model.training
    return trainer


def _mean_metrics(metrics: dict[str, list]) -> dict[str, float]:
    """As ``DPOTrainer.log`` averages one logging window (one call here: one value per metric)."""
    return {key: sum(float(v) for v in values) / len(values) for key, values in metrics.items() if values}


def trl_dpo_loss_and_grads(
    chosen_logps_NT,
    rejected_logps_NT,
    chosen_mask_NT,
    rejected_mask_NT,
    ref_chosen_N,
    ref_rejected_N,
    *,
    loss_type: Union[str, Sequence[str]] = ("sigmoid",),
    loss_weights: Optional[Sequence[float]] = None,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    discopop_tau: float = 0.05,
) -> tuple[float, np.ndarray, np.ndarray, dict]:
    """TRL's DPO loss on N pairs: (loss, d loss / d chosen_logps_NT, d loss / d rejected_logps_NT, metrics).

    ``chosen_logps_NT`` / ``rejected_logps_NT``: the policy's per-token log-probs of the chosen / rejected
    completions [N, T]; ``chosen_mask_NT`` / ``rejected_mask_NT``: their completion masks (nonzero = a completion
    token; TRL's fused head gives 0 elsewhere, so values there do not count and get zero gradient);
    ``ref_chosen_N`` / ``ref_rejected_N``: the reference SEQUENCE log-probs [N] (sums over the completion tokens),
    which enter as TRL's precomputed ``ref_chosen_logps`` / ``ref_rejected_logps`` batch columns.

    ``loss_type``: one TRL loss type or several (combined by TRL as ``sum(w_i * mean(loss_i))`` with
    ``loss_weights``, default all 1.0); ``beta``, ``label_smoothing`` (robust, exo_pair (must be > 0 there: TRL
    raises otherwise), aot, aot_unpaired) and ``discopop_tau`` are the DPOConfig fields of those names.

    Gradients are float64 [N, T] arrays. Metrics are those the call logs in ``trainer._metrics["train"]``:
    ``rewards/chosen``, ``rewards/rejected``, ``rewards/accuracies``, ``rewards/margins``, ``logps/chosen``,
    ``logps/rejected`` (the stub-derived ``entropy``, ``logits/*``, ``mean_token_accuracy`` and ``num_tokens`` are
    left out).
    """
    import torch
    from trl.trainer.utils import FusedCausalLMOutput

    chosen = np.asarray(chosen_logps_NT, np.float64)
    rejected = np.asarray(rejected_logps_NT, np.float64)
    if chosen.ndim != 2 or rejected.shape != chosen.shape:
        raise ValueError(f"chosen/rejected log-probs must both be [N, T], got {chosen.shape} and {rejected.shape}")
    n, t = chosen.shape
    masks = [np.asarray(m) for m in (chosen_mask_NT, rejected_mask_NT)]
    if any(m.shape != (n, t) for m in masks):
        raise ValueError(f"masks have shapes {[m.shape for m in masks]}, log-probs {(n, t)}")
    refs = [np.asarray(r, np.float64).reshape(-1) for r in (ref_chosen_N, ref_rejected_N)]
    if any(r.shape != (n,) for r in refs):
        raise ValueError(f"reference log-probs have shapes {[r.shape for r in refs]}, expected ({n},)")

    loss_types = (loss_type,) if isinstance(loss_type, str) else tuple(str(x) for x in loss_type)
    config = {
        "loss_type": loss_types,
        "loss_weights": None if loss_weights is None else tuple(float(w) for w in loss_weights),
        "beta": float(beta),
        "label_smoothing": float(label_smoothing),
        "discopop_tau": float(discopop_tau),
    }
    trainer = _trainer(tuple(sorted(config.items())))

    dtype = torch.float64
    leaf = torch.tensor(np.concatenate([chosen, rejected]), dtype=dtype, requires_grad=True)  # [2N, T]
    mask = torch.as_tensor(np.concatenate(masks) != 0).to(torch.long)
    completion_mask = torch.cat([torch.zeros((2 * n, 1), dtype=torch.long), mask], dim=1)  # [2N, 1 + T]
    inputs = {
        "input_ids": torch.full((2 * n, 1 + t), TOKEN, dtype=torch.long),
        "attention_mask": torch.ones((2 * n, 1 + t), dtype=torch.long),
        "completion_mask": completion_mask,
        "ref_chosen_logps": torch.tensor(refs[0], dtype=dtype),
        "ref_rejected_logps": torch.tensor(refs[1], dtype=dtype),
    }

    def stub(*args, fused_lm_head=False, labels=None, **kwargs):
        assert fused_lm_head and not args and labels is not None and labels.shape == (2 * n, 1 + t)
        valid = labels[:, 1:] != -100  # the fused head's mask, after its shift
        zeros = torch.zeros_like(leaf.detach())
        return FusedCausalLMOutput(
            log_probs=leaf.masked_fill(~valid, 0.0),
            entropy=zeros,
            mean_logits=zeros,
            is_top1=torch.zeros_like(valid),
            label_mask=valid,
        )

    model = trainer.model
    fused_forward = model.__dict__["forward"]  # add_fused_lm_head's instance forward
    trainer._metrics["train"].clear()
    model.forward = stub
    try:
        loss = trainer._compute_loss(model, inputs, return_outputs=False)
    finally:
        model.forward = fused_forward
    loss.backward()
    metrics = _mean_metrics(trainer._metrics["train"])
    trainer._metrics["train"].clear()
    for key in STUB_METRICS:
        metrics.pop(key, None)
    grad = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
    grad_np = grad.detach().numpy().astype(np.float64)
    return float(loss.detach()), grad_np[:n].copy(), grad_np[n:].copy(), metrics
