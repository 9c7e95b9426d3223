"""The JAX training loop: SFT on the common data pipeline, the same step as the torch trainer.

Per step: ``gradient_accumulation_steps`` micro-batches from ``common.loader.StepIterator``,
each loss already normalised by the label count of the whole step, so the summed gradients
equal one big batch's. Then torch's ``clip_grad_norm_`` rule and AdamW with the schedule of
``common.schedule`` (weight decay on matrices only), so that torch and jax follow the same
trajectory (``parity_tests/test_adamw_parity.py``).

Shapes are bucketed: every micro-batch is padded to ``per_device_train_batch_size`` rows (one row
when padding-free) and a multiple of ``pad_to_multiple_of`` (default ``DEFAULT_BUCKET``) columns, so
the step compiles once per bucket instead of once per batch length.

Context parallelism (``context_parallel_size > 1``): a ``(data, cp)`` mesh over every visible
device (``sharding.mesh_from_config``), parameters placed with ``NamedSharding``, each data
replica reading its own rows (``sharding.DataParallelSteps``), every batch reordered and sharded
by ``sharding.shard_batch`` (targets shifted before the zigzag reorder) and attention run by
``sharding.ring_attention_fn`` (``context_parallel_strategy``: ``ring`` or ``allgather``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from functools import partial
from pathlib import Path
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from twinseq.common.batching import IGNORE_INDEX, Batch
from twinseq.common.config import TrainConfig, resolve_model_config
from twinseq.common.init import init_weights
from twinseq.common.metrics import RunLogger, finish_run, peak_rss_bytes
from twinseq.common.schedule import lr_multiplier
from twinseq.jax_backend import batch_inputs, grads_jit
from twinseq.jax_backend.checkpoint_io import load_checkpoint, save_checkpoint
from twinseq.jax_backend.losses import check_labels
from twinseq.jax_backend.model import LlamaForCausalLM, export_weights
from twinseq.jax_backend.sharding import (CP_AXIS, DataParallelSteps, attention_of_config, mesh_from_config,
                                          mesh_shape_of_config, sequence_multiple, shard_batch, shard_params)

logger = logging.getLogger(__name__)

DEFAULT_BUCKET = 64
TRAINER_STATE = "trainer_state.json"
OPTIMIZER_STATE = "optimizer_state.npz"
TORCH_CLIP_EPS = 1e-6  # torch.nn.utils.clip_grad_norm_: max_norm / (total_norm + 1e-6)


def clip_by_global_norm_like_torch(max_norm: float) -> optax.GradientTransformation:
    """Scale every gradient by ``min(1, max_norm / (global_norm + 1e-6))``, torch's exact rule.

    optax's ``clip_by_global_norm`` has no ``1e-6`` and skips the multiply below the threshold;
    the difference is a relative 1e-6 / norm, enough to break a 1e-5 trajectory parity.
    """
    def update(updates, state, params=None):
        del params
        coef = jnp.minimum(max_norm / (optax.global_norm(updates) + TORCH_CLIP_EPS), 1.0)
        return jax.tree.map(lambda g: g * coef.astype(g.dtype), updates), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def lr_schedule(cfg: TrainConfig):
    """optax schedule: ``learning_rate * lr_multiplier(count)`` from a table (torch's LambdaLR values)."""
    table = np.array([cfg.learning_rate * lr_multiplier(k, warmup_steps=cfg.effective_warmup_steps,
                                                        max_steps=cfg.max_steps, scheduler=cfg.lr_scheduler_type)
                      for k in range(cfg.max_steps)], dtype=np.float32)
    table_jnp = jnp.asarray(table)
    return lambda count: table_jnp[jnp.minimum(count, cfg.max_steps - 1)]


def build_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    """Clip (torch rule) + AdamW, as ``torch_backend.train.build_optimizer``.

    optax.adamw = ``-lr * (m_hat / (sqrt(v_hat) + eps) + wd * p)`` with bias correction and
    ``eps_root = 0``: torch's AdamW (``p *= 1 - lr * wd``; ``p -= lr * m_hat / (sqrt(v_hat) + eps)``).
    Weight decay only on matrices (``ndim >= 2``), as HF Trainer and the torch trainer.
    """
    adamw = optax.adamw(lr_schedule(cfg), b1=cfg.adam_beta1, b2=cfg.adam_beta2, eps=cfg.adam_epsilon,
                        eps_root=0.0, weight_decay=cfg.weight_decay,
                        mask=lambda params: jax.tree.map(lambda p: p.ndim >= 2, params))
    if cfg.max_grad_norm is None:
        return adamw
    return optax.chain(clip_by_global_norm_like_torch(cfg.max_grad_norm), adamw)


@partial(jax.jit, static_argnums=(0,), donate_argnums=(1, 2))
def apply_updates(optimizer: optax.GradientTransformation, params, opt_state, grads):
    """(new params, new optimizer state, pre-clip global gradient norm)."""
    grad_norm = optax.global_norm(grads)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, grad_norm


@jax.jit
def _add(tree_a, tree_b):
    return jax.tree.map(jnp.add, tree_a, tree_b)


def pad_batch(batch: Batch, rows: int, multiple: int) -> Batch:
    """Pad to ``rows`` rows and a multiple of ``multiple`` columns with padding tokens.

    Padding is segment 0, position 0, label -100, so losses and counts are unchanged.
    ``pad_token_id`` is irrelevant (padding is never attended to nor scored); 0 is used.
    """
    b, t = batch.shape
    width = -(-t // multiple) * multiple
    assert rows >= b, (rows, b)
    if (b, t) == (rows, width):
        return batch

    def pad(a: np.ndarray, value: int) -> np.ndarray:
        return np.pad(a, ((0, rows - b), (0, width - t)), constant_values=value)

    return dataclasses.replace(batch, input_ids=pad(batch.input_ids, 0), labels=pad(batch.labels, IGNORE_INDEX),
                               position_ids=pad(batch.position_ids, 0), segment_ids=pad(batch.segment_ids, 0))


def validate_runtime(cfg: TrainConfig) -> None:
    """Refuse what the JAX trainer cannot do, before any work (mirrors the torch trainer)."""
    platform = jax.devices()[0].platform
    if cfg.task != "sft":
        raise ValueError(f"task={cfg.task!r} is not implemented by the jax trainer yet; use --task sft.")
    if cfg.loss_type == "liger":
        raise ValueError("loss_type='liger' (or use_liger_kernel=True) is a CUDA kernel of the torch backend; "
                         "with --backend jax use --loss-type fused_linear, which never materialises the logits.")
    if cfg.activation_offloading and platform == "cpu":
        raise ValueError("activation_offloading=True moves activations from accelerator to host memory and has "
                         "no meaning on a CPU-only run; drop --activation-offloading or run on a GPU/TPU. "
                         "--gradient-checkpointing saves activation memory on CPU.")
    if cfg.torch_compile:
        raise ValueError("torch_compile=True is a torch option; the jax backend always compiles with jax.jit.")
    mesh_shape_of_config(cfg, jax.device_count())  # context_parallel_size vs the devices, pad_to_multiple_of
    if cfg.attn_implementation not in ("sdpa", "eager"):
        logger.info("attn_implementation=%r: the jax backend has one attention path (masked dense softmax "
                    "in float32); using it", cfg.attn_implementation)


def remat_policy_of(cfg: TrainConfig) -> str:
    if cfg.activation_offloading:
        return "offload_dots"
    return "full" if cfg.gradient_checkpointing else "none"


def build_training_model(cfg: TrainConfig, vocab_size: int):
    """Float32 master weights (``dtype`` only changes the compute dtype, like torch autocast)."""
    policy = remat_policy_of(cfg)
    if Path(cfg.model_config).is_dir():
        model_cfg, weights = load_checkpoint(cfg.model_config)
    else:
        model_cfg = resolve_model_config(cfg.model_config)
        weights = init_weights(model_cfg, seed=cfg.seed)
    if model_cfg.vocab_size < vocab_size:
        raise ValueError(f"model_config={cfg.model_config!r} has vocab_size={model_cfg.vocab_size} but the "
                         f"tokenizer has {vocab_size} tokens; use a tokenizer of at most that size.")
    return LlamaForCausalLM(model_cfg, weights, dtype="float32", remat_policy=policy)


class Trainer:
    """Holds (graphdef, params, opt_state); ``step(batches)`` runs one optimizer step.

    With a ``mesh`` (``sharding.mesh_from_config``) every batch is a global micro-batch (all data
    replicas' rows, ``sharding.DataParallelSteps``); it is sharded over ``data`` x ``cp`` and the
    model attends with ``sharding.ring_attention_fn``. Without one, everything runs on one device.
    """

    def __init__(self, model, cfg: TrainConfig, mesh: Optional[Mesh] = None) -> None:
        self.cfg, self.mesh = cfg, mesh
        self.graphdef, params = nnx.split(model)
        self.params = self._place(jax.tree.map(jnp.copy, params))  # apply_updates donates: copy the caller's
        self.vocab_size = model.config.vocab_size
        self.optimizer = build_optimizer(cfg)
        self.opt_state = self.optimizer.init(self.params)
        self.steps_done = 0
        cp = 1 if mesh is None else mesh.shape[CP_AXIS]
        self.bucket = sequence_multiple(cfg.pad_to_multiple_of or DEFAULT_BUCKET, cp)
        self.attend = None if mesh is None else attention_of_config(cfg, mesh)
        replicas = 1 if mesh is None else mesh.size // cp
        self.rows = replicas * (1 if cfg.padding_free else cfg.per_device_train_batch_size)
        self._lr = lr_schedule(cfg)
        if cfg.pad_to_multiple_of is None:
            logger.info("pad_to_multiple_of is unset: padding every micro-batch to a multiple of %d tokens so "
                        "that the step compiles once per length bucket", self.bucket)

    def _place(self, params):
        return params if self.mesh is None else shard_params(self.mesh, params)

    def _place_like(self, restored, initial):
        """On a mesh, each restored leaf takes its freshly initialised twin's ``NamedSharding``, and
        scalars (optax's step count, created uncommitted on one device) are replicated."""
        if self.mesh is None:
            return restored
        replicated = NamedSharding(self.mesh, P())

        def place(new, init):
            return jax.device_put(new, init.sharding if isinstance(init.sharding, NamedSharding) else replicated)

        return jax.tree.map(place, restored, initial)

    def _grads(self, batch: Batch):
        check_labels(batch.labels, self.vocab_size, batch.num_items_in_batch)
        batch = pad_batch(batch, max(self.rows, batch.shape[0]), self.bucket)
        kwargs = dict(loss_type=self.cfg.loss_type, chunk_size=self.cfg.loss_chunk_size,
                      compute_dtype=None if self.cfg.dtype == "float32" else self.cfg.dtype)
        inputs = batch_inputs(batch, self.vocab_size)  # also range-checks the token ids
        num_items = jnp.asarray(batch.num_items_in_batch, jnp.int32)
        if self.mesh is None:
            return grads_jit(self.graphdef, self.params, inputs, num_items, **kwargs)
        arrays = shard_batch(batch, self.mesh)  # reordered for CP, targets shifted before the reorder
        inputs = tuple(arrays[k] for k in ("input_ids", "position_ids", "segment_ids", "targets"))
        return grads_jit(self.graphdef, self.params, inputs, num_items, attend=self.attend, shifted=True, **kwargs)

    def step(self, batches: list[Batch]) -> dict[str, Any]:
        total_loss, correct, entropy_sum, count, grads = 0.0, 0, 0.0, 0, None
        for batch in batches:
            (loss, metrics), micro_grads = self._grads(batch)
            grads = micro_grads if grads is None else _add(grads, micro_grads)
            total_loss += float(loss)
            correct += int(metrics["num_correct_tokens"])
            entropy_sum += float(metrics["entropy_sum"])
            count += int(metrics["num_tokens"])
        lr = float(self._lr(self.steps_done))
        self.params, self.opt_state, grad_norm = apply_updates(self.optimizer, self.params, self.opt_state, grads)
        self.steps_done += 1
        return {"loss": total_loss, "lr": lr, "num_tokens": sum(b.num_tokens for b in batches),
                "num_label_tokens": count, "mean_token_accuracy": correct / count if count else 0.0,
                "entropy": entropy_sum / count if count else 0.0, "grad_norm": float(grad_norm)}

    def model(self):
        return nnx.merge(self.graphdef, self.params)

    def save(self, path: Path, data_state: dict) -> Path:
        """``path/``: HF checkpoint (float32) + optimizer state (npz) + trainer state (json)."""
        model = self.model()
        save_checkpoint(model.config, export_weights(model), path)
        leaves = jax.tree.leaves(self.opt_state)
        np.savez(path / OPTIMIZER_STATE, **{f"leaf_{i}": np.asarray(x) for i, x in enumerate(leaves)})
        state = {"step": self.steps_done, "data": data_state, "config": self.cfg.to_dict()}
        (path / TRAINER_STATE).write_text(json.dumps(state, indent=2))
        return path

    def load(self, path: str | Path) -> dict:
        """Restore params, optimizer state and step from ``save``'s directory; returns the trainer state."""
        path = Path(path)
        if not (path / TRAINER_STATE).is_file():
            raise ValueError(f"resume_from_checkpoint={str(path)!r} holds no {TRAINER_STATE}; pass a "
                             f"'checkpoint-N' directory written by `twinseq train --backend jax --save-steps N`.")
        model_cfg, weights = load_checkpoint(path)
        policy = self.model().model.remat_policy
        self.graphdef, params = nnx.split(LlamaForCausalLM(model_cfg, weights, remat_policy=policy))
        self.params = self._place(params)
        with np.load(path / OPTIMIZER_STATE) as saved:
            leaves = [jnp.asarray(saved[f"leaf_{i}"]) for i in range(len(saved.files))]
        treedef = jax.tree.structure(self.opt_state)
        if treedef.num_leaves != len(leaves):
            raise ValueError(f"{path / OPTIMIZER_STATE} holds {len(leaves)} arrays but this optimizer has "
                             f"{treedef.num_leaves}; resume with the same optimizer settings (max_grad_norm).")
        self.opt_state = self._place_like(jax.tree.unflatten(treedef, leaves), self.opt_state)
        state = json.loads((path / TRAINER_STATE).read_text())
        self.steps_done = int(state["step"])
        return state


def checkpoint_dir(output_dir: str | Path, step: int) -> Path:
    return Path(output_dir) / f"checkpoint-{step}"


def peak_memory_bytes() -> int:
    """Accelerator peak bytes in use where JAX reports it, else the process's peak RSS (CPU)."""
    stats = jax.devices()[0].memory_stats() or {}
    return int(stats["peak_bytes_in_use"]) if "peak_bytes_in_use" in stats else peak_rss_bytes()


def _announce(cfg: TrainConfig, trainer: Trainer, stats, log: RunLogger) -> None:
    num_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(trainer.params))
    where = str(jax.devices()[0]) if trainer.mesh is None else \
        f"a mesh {dict(trainer.mesh.shape)} (cp attention: {cfg.context_parallel_strategy})"
    log.write(f"twinseq jax: {num_params / 1e6:.2f}M params on {where}, loss={cfg.loss_type}, "
              f"remat={remat_policy_of(cfg)}, packing={cfg.packing}({cfg.packing_strategy}), "
              f"padding_free={cfg.padding_free}, dtype={cfg.dtype}")
    if stats is not None:
        log.write(f"data: {stats}")


def build_step_source(cfg: TrainConfig, mesh: Optional[Mesh]):
    """(step iterator, tokenizer, stats): ``common.loader``'s, or on a mesh one per data replica."""
    from twinseq.common.data import prepare_sft_dataset
    from twinseq.common.loader import build_step_iterator

    if mesh is None:
        return build_step_iterator(cfg)
    rows, tokenizer, stats = prepare_sft_dataset(cfg)
    cp = mesh.shape[CP_AXIS]
    multiple = sequence_multiple(cfg.pad_to_multiple_of or DEFAULT_BUCKET, cp)
    return DataParallelSteps(rows, cfg, tokenizer.pad_token_id, mesh.size // cp, multiple), tokenizer, stats


def train(cfg: TrainConfig) -> Path:
    """Run ``cfg.max_steps`` optimizer steps; returns the path of ``metrics.jsonl``."""
    if cfg.task == "dpo":
        from twinseq.jax_backend.dpo import train_dpo

        return train_dpo(cfg)

    validate_runtime(cfg)
    mesh = mesh_from_config(cfg)  # None unless context_parallel_size > 1
    iterator, tokenizer, stats = build_step_source(cfg, mesh)
    trainer = Trainer(build_training_model(cfg, tokenizer.vocab_size), cfg, mesh)
    if cfg.resume_from_checkpoint:
        iterator.load_state_dict(trainer.load(cfg.resume_from_checkpoint)["data"])
    start = trainer.steps_done
    log = RunLogger(cfg.output_dir, cfg.max_steps, disable_tqdm=cfg.disable_tqdm, desc="train[jax]",
                    resume_step=start)
    _announce(cfg, trainer, stats, log)
    return run_steps(cfg, trainer, iterator, tokenizer, log, start)


def run_steps(cfg: TrainConfig, trainer, iterator, tokenizer, log: RunLogger, start: int,
              plot_keys: tuple[str, ...] = ("loss", "tokens_per_second")) -> Path:
    """The loop shared by the SFT and DPO trainers: time and log each step, checkpoint, save the final model."""
    for step in range(start + 1, cfg.max_steps + 1):
        t0 = time.perf_counter()
        out = trainer.step(iterator.next_step())
        seconds = time.perf_counter() - t0
        log.log_step({"step": step, **out, "tokens_per_second": out["num_tokens"] / seconds,
                      "step_seconds": seconds, "peak_memory_bytes": peak_memory_bytes()})
        if cfg.save_steps and step % cfg.save_steps == 0 and step < cfg.max_steps:
            trainer.save(checkpoint_dir(cfg.output_dir, step), iterator.state_dict())
    trainer.save(checkpoint_dir(cfg.output_dir, cfg.max_steps), iterator.state_dict())
    final = Path(cfg.output_dir) / "final"
    model = trainer.model()
    save_checkpoint(model.config, export_weights(model), final)
    tokenizer.save_pretrained(final)
    log.close()
    finish_run(cfg.output_dir, keys=plot_keys)
    return log.path
