"""The JAX trainers: one optimizer step of SFT or DPO, on one device or on a (data, cp) mesh.

``train(cfg)`` builds the data and the model, ``parallel.parallelize``s it, and hands a trainer
to ``common.runner.run``, which owns the loop (timing, logging, checkpoints, resume, the final
save): the same runner, and the same trainer contract (``common.runner.StepTrainer``), as the
torch backend. Per step: ``gradient_accumulation_steps`` micro-batches, each loss already
normalised by the whole step's label count (SFT) or pair count (DPO); torch's
``clip_grad_norm_`` rule and AdamW with the schedule of ``common.schedule`` (weight decay on
matrices only), so that torch and jax follow the same trajectory
(``parity_tests/test_adamw_parity.py``).

Shapes are bucketed: every micro-batch is padded to ``per_device_train_batch_size`` rows (one row
when padding-free) and a multiple of ``pad_to_multiple_of`` (default ``DEFAULT_BUCKET``) columns, so
the step compiles once per bucket instead of once per batch length.

Context parallelism (``context_parallel_size > 1``): a ``(data, cp)`` mesh over every visible
device (``parallel.mesh_from_config``), parameters placed with ``NamedSharding``, each data
replica reading its own rows (``parallel.DataParallelSteps``), every batch reordered and sharded
by ``parallel.shard_batch`` (targets shifted before the zigzag reorder) and attention run by
``parallel.ring_attention_fn`` (``context_parallel_strategy``: ``ring`` or ``allgather``).
"""

from __future__ import annotations

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

from twinseq.common.batching import Batch, pad_batch
from twinseq.common.capabilities import Runtime
from twinseq.common.config import TrainConfig
from twinseq.common.errors import CheckpointError, ConfigError
from twinseq.common.hf_checkpoint import check_tokenizer_fits, read_hf_checkpoint, resolve_model_source
from twinseq.common.init import check_weights, init_weights
from twinseq.common.metrics import peak_rss_bytes
from twinseq.common.runner import preflight, run
from twinseq.common.schedule import lr_multiplier
from twinseq.common.step_metrics import apply_or_skip, dpo_step_metrics, first_nonfinite, sft_step_sums, with_means
from twinseq.jax_backend.checkpoint import from_numpy_tree, save_pretrained, to_numpy_tree
from twinseq.jax_backend.losses import check_labels
from twinseq.jax_backend.model import (CausalLM, batch_inputs, build_model, export_weights, grads_jit, has_adapters,
                                       merge_state, split_trainable)
from twinseq.jax_backend.parallel import (CP_AXIS, DataParallelSteps, attention_of_config, mesh_from_config,
                                          parallelize, sequence_multiple, shard_batch, shard_params)

logger = logging.getLogger(__name__)

DEFAULT_BUCKET = 64
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
    opt = cfg.optim
    table = np.array([opt.learning_rate * lr_multiplier(k, warmup_steps=cfg.effective_warmup_steps,
                                                        max_steps=cfg.max_steps, scheduler=opt.lr_scheduler_type)
                      for k in range(cfg.max_steps)], dtype=np.float32)
    table_jnp = jnp.asarray(table)
    return lambda count: table_jnp[jnp.minimum(count, cfg.max_steps - 1)]


def build_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    """Clip (torch rule) + AdamW, as ``torch_backend.trainer.build_optimizer``.

    optax.adamw = ``-lr * (m_hat / (sqrt(v_hat) + eps) + wd * p)`` with bias correction and
    ``eps_root = 0``: torch's AdamW (``p *= 1 - lr * wd``; ``p -= lr * m_hat / (sqrt(v_hat) + eps)``).
    Weight decay only on matrices (``ndim >= 2``), as HF Trainer and the torch trainer.
    """
    opt = cfg.optim
    check_optimizer(cfg)
    adamw = optax.adamw(lr_schedule(cfg), b1=opt.adam_beta1, b2=opt.adam_beta2, eps=opt.adam_epsilon,
                        eps_root=0.0, weight_decay=opt.weight_decay,
                        mask=lambda params: jax.tree.map(lambda p: p.ndim >= 2, params))
    if opt.max_grad_norm is None:
        return adamw
    return optax.chain(clip_by_global_norm_like_torch(opt.max_grad_norm), adamw)


