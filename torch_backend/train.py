"""The PyTorch training loop: SFT on the common data pipeline, one optimizer step at a time.

Per step: ``gradient_accumulation_steps`` micro-batches from ``common.loader.StepIterator``,
each loss already normalised by the label count of the whole step, so the summed gradients
equal one big batch's. AdamW with a warmup schedule, optional gradient checkpointing,
activation offloading (CUDA), bf16 autocast (CUDA) and ``torch.compile``.
"""

from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path
from typing import Any, Optional

import torch

from twinseq.common.config import TrainConfig, resolve_model_config
from twinseq.common.init import init_weights
from twinseq.common.metrics import RunLogger, finish_run, peak_rss_bytes
from twinseq.common.schedule import lr_multiplier

logger = logging.getLogger(__name__)


def pick_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def validate_runtime(cfg: TrainConfig, device: torch.device) -> None:
    """Refuse configurations this machine cannot run correctly, before any work is done."""
    from twinseq.torch_backend.attention import check_attention_supported

    check_attention_supported(cfg.attn_implementation, padding_free=cfg.padding_free or cfg.packing,
                              device=device)
    if cfg.loss_type == "liger" and device.type != "cuda":
        raise ValueError("loss_type='liger' (or use_liger_kernel=True) needs a CUDA GPU with liger-kernel "
                         "(`pip install -e '.[gpu]'`); on CPU use --loss-type fused_linear, which never "
                         "materialises the logits either.")
    if cfg.activation_offloading and device.type != "cuda":
        raise ValueError("activation_offloading=True moves activations from GPU to CPU memory and has no "
                         "meaning on a CPU-only run; drop --activation-offloading or run on CUDA. "
                         "--gradient-checkpointing saves activation memory on CPU.")


def build_training_model(cfg: TrainConfig, vocab_size: int, device: torch.device):
    from twinseq.torch_backend.model import build_model, load_pretrained

    if Path(cfg.model_config).is_dir():
        model = load_pretrained(cfg.model_config, attn_implementation=cfg.attn_implementation)
    else:
        model_cfg = resolve_model_config(cfg.model_config)
        if model_cfg.vocab_size < vocab_size:
            raise ValueError(f"model_config={cfg.model_config!r} has vocab_size={model_cfg.vocab_size} but the "
                             f"tokenizer has {vocab_size} tokens; use a tokenizer of at most that size.")
        model = build_model(model_cfg, init_weights(model_cfg, seed=cfg.seed),
                            attn_implementation=cfg.attn_implementation)
    model.to(device)
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model


def build_optimizer(model: torch.nn.Module, cfg: TrainConfig):
    """AdamW; weight decay on matrices only (norm scales are not decayed), as HF Trainer does."""
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=cfg.learning_rate, betas=(cfg.adam_beta1, cfg.adam_beta2),
                                  eps=cfg.adam_epsilon, foreach=False)
    warmup, total, kind = cfg.effective_warmup_steps, cfg.max_steps, cfg.lr_scheduler_type
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda k: lr_multiplier(k, warmup_steps=warmup, max_steps=total, scheduler=kind))
    return optimizer, scheduler


def _autocast(cfg: TrainConfig, device: torch.device):
    if cfg.dtype == "bfloat16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _offload_context(cfg: TrainConfig, model):
    if not cfg.activation_offloading:
        return contextlib.nullcontext()
    from twinseq.torch_backend.offload import offload_activations

    return offload_activations(model, loss_type=cfg.loss_type)


