"""TRL 1.16's own KTO code, run in-process on rows we choose: the reference twinseq's KTO is compared with.

``trl_kto_loss_and_grads`` runs the real ``KTOTrainer._compute_loss(model, inputs, return_outputs=False)`` (what
``KTOTrainer.compute_loss`` calls) of one real ``trl.KTOTrainer``, built on the tiny random ``LlamaForCausalLM`` and the
in-memory word-level tokenizer of ``_trl_tiny`` (``use_cpu=True``, nothing downloaded). Unlike the DPO harness, nothing
of the model is stubbed: the batch is built by the trainer's own ``DataCollatorForUnpairedPreference`` from token-id
rows, and TRL's fused-LM-head forward of the policy runs on it, for the mismatched (KL) sequences under ``no_grad`` and
for the completions with the graph. The model is float64 (``tiny_llama().double()``), but TRL's fused LM head
(``trl.kernels.ChunkedLogProbFunction``) accumulates its softmax in float32 and returns float32 per-token log-probs
whatever the model's dtype, and TRL sums them in float32: TRL's sequence log-probs are float32 values (about 1e-6
from float64 ones at -20), its ``logps/*`` metrics float32 sums, and its parameter gradients float32-accurate. From
the sequence log-probs on, TRL's loss is float64 (the float64 reference log-probs promote it), so a twinseq loss fed
TRL's sequence log-probs agrees to float64 rounding, and twinseq's own float64 forward of the same weights
(``policy_model()``) agrees with TRL's loss and parameter gradients to about 1e-7 (measured: loss 1e-8 to 1e-7,
gradients 4e-9 to 3e-7, the most at beta=2).

The forward is wrapped, not replaced: the wrapper calls TRL's fused forward and records its ``log_probs`` (calling
``retain_grad`` on the one with a graph), so the harness also returns TRL's per-sequence log-probs (its
``completion_logps = log_probs.sum(-1)``, the fused head giving 0 off the completion), those of the mismatched pairs,
and d loss / d completion_logps (the gradient reaching any completion token of a row's ``log_probs``: the sequence
log-prob is their sum).

Reference log-probs: the trainer is built with ``precompute_ref_log_probs=True``, so ``ref_model`` is None and
``_compute_loss`` reads ``inputs["ref_logps"]`` / ``inputs["ref_KL_logps"]`` (sequence sums [N]) from the batch, where
the rows' values go. TRL's collator makes them float32 tensors (``torch.tensor`` of Python floats); the harness puts
float64 tensors of the same values in their place after collation (TRL's own precomputed values come from a float32
model, so that rounding is not TRL's rule, only its storage). ``KTOTrainer.__init__`` runs its precompute pass over
a 2-row in-memory dataset (one tiny forward; the cache file it writes goes to ``datasets``' temporary directory,
removed at exit); those values are never used.

``trl_kto_prepare`` runs the trainer's real ``_prepare_dataset`` (prompt extraction, ``unpair_preference_dataset``,
EOS, tokenisation, the KL rotation within blocks of ``per_device_train_batch_size``) on a string dataset; with the
tiny tokenizer the string ``"w7"`` is token 7, so tests can write rows whose token ids are known.
``trl_unpair_ids`` runs ``trl.data_utils.unpair_preference_dataset`` on rows that are already token ids (the function
only moves column values, whatever they hold).

Trainers are cached per configuration (``functools.lru_cache``): the first call imports TRL and builds (about 10 s);
another configuration's trainer builds in about 0.3 s; a loss call takes 10 to 50 ms (CPU).

No test lives here; tests import it (it needs ``trl``, ``transformers``, ``datasets`` and ``tokenizers``).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from tests.torch_backend._trl_tiny import tiny_llama, tokenizer

RUNNING_METRICS = ("num_tokens",)
"""Metrics ``_compute_loss`` logs as a running count of the cached trainer: not returned."""


@contextlib.contextmanager
def _quiet():
    """No progress bars from the dataset maps and the precompute pass (noise in a test's output)."""
    from datasets.utils import logging as ds_logging
    from transformers.utils import logging as hf_logging

    bars, ds_bars = hf_logging.is_progress_bar_enabled(), ds_logging.is_progress_bar_enabled()
    tqdm_env = os.environ.get("TQDM_DISABLE")
    hf_logging.disable_progress_bar()
    ds_logging.disable_progress_bar()
    os.environ["TQDM_DISABLE"] = "1"  # _precompute_ref_logps's own tqdm reads it
    try:
        yield
    finally:
        if tqdm_env is None:
            os.environ.pop("TQDM_DISABLE", None)
        else:
            os.environ["TQDM_DISABLE"] = tqdm_env
        if bars:
            hf_logging.enable_progress_bar()
        if ds_bars:
            ds_logging.enable_progress_bar()


def _key(**config: Any) -> tuple:
    return tuple(sorted(config.items()))


@functools.lru_cache(maxsize=None)
def _trainer(config_items: tuple):
    """One ``KTOTrainer`` per tuple of KTOConfig keyword items, kept for the session."""
    from datasets import Dataset
    from trl import KTOConfig, KTOTrainer

    out_dir = tempfile.mkdtemp(prefix="twinseq_trl_kto_")
    atexit.register(shutil.rmtree, out_dir, ignore_errors=True)
    args = KTOConfig(
        output_dir=out_dir,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        seed=0,
        precompute_ref_log_probs=True,  # ref_model None; _compute_loss reads inputs["ref_logps"], ["ref_KL_logps"]
        **dict(config_items),
    )
    with _quiet():
        # two unpaired rows, one-token prompts, completions ending in EOS: the __init__ precompute pass is one forward
        rows = Dataset.from_list(
            [{"prompt": f"w{3 + i}", "completion": f" w{5 + i} <eos>", "label": bool(i % 2)} for i in range(2)]
        )
        trainer = KTOTrainer(model=tiny_llama().double(), args=args, train_dataset=rows, processing_class=tokenizer())
    if trainer.ref_model is not None or not trainer.precompute_ref_logps:
        raise RuntimeError("expected a KTOTrainer with precomputed reference log-probs and no reference model")
    fresh = policy_model().state_dict()
    for name, value in trainer.model.state_dict().items():
        if not bool((value == fresh[name]).all()):
            raise RuntimeError(f"the trainer's {name} is not tiny_llama()'s: policy_model() would not be its copy")
    trainer.model.train()  # _compute_loss reads mode "train" from self.model.training
    return trainer


def warm() -> None:
    """Import TRL and build the default trainer now (the first build takes about 10 s)."""
    _trainer(_key(loss_type="kto", beta=0.1, desirable_weight=1.0, undesirable_weight=1.0, max_length=None))


def policy_model():
    """A fresh float64 copy of the harness's policy (``tiny_llama().double()``: every trainer's weights, checked when
    it is built; TRL's fused head not added), for twinseq's side."""
    return tiny_llama().double()


def _mean_metrics(metrics: Mapping[str, list]) -> dict[str, float]:
    """As ``KTOTrainer.log`` averages one logging window (one call here: one value per metric)."""
    return {key: sum(float(v) for v in values) / len(values) for key, values in metrics.items() if values}


@dataclass
class TRLKTOResult:
    """One ``_compute_loss`` call: the loss, the logged metrics and what the forwards gave."""

    loss: float
    metrics: dict  # kl, rewards/chosen|rejected|margins, logps/chosen|rejected, entropy, logits/chosen|rejected
    logps: np.ndarray  # float64 [N]: TRL's completion_logps (float32 values), rows in the given order
    kl_logps: Optional[np.ndarray]  # float64 [N]: the mismatched pairs' (float32 values, no graph); None without KL
    logps_grad: np.ndarray  # float64 [N]: d loss / d completion_logps
    grads: dict  # parameter name -> float64 array: d loss / d parameter (zeros where no gradient reached)
    batch: dict  # the collated inputs handed to _compute_loss


def trl_kto_loss_and_grads(
    rows: Sequence[Mapping[str, Any]],
    *,
    loss_type: str = "kto",
    beta: float = 0.1,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
    max_length: Optional[int] = None,
) -> TRLKTOResult:
    """TRL's KTO loss of one micro-batch of ``rows`` and its gradients.

    ``rows``: dicts in TRL's tokenised layout: ``prompt_ids``, ``completion_ids`` (lists of ids in [3, 64); the
    completion non-empty), ``label`` (bool), ``ref_logps`` (float, the reference's completion log-prob) and, for
    ``loss_type='kto'``, ``KL_completion_ids`` and ``ref_KL_logps`` (ignored, and not handed over, for
    ``'apo_zero_unpaired'``, whose collator gets no KL column). ``max_length`` is the collator's cut of every
    sequence (TRL's ``max_length``; None: no cut, and the sequences must fit the model's 64 positions).
    """
    import torch

    if not rows:
        raise ValueError("rows must hold at least one row")
    calculate_kl = loss_type != "apo_zero_unpaired"
    config = dict(
        loss_type=loss_type,
        beta=float(beta),
        desirable_weight=float(desirable_weight),
        undesirable_weight=float(undesirable_weight),
        max_length=max_length,
    )
    trainer = _trainer(_key(**config))
    if trainer.calculate_KL != calculate_kl:
        raise RuntimeError(f"TRL's calculate_KL={trainer.calculate_KL} for loss_type={loss_type!r}")
    fields = ["prompt_ids", "completion_ids", "label", "ref_logps"]
    if calculate_kl:
        fields += ["KL_completion_ids", "ref_KL_logps"]
    examples = []
    for i, row in enumerate(rows):
        missing = [f for f in fields if f not in row]
        if missing:
            raise ValueError(f"row {i} lacks {missing}")
        example = {f: row[f] for f in fields}
        for f in ("prompt_ids", "completion_ids", "KL_completion_ids"):
            if f in example:
                example[f] = [int(t) for t in example[f]]
        example["label"] = bool(example["label"])
        examples.append(example)
    inputs = trainer.data_collator(examples)
    for f in ("ref_logps", "ref_KL_logps"):
        if f in fields:
            inputs[f] = torch.tensor([float(r[f]) for r in rows], dtype=torch.float64)

    model = trainer.model
    fused_forward = model.__dict__["forward"]  # add_fused_lm_head's instance forward
    calls: list = []

    def spy(*args, **kwargs):
        out = fused_forward(*args, **kwargs)
        if out.log_probs.requires_grad:
            out.log_probs.retain_grad()
        calls.append((out.log_probs, kwargs["labels"]))
        return out

    model.zero_grad(set_to_none=True)
    trainer._metrics["train"].clear()
    model.forward = spy
    try:
        loss = trainer._compute_loss(model, inputs, return_outputs=False)
    finally:
        model.forward = fused_forward
    loss.backward()
    metrics = _mean_metrics(trainer._metrics["train"])
    trainer._metrics["train"].clear()
    for key in RUNNING_METRICS:
        metrics.pop(key, None)

    if len(calls) != (2 if calculate_kl else 1):
        raise RuntimeError(f"expected {2 if calculate_kl else 1} policy forwards, saw {len(calls)}")
    (main, labels), kl = calls[-1], calls[0] if calculate_kl else None
    if not main.requires_grad or (kl is not None and kl[0].requires_grad):
        raise RuntimeError("expected the completions' forward with a graph and the KL forward without one")
    valid = labels[:, 1:] != -100  # the fused head's mask, after its shift
    grad = main.grad if main.grad is not None else torch.zeros_like(main)
    logps_grad = []
    for i in range(main.shape[0]):
        g = grad[i][valid[i]]
        if g.numel() == 0 or (g - g[0]).abs().max() > 1e-12:
            raise RuntimeError(f"row {i}: the gradient is not one value over the completion tokens: {g.tolist()}")
        logps_grad.append(float(g[0]))
    grads = {
        name: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().double().numpy().copy()
        for name, p in model.named_parameters()
    }
    model.zero_grad(set_to_none=True)
    return TRLKTOResult(
        loss=float(loss.detach()),
        metrics=metrics,
        logps=main.detach().sum(-1).double().numpy().copy(),
        kl_logps=None if kl is None else kl[0].detach().sum(-1).double().numpy().copy(),
        logps_grad=np.asarray(logps_grad, np.float64),
        grads=grads,
        batch={k: v.clone() if hasattr(v, "clone") else v for k, v in inputs.items()},
    )


def trl_kto_prepare(
    dataset: Any, *, per_device_train_batch_size: int = 2, loss_type: str = "kto", max_length: Optional[int] = None
) -> list[dict]:
    """The rows of ``KTOTrainer._prepare_dataset(dataset, ...)`` under that configuration (a ``datasets.Dataset`` or a
    list of dicts of strings: unpaired ``prompt``/``completion``/``label`` or paired ``prompt``/``chosen``/
    ``rejected``): dicts with ``prompt_ids``, ``completion_ids``, ``label`` and, with the KL term,
    ``KL_completion_ids`` (the string columns are dropped)."""
    from datasets import Dataset

    if not isinstance(dataset, Dataset):
        dataset = Dataset.from_list(list(dataset))
    trainer = _trainer(
        _key(loss_type=loss_type, per_device_train_batch_size=int(per_device_train_batch_size), max_length=max_length)
    )
    with _quiet():
        out = trainer._prepare_dataset(dataset, trainer.processing_class, trainer.args, "test")
    keep = ("prompt_ids", "completion_ids", "label", "KL_completion_ids")
    return [{k: row[k] for k in keep if k in row} for row in out]


def trl_unpair_ids(prompts: Sequence, chosen: Sequence, rejected: Sequence) -> dict[str, list]:
    """``trl.data_utils.unpair_preference_dataset`` on paired rows whose values are token-id lists: the columns
    ``prompt``, ``completion`` and ``label``, in TRL's order."""
    from datasets import Dataset
    from trl.data_utils import unpair_preference_dataset

    columns = {
        name: [[int(t) for t in ids] for ids in values]
        for name, values in (("prompt", prompts), ("chosen", chosen), ("rejected", rejected))
    }
    paired = Dataset.from_dict(columns)
    with _quiet():
        out = unpair_preference_dataset(paired)
    return {k: list(out[k]) for k in ("prompt", "completion", "label")}