def check_optimizer(cfg: TrainConfig) -> None:
    """The jax backend has one optimizer, AdamW with float32 moments (``adamw_torch``)."""
    if cfg.optim.optimizer != "adamw_torch":
        raise ConfigError(f"optimizer={cfg.optim.optimizer!r} is a torch option (bitsandbytes' 8-bit AdamW states "
                          f"need CUDA kernels that JAX does not have); the jax backend trains with AdamW in float32 "
                          f"('adamw_torch'): use --optimizer adamw_torch or --backend torch.")


@partial(jax.jit, static_argnums=(0,), donate_argnums=(1, 2))
def apply_updates(optimizer: optax.GradientTransformation, params, opt_state, grads):
    """(new params, new optimizer state, pre-clip global gradient norm)."""
    grad_norm = optax.global_norm(grads)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, grad_norm


@jax.jit
def _add(tree_a, tree_b):
    return jax.tree.map(jnp.add, tree_a, tree_b)


_global_norm = jax.jit(optax.global_norm)


def build_causal_lm(cfg: TrainConfig, vocab_size: int) -> CausalLM:
    """The model of ``cfg.model.model_config`` (a local folder, or a preset with ``common``'s initial
    weights) with float32 master weights (``dtype`` only changes the compute dtype, like torch autocast),
    attending with ``cfg.model.attn_implementation`` (``eager``: dense; else blocked, in tiles of
    ``memory.attention_block_size``) and with ``memory.tiled_mlp`` MLPs tiled by ``tiled_mlp_chunk_size``."""
    spec = cfg.model.model_config
    source = resolve_model_source(spec, cfg.model.init_weights)
    check_tokenizer_fits(source.config, vocab_size, spec)
    weights = (read_hf_checkpoint(source.weights_folder)[1] if source.weights_folder is not None
               else init_weights(source.config, seed=cfg.seed))
    mem = cfg.memory
    model = CausalLM(source.config, weights, dtype="float32", attn_implementation=cfg.model.attn_implementation,
                     attention_block_size=mem.attention_block_size,
                     tiled_mlp_chunk_size=mem.tiled_mlp_chunk_size if mem.tiled_mlp else None)
    return with_adapters(model, cfg)


def with_adapters(model: CausalLM, cfg: TrainConfig) -> CausalLM:
    """``model`` with the adapters of ``cfg.peft`` (``init_adapters`` with ``cfg.seed``), or ``model`` as is."""
    if not cfg.peft.use_peft:
        return model
    from twinseq.common.peft import init_adapters
    from twinseq.jax_backend.peft import add_adapters

    if cfg.peft.lora_dropout > 0:
        logger.warning("lora_dropout=%s is not applied by the jax trainer (its adapters train without dropout, "
                       "as PEFT with lora_dropout=0); set --lora-dropout 0 to silence this.", cfg.peft.lora_dropout)
    adapters = init_adapters(model.config, cfg.peft, seed=cfg.seed, base_weights=export_weights(model))
    return add_adapters(model, model.config, cfg.peft, adapters)


def _compute_dtype(cfg: TrainConfig) -> Optional[str]:
    return None if cfg.model.dtype == "float32" else cfg.model.dtype