class MicroStep:
    """Forward + loss + backward of one micro-batch; returns (loss, metrics) as floats."""

    def __init__(self, model, cfg: TrainConfig, device: torch.device) -> None:
        from twinseq.torch_backend.attention import forward_hidden
        from twinseq.torch_backend.losses import causal_lm_loss

        self.model, self.cfg, self.device = model, cfg, device
        self._forward_hidden, self._loss = forward_hidden, causal_lm_loss
        self._compiled = torch.compile(self._forward_loss, dynamic=True) if cfg.torch_compile else self._forward_loss

    def _forward_loss(self, batch):
        hidden_BTH = self._forward_hidden(self.model, batch, self.cfg.attn_implementation)
        labels_BT = torch.as_tensor(batch.labels, dtype=torch.long, device=self.device)
        return self._loss(hidden_BTH, self.model.lm_head.weight, labels_BT, batch.num_items_in_batch,
                          self.cfg.loss_type, chunk_size=self.cfg.loss_chunk_size, return_metrics=True)

    def __call__(self, batch) -> tuple[float, dict[str, float]]:
        with _offload_context(self.cfg, self.model):
            with _autocast(self.cfg, self.device):
                loss, metrics = self._compiled(batch)
            loss.backward()
        return float(loss.detach()), {k: float(v) for k, v in metrics.items()}


def _peak_memory(device: torch.device) -> int:
    return int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else peak_rss_bytes()


def _merge_metrics(per_micro: list[tuple[float, dict[str, float], int]]) -> dict[str, float]:
    """Counts and sums add up over micro-batches; means are re-weighted by label tokens."""
    total = sum(n for _, _, n in per_micro) or 1
    out = {}
    for key in per_micro[0][1]:
        if key == "num_tokens":
            continue
        if key.startswith("num_") or key.endswith("_sum"):
            out[key] = sum(m[key] for _, m, _ in per_micro)
        else:
            out[key] = sum(m[key] * n for _, m, n in per_micro) / total
    return out