class Trainer:
    """What SFT and DPO share: (graphdef, params, opt_state), the optimizer step, the state, the export.
    A task implements ``micro_step`` (loss, metrics and gradients of one micro-batch) and ``summarize``.

    With a ``mesh`` (``parallel.mesh_from_config``) every batch is a global micro-batch (all data
    replicas' rows, ``parallel.DataParallelSteps``); it is sharded over ``data`` x ``cp`` and the
    model attends with ``parallel.ring_attention_fn``. Without one, everything runs on one device.
    """

    is_main = True  # one process drives every device

    def __init__(self, model: CausalLM, cfg: TrainConfig, mesh: Optional[Mesh] = None) -> None:
        self.cfg, self.mesh = cfg, mesh
        # A model with adapters trains them only: ``params`` are the adapters, ``frozen`` the rest (else None).
        self.graphdef, params, self.frozen = split_trainable(model)
        self.peft = has_adapters(model)
        self.params = jax.tree.map(jnp.copy, params)  # apply_updates donates: copy the caller's
        self.vocab_size = model.config.vocab_size
        self.optimizer = build_optimizer(cfg)
        self.opt_state = self.optimizer.init(self.params)
        self.steps_done = 0
        cp = 1 if mesh is None else mesh.shape[CP_AXIS]
        d = cfg.data
        self.bucket = sequence_multiple(d.pad_to_multiple_of or DEFAULT_BUCKET, cp)
        self.attend = None if mesh is None else attention_of_config(cfg, mesh)
        replicas = 1 if mesh is None else mesh.size // cp
        self.rows = replicas * (1 if d.padding_free else d.per_device_train_batch_size)
        self._lr = lr_schedule(cfg)
        if d.pad_to_multiple_of is None:
            logger.info("pad_to_multiple_of is unset: padding every micro-batch to a multiple of %d tokens so "
                        "that the step compiles once per length bucket", self.bucket)

    def micro_step(self, micro: Any) -> tuple[Any, Any]:
        raise NotImplementedError

    def summarize(self, records: list[Any], micro_batches: list[Any]) -> dict[str, Any]:
        raise NotImplementedError

    def micro_losses(self, records: list[Any]) -> list[float]:
        raise NotImplementedError

    def step(self, micro_batches: list[Any]) -> dict[str, Any]:
        records, grads = [], None
        for micro in micro_batches:
            record, micro_grads = self.micro_step(micro)
            grads = micro_grads if grads is None else _add(grads, micro_grads)
            records.append(record)
        lr = float(self._lr(self.steps_done))
        grad_norm = float(_global_norm(grads))
        apply = apply_or_skip(first_nonfinite(self.micro_losses(records), grad_norm),
                              skip=self.cfg.optim.skip_nonfinite_steps)
        if apply:
            self.params, self.opt_state, applied_norm = apply_updates(self.optimizer, self.params, self.opt_state,
                                                                      grads)
            grad_norm = float(applied_norm)
            self.steps_done += 1
        return {**self.summarize(records, micro_batches), "lr": lr, "grad_norm": grad_norm,
                "num_skipped_steps": int(not apply)}

    def any_rank(self, flag: bool) -> bool:
        return flag  # one process drives every device

    def model(self) -> CausalLM:
        return merge_state(self.graphdef, self.params, self.frozen)

    def state_dict(self) -> dict[str, Any]:
        """The trained parameters (a PEFT run: its adapters by PEFT key, the frozen base is rebuilt from the
        config), the optimizer state and the step count."""
        if self.peft:
            from twinseq.jax_backend.peft import export_adapters

            return {"adapters": export_adapters(self.model()), "optimizer": to_numpy_tree(self.opt_state),
                    "steps_done": self.steps_done}
        return {"model": export_weights(self.model()), "optimizer": to_numpy_tree(self.opt_state),
                "steps_done": self.steps_done}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        model = self.model()
        if self.peft or "adapters" in state:
            return self._load_adapter_state(model, state)
        try:
            check_weights(model.config, state["model"])
            opt_state = from_numpy_tree(state["optimizer"], self.opt_state)
        except ValueError as err:
            raise CheckpointError(f"the checkpoint does not fit this run: {err}") from None
        restored = CausalLM(model.config, state["model"], **model.options())
        self.graphdef, params = nnx.split(restored)
        self.params = params if self.mesh is None else shard_params(self.mesh, params)
        self.opt_state = self._place_like(opt_state, self.opt_state)
        self.steps_done = int(state["steps_done"])

    def _load_adapter_state(self, model: CausalLM, state: dict[str, Any]) -> None:
        from twinseq.jax_backend.peft import load_adapter_values

        if not (self.peft and "adapters" in state):
            raise CheckpointError(f"the checkpoint holds {'adapters' if 'adapters' in state else 'full weights'} but "
                                  f"this run trains {'adapters' if self.peft else 'every weight'} (use_peft="
                                  f"{self.cfg.peft.use_peft}); resume with the run's own --use-peft setting.")
        try:
            load_adapter_values(model, state["adapters"])
            opt_state = from_numpy_tree(state["optimizer"], self.opt_state)
        except ValueError as err:
            raise CheckpointError(f"the checkpoint does not fit this run: {err}") from None
        graphdef, params, frozen = split_trainable(model)
        self.params = params if self.mesh is None else shard_params(self.mesh, params)
        self.opt_state = self._place_like(opt_state, self.opt_state)
        self.steps_done = int(state["steps_done"])

    def _place_like(self, restored, initial):
        """On a mesh, each restored leaf takes its freshly initialised twin's ``NamedSharding``, and
        scalars (optax's step count, created uncommitted on one device) are replicated."""
        if self.mesh is None:
            return restored
        replicated = NamedSharding(self.mesh, P())

        def place(new, init):
            return jax.device_put(new, init.sharding if isinstance(init.sharding, NamedSharding) else replicated)

        return jax.tree.map(place, restored, initial)

    def save_final(self, path: Path) -> None:
        """An HF model folder, or with PEFT the adapter folder ``peft.PeftModel.from_pretrained`` loads."""
        if not self.peft:
            save_pretrained(self.model(), path)
            return
        from twinseq.common.peft import save_adapters
        from twinseq.jax_backend.peft import export_adapters

        model = self.model()
        # As on torch: base_model_name_or_path is the model folder the run started from, or, for a preset
        # (weights drawn by init_weights), the base written beside the adapters.
        source = resolve_model_source(self.cfg.model.model_config, self.cfg.model.init_weights)
        if source.weights_folder is not None:
            base = Path(source.weights_folder).resolve()
        else:
            base = (Path(path) / "base").resolve()
            save_pretrained(build_model(model.config, init_weights(model.config, seed=self.cfg.seed)), base)
        save_adapters(path, model.config, self.cfg.peft, export_adapters(model), base_model_name_or_path=str(base))

    def peak_memory_bytes(self) -> int:
        """Accelerator peak bytes in use where JAX reports it, else the process's peak RSS (CPU)."""
        stats = jax.devices()[0].memory_stats() or {}
        return int(stats["peak_bytes_in_use"]) if "peak_bytes_in_use" in stats else peak_rss_bytes()


class SFTTrainer(Trainer):
    """Next-token loss of each micro-batch, on one device or sharded over the mesh."""

    def micro_step(self, batch: Batch):
        check_labels(batch.labels, self.vocab_size, batch.num_items_in_batch)
        batch = pad_batch(batch, max(self.rows, batch.shape[0]), self.bucket)
        kwargs = dict(loss_type=self.cfg.loss.loss_type, chunk_size=self.cfg.loss.loss_chunk_size,
                      compute_dtype=_compute_dtype(self.cfg))
        inputs = batch_inputs(batch, self.vocab_size)  # also range-checks the token ids
        num_items = jnp.asarray(batch.num_items_in_batch, jnp.int32)
        if self.mesh is None:
            (loss, metrics), grads = grads_jit(self.graphdef, self.params, inputs, num_items, frozen=self.frozen,
                                               **kwargs)
        else:
            arrays = shard_batch(batch, self.mesh)  # reordered for CP, targets shifted before the reorder
            inputs = tuple(arrays[k] for k in ("input_ids", "position_ids", "segment_ids", "targets"))
            (loss, metrics), grads = grads_jit(self.graphdef, self.params, inputs, num_items, attend=self.attend,
                                               targets_are_shifted=True, frozen=self.frozen, **kwargs)
        return {"loss": float(loss), **{k: metrics[k] for k in ("num_tokens", "num_correct_tokens", "entropy_sum")}}, \
            grads

    def micro_losses(self, records: list[dict[str, Any]]) -> list[float]:
        return [r["loss"] for r in records]

    def summarize(self, records: list[dict[str, Any]], micro_batches: list[Batch]) -> dict[str, Any]:
        return with_means(sft_step_sums(records, num_tokens=sum(b.num_tokens for b in micro_batches)))