def clip_grad_norm_fp64_(parameters, max_norm: float) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` (``grads *= min(1, max_norm / (norm + 1e-6))``, returns the
    pre-clip total norm), with the norm accumulated in float64.

    torch's float32 norm on CPU is off by ~1e-4 relative on the embedding gradient (2.84467 vs
    2.84508), which moved every clipped step off the JAX trainer's trajectory (parity_tests/
    TOLERANCES.md). The same two steps as torch's own ``get_total_norm`` + ``clip_grads_with_norm_``,
    so DTensor (FSDP2) gradients work as before.
    """
    params = [p for p in parameters if p.grad is not None]
    if not params:
        return torch.tensor(0.0, dtype=torch.float64)
    device = params[0].grad.device
    norms = [torch.linalg.vector_norm(p.grad, 2.0, dtype=torch.float64).to(device) for p in params]
    total = torch.linalg.vector_norm(torch.stack(norms), 2.0)
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


def train_step(model, optimizer, scheduler, micro_step: MicroStep, batches, cfg: TrainConfig) -> dict[str, Any]:
    per_micro = []
    for batch in batches:
        loss, metrics = micro_step(batch)
        per_micro.append((loss, metrics, batch.num_label_tokens))
    grad_norm = (clip_grad_norm_fp64_(model.parameters(), cfg.max_grad_norm)
                 if cfg.max_grad_norm is not None else None)
    lr = optimizer.param_groups[0]["lr"]
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    out = {"loss": sum(loss for loss, _, _ in per_micro), "lr": lr,
           "num_tokens": sum(b.num_tokens for b in batches),
           "num_label_tokens": sum(b.num_label_tokens for b in batches), **_merge_metrics(per_micro)}
    if grad_norm is not None:
        out["grad_norm"] = float(grad_norm)
    return out


def _announce(cfg: TrainConfig, model, device: torch.device, stats, log: RunLogger, world_size: int = 1) -> None:
    num_params = sum(p.numel() for p in model.parameters())
    effective = cfg.per_device_train_batch_size * world_size * cfg.gradient_accumulation_steps
    log.write(f"twinseq torch: {num_params / 1e6:.2f}M params on {device}, attn={cfg.attn_implementation}, "
              f"loss={cfg.loss_type}, packing={cfg.packing}({cfg.packing_strategy}), padding_free={cfg.padding_free}")
    log.write(f"effective batch = {cfg.per_device_train_batch_size} per device x {world_size} devices x "
              f"{cfg.gradient_accumulation_steps} accumulation steps = {effective} "
              f"{'packed rows' if cfg.packing else 'examples'} per optimizer step")
    if stats is not None:
        log.write(f"data: {stats}")


def train(cfg: TrainConfig) -> Path:
    """Run ``cfg.max_steps`` optimizer steps; returns the path of ``metrics.jsonl``."""
    from twinseq.common.loader import build_step_iterator
    from twinseq.torch_backend.parallel import train_distributed, wants_distributed

    if cfg.task == "dpo":
        from twinseq.torch_backend.dpo import train_dpo

        return train_dpo(cfg)
    if wants_distributed(cfg):  # torchrun/accelerate launch, --fsdp or --context-parallel-size > 1
        return train_distributed(cfg)
    device = pick_device()
    validate_runtime(cfg, device)
    torch.manual_seed(cfg.seed)
    iterator, tokenizer, stats = build_step_iterator(cfg)
    model = build_training_model(cfg, tokenizer.vocab_size, device)
    optimizer, scheduler = build_optimizer(model, cfg)
    start = resume_if_asked(cfg, model, optimizer, scheduler, iterator)
    log = RunLogger(cfg.output_dir, cfg.max_steps, disable_tqdm=cfg.disable_tqdm, desc="train[torch]",
                    resume_step=start)
    _announce(cfg, model, device, stats, log)
    micro_step = MicroStep(model, cfg, device)
    return run_steps(cfg, lambda batches: train_step(model, optimizer, scheduler, micro_step, batches, cfg),
                     model=model, optimizer=optimizer, scheduler=scheduler, iterator=iterator,
                     tokenizer=tokenizer, log=log, start=start, device=device)


def resume_if_asked(cfg: TrainConfig, model, optimizer, scheduler, iterator) -> int:
    """Restore everything from ``cfg.resume_from_checkpoint``; the step to continue after (0: fresh)."""
    if not cfg.resume_from_checkpoint:
        return 0
    from twinseq.torch_backend.checkpoint import load_checkpoint

    state = load_checkpoint(cfg.resume_from_checkpoint, model=model, optimizer=optimizer, scheduler=scheduler)
    iterator.load_state_dict(state["data"])
    return int(state["step"])


def run_steps(cfg: TrainConfig, step_fn, *, model, optimizer, scheduler, iterator, tokenizer, log: RunLogger,
              start: int, device: torch.device, plot_keys: tuple[str, ...] = ("loss", "tokens_per_second")) -> Path:
    """The loop shared by the SFT and DPO trainers: time and log each step, checkpoint, save the final model.

    ``step_fn(micro_batches) -> metrics`` runs one optimizer step; metrics hold ``num_tokens``.
    """
    from twinseq.torch_backend.checkpoint import checkpoint_dir, save_checkpoint
    from twinseq.torch_backend.model import save_pretrained

    def checkpoint(step: int) -> None:
        save_checkpoint(checkpoint_dir(cfg.output_dir, step), model=model, optimizer=optimizer, scheduler=scheduler,
                        step=step, data_state=iterator.state_dict(), config=cfg.to_dict())

    for step in range(start + 1, cfg.max_steps + 1):
        t0 = time.perf_counter()
        out = step_fn(iterator.next_step())
        seconds = time.perf_counter() - t0
        log.log_step({"step": step, **out, "tokens_per_second": out["num_tokens"] / seconds,
                      "step_seconds": seconds, "peak_memory_bytes": _peak_memory(device)})
        if cfg.save_steps and step % cfg.save_steps == 0 and step < cfg.max_steps:
            checkpoint(step)
    checkpoint(cfg.max_steps)
    final = Path(cfg.output_dir) / "final"
    save_pretrained(model, final)
    tokenizer.save_pretrained(final)
    log.close()
    finish_run(cfg.output_dir, keys=plot_keys)
    return log.path