class DPOTrainer(Trainer):
    """One DPO optimizer step per ``step(pbatches)``; the live reference is a frozen copy of the initial
    parameters (``ref_params``), unless the batches carry precomputed log-probs."""

    def __init__(self, model: CausalLM, cfg: TrainConfig, *, config, examples_per_step: int,
                 live_reference: bool) -> None:
        super().__init__(model, cfg)
        self.config, self.examples_per_step = config, examples_per_step
        self.ref_graphdef = None
        if self.peft:  # the reference is the same parameters with the adapters switched off: no copy
            from twinseq.jax_backend.peft import adapters_disabled

            with adapters_disabled(model):
                self.ref_graphdef = split_trainable(model)[0]
            self.ref_params = None
            self.live_reference = live_reference
        else:
            self.ref_params = jax.tree.map(jnp.copy, self.params) if live_reference else None
            self.live_reference = live_reference

    def _reference(self, pbatch, inputs):
        from twinseq.jax_backend.dpo import _ref_arrays, sequence_logps_jit

        if not self.live_reference:
            return _ref_arrays(pbatch, None, None)
        loss = self.cfg.loss
        if self.peft:
            graphdef, state, frozen = self.ref_graphdef, self.params, self.frozen
        else:
            graphdef, state, frozen = self.graphdef, self.ref_params, None
        logps_D = sequence_logps_jit(graphdef, state, inputs, loss_type=loss.loss_type, frozen=frozen,
                                     chunk_size=loss.loss_chunk_size, compute_dtype=_compute_dtype(self.cfg))
        return logps_D[:pbatch.num_examples], logps_D[pbatch.num_examples:]

    def micro_step(self, pbatch):
        from twinseq.jax_backend.dpo import dpo_grads_jit, pad_preference_batch, preference_inputs

        pbatch = pad_preference_batch(pbatch, self.bucket)
        inputs = preference_inputs(pbatch, self.vocab_size)
        ref_c, ref_r = self._reference(pbatch, inputs)
        loss = self.cfg.loss
        (value, pairs), grads = dpo_grads_jit(self.graphdef, self.params, inputs, ref_c, ref_r,
                                              jnp.asarray(self.examples_per_step, jnp.float32), config=self.config,
                                              frozen=self.frozen,
                                              loss_type=loss.loss_type, chunk_size=loss.loss_chunk_size,
                                              compute_dtype=_compute_dtype(self.cfg))
        return (float(value), pairs), grads

    def micro_losses(self, records: list[Any]) -> list[float]:
        return [value for value, _ in records]

    def summarize(self, records: list[Any], micro_batches: list[Any]) -> dict[str, Any]:
        per_pair = {k: [np.asarray(pairs[k], np.float64) for _, pairs in records]
                    for k in ("chosen_rewards", "rejected_rewards", "chosen_logps", "rejected_logps")}
        return dpo_step_metrics([value for value, _ in records], per_pair,
                                num_tokens=sum(pb.batch.num_tokens for pb in micro_batches),
                                num_label_tokens=sum(pb.batch.num_label_tokens for pb in micro_batches))


# --------------------------------------------------------------------------------------
# `twinseq train --backend jax`
# --------------------------------------------------------------------------------------


def _describe(cfg: TrainConfig, trainer: Trainer) -> str:
    d = cfg.data
    num_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(trainer.params))
    if trainer.peft:
        frozen = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(trainer.frozen))
        p = cfg.peft
        kind = ("QLoRA (NF4 base)" if p.load_in_4bit else "LoRA") + (" DoRA" if p.use_dora else "") + \
            (" rsLoRA" if p.use_rslora else "") + (f" + {len(p.trainable_token_indices)} trainable tokens"
                                                  if p.trainable_token_indices else "")
        params_line = (f"{kind} r={p.lora_r} alpha={p.lora_alpha}: trainable params: {num_params:,} || all params: "
                       f"{num_params + frozen:,} || trainable%: {100 * num_params / (num_params + frozen):.4f}")
    else:
        params_line = f"{num_params / 1e6:.2f}M params"
    where = str(jax.devices()[0]) if trainer.mesh is None else \
        f"a mesh {dict(trainer.mesh.shape)} (cp attention: {cfg.parallel.context_parallel_strategy})"
    return (f"twinseq jax {cfg.task}: {trainer.model().config.model_type} {cfg.model.model_config!r}, "
            f"{params_line} on {where}, loss={cfg.loss.loss_type}, "
            f"remat={trainer.model().model.remat_policy}, packing={d.packing}({d.packing_strategy}), "
            f"padding_free={d.padding_free}, dtype={cfg.model.dtype}")


def build_step_source(cfg: TrainConfig, mesh: Optional[Mesh]):
    """(step source, tokenizer, stats): ``common.loader``'s iterator, or on a mesh one per data replica."""
    from twinseq.common.data import prepare_sft_dataset
    from twinseq.common.loader import build_step_iterator

    if mesh is None:
        return build_step_iterator(cfg)
    rows, tokenizer, stats = prepare_sft_dataset(cfg)
    cp = mesh.shape[CP_AXIS]
    multiple = sequence_multiple(cfg.data.pad_to_multiple_of or DEFAULT_BUCKET, cp)
    return DataParallelSteps(rows, cfg, tokenizer.pad_token_id, mesh.size // cp, multiple), tokenizer, stats


def _build_sft(cfg: TrainConfig):
    mesh = mesh_from_config(cfg)  # None unless context_parallel_size > 1
    source, tokenizer, stats = build_step_source(cfg, mesh)
    trainer = SFTTrainer(parallelize(build_causal_lm(cfg, tokenizer.vocab_size), mesh, cfg), cfg, mesh)
    return trainer, source, tokenizer, [_describe(cfg, trainer), f"data: {stats}"]


def _build_dpo(cfg: TrainConfig):
    from twinseq.common.data import prepare_dpo_dataset
    from twinseq.common.dpo import validate_dpo_config
    from twinseq.common.dpo_loader import build_preference_iterator
    from twinseq.jax_backend.dpo import precompute_ref_logps

    config = validate_dpo_config(cfg.dpo.dpo_loss_type, cfg.dpo.loss_weights, cfg.dpo.beta, cfg.dpo.label_smoothing)
    rows, tokenizer, stats = prepare_dpo_dataset(cfg)
    model = parallelize(build_causal_lm(cfg, tokenizer.vocab_size), None, cfg)
    if cfg.dpo.precompute_ref_log_probs:  # the initial model, before any checkpoint is loaded
        t0 = time.perf_counter()
        reference = model
        if has_adapters(model):  # PEFT: the base, adapters switched off (a shallow copy shares the weights)
            from twinseq.jax_backend.peft import set_adapters_enabled

            reference = nnx.merge(*nnx.split(model))
            set_adapters_enabled(reference, False)
        rows = precompute_ref_logps(reference, rows, cfg, tokenizer.pad_token_id,
                                    cfg.data.pad_to_multiple_of or DEFAULT_BUCKET)
        logger.info("precomputed reference log-probs of %d pairs in %.1fs", len(rows), time.perf_counter() - t0)
    source = build_preference_iterator(cfg, rows, tokenizer.pad_token_id)
    trainer = DPOTrainer(model, cfg, config=config, examples_per_step=source.examples_per_step,
                         live_reference=not cfg.dpo.precompute_ref_log_probs)
    announce = [_describe(cfg, trainer),
                f"dpo_loss_type={list(config.loss_type)}, beta={config.beta}, reference="
                f"{'precomputed' if cfg.dpo.precompute_ref_log_probs else 'live copy'}"
                f"{' (the base: adapters off)' if trainer.peft else ''}, "
                f"{source.examples_per_step} pairs per step; data: {stats}"]
    return trainer, source, tokenizer, announce


def train(config: TrainConfig) -> Path:
    """Run ``config.max_steps`` optimizer steps of ``config.task``; returns the path of ``metrics.jsonl``."""
    cfg = config
    check_optimizer(cfg)
    platform = jax.devices()[0].platform
    preflight(cfg, Runtime("jax", platform, jax.device_count(), accelerator=platform != "cpu"))
    build = _build_dpo if cfg.task == "dpo" else _build_sft
    if cfg.task == "grpo":
        from twinseq.jax_backend.grpo import build_grpo as build
    trainer, source, tokenizer, announce = build(cfg)
    plot_keys = ("loss", "rewards/accuracies", "tokens_per_second") if cfg.task == "dpo" else \
        ("loss", "tokens_per_second")
    if cfg.task == "grpo":
        plot_keys = ("loss", "reward", "completions/mean_length", "tokens_per_second")
    return run(cfg, trainer, source, tokenizer=tokenizer, desc=f"{cfg.task}[jax]", announce=announce,
               plot_keys=plot_keys)
