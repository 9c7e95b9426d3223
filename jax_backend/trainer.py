"""The JAX trainers: the JAX hooks of ``common.run.trainer.TrainerTemplate`` (``JaxTrainer``), and SFT's and DPO's
micro-steps on them, on one device or on a (data, cp) mesh.

``recipes.train(cfg)`` calls ``build_sft``/``build_dpo`` (data, the model, ``parallel.parallelize``) and hands
the trainer to ``common.run.runner.run``, which owns the loop (timing, logging, checkpoints, resume, the final
save): the same runner, the same step (``TrainerTemplate.step``) as the torch backend. Per step:
``gradient_accumulation_steps`` micro-batches, each loss already normalised by the whole step's label count
(SFT) or pair count (DPO); torch's
``clip_grad_norm_`` rule and AdamW with the schedule of ``common.run.schedule`` (weight decay on
matrices only), so that torch and jax follow the same trajectory
(``parity_tests/test_adamw_parity.py``).

Shapes are bucketed: every micro-batch is padded to ``per_device_train_batch_size`` rows (one row
when padding-free) and a multiple of ``pad_to_multiple_of`` (default ``DEFAULT_BUCKET``) columns, so
the step compiles once per bucket instead of once per batch length.

Context parallelism (``context_parallel_size > 1``): a ``(data, cp)`` mesh over every visible
device (``parallel.mesh_from_config``), parameters placed with ``NamedSharding``, each data
replica reading its own rows (``parallel.DataParallelSteps``), every batch reordered and sharded
by ``parallel.shard_batch`` (targets shifted before the zigzag reorder) and attention run by
``parallel.ring_attention_fn`` (``context_parallel_strategy``: ``ring`` or ``allgather``). DPO runs on a
``(data=1, cp)`` mesh: its micro-batches and reference passes go through ``dpo.step_inputs``.
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

from twinseq.common.config import TrainConfig
from twinseq.common.data.batching import Batch, pad_batch
from twinseq.common.data.preference_steps import build_preference_iterator
from twinseq.common.data.prepare import prepare_dpo_dataset, prepare_sft_dataset
from twinseq.common.data.sft_steps import build_step_iterator
from twinseq.common.errors import CheckpointError, ConfigError
from twinseq.common.models.hf_folder import check_tokenizer_fits, read_hf_checkpoint, resolve_model_source
from twinseq.common.models.init import check_weights, init_weights
from twinseq.common.models.peft import base_dtype, init_adapters
from twinseq.common.objectives.dpo import validate_dpo_config
from twinseq.common.objectives.moe import COUNTS_KEY, moe_layers
from twinseq.common.run.inputs import NO_INPUTS, RunInputs
from twinseq.common.run.report import peak_rss_bytes
from twinseq.common.run.schedule import lr_multiplier, with_resolved_max_steps
from twinseq.common.run.step_metrics import dpo_step_metrics, sft_step_sums, with_means
from twinseq.common.run.trainer import (
    TrainerTemplate,
    describe_run,
    peft_summary,
    reference_description,
    save_adapter_folder,
)
from twinseq.jax_backend.adamw_8bit import adamw_8bit
from twinseq.jax_backend.checkpoint import from_numpy_tree, lazy_numpy_tree, save_pretrained
from twinseq.jax_backend.dpo import (
    _ref_arrays,
    dpo_grads_jit,
    pad_for_mesh,
    precompute_ref_logps,
    sequence_logps_jit,
    step_inputs,
)
from twinseq.jax_backend.generation import generate
from twinseq.jax_backend.losses import check_labels
from twinseq.jax_backend.model import (
    CausalLM,
    batch_inputs,
    build_model,
    cast_floating,
    export_weights,
    grads_jit,
    has_adapters,
    lazy_weights,
    loss_jit,
    merge_state,
    split_trainable,
)
from twinseq.jax_backend.parallel import (
    CP_AXIS,
    DataParallelSteps,
    attention_of_config,
    mesh_from_config,
    parallelize,
    sequence_multiple,
    shard_batch,
    shard_params,
)
from twinseq.jax_backend.peft import (
    adapters_disabled,
    add_adapters,
    dropout_key,
    export_adapters,
    load_adapter_values,
    set_adapters_enabled,
)

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
    table = np.array(
        [
            cfg.effective_learning_rate
            * lr_multiplier(
                k, warmup_steps=cfg.effective_warmup_steps, max_steps=cfg.max_steps, scheduler=opt.lr_scheduler_type
            )
            for k in range(cfg.max_steps)
        ],
        dtype=np.float32,
    )
    table_jnp = jnp.asarray(table)
    return lambda count: table_jnp[jnp.minimum(count, cfg.max_steps - 1)]


def build_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    """Clip (torch rule) + AdamW, as ``torch_backend.trainer.build_optimizer``.

    optax.adamw = ``-lr * (m_hat / (sqrt(v_hat) + eps) + wd * p)`` with bias correction and
    ``eps_root = 0``: torch's AdamW (``p *= 1 - lr * wd``; ``p -= lr * m_hat / (sqrt(v_hat) + eps)``).
    Weight decay only on matrices (``ndim >= 2``), as HF Trainer and the torch trainer.
    ``optimizer='adamw_bnb_8bit'``: the same chain over 8-bit blockwise moments (``jax_backend/adamw_8bit.py``).
    """
    opt = cfg.optim
    check_optimizer(cfg)
    decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)  # noqa: E731
    if opt.optimizer == "adamw_bnb_8bit":
        adamw = adamw_8bit(
            lr_schedule(cfg), opt.adam_beta1, opt.adam_beta2, opt.adam_epsilon, opt.weight_decay, decay_mask
        )
    else:
        adamw = optax.adamw(
            lr_schedule(cfg),
            b1=opt.adam_beta1,
            b2=opt.adam_beta2,
            eps=opt.adam_epsilon,
            eps_root=0.0,
            weight_decay=opt.weight_decay,
            mask=decay_mask,
        )
    if opt.max_grad_norm is None:
        return adamw
    return optax.chain(clip_by_global_norm_like_torch(opt.max_grad_norm), adamw)


def check_optimizer(cfg: TrainConfig) -> None:
    """The jax backend's optimizers: AdamW with float32 moments (``adamw_torch``) or 8-bit blockwise moments
    (``adamw_bnb_8bit``, ``jax_backend/adamw_8bit.py``)."""
    if cfg.optim.optimizer not in ("adamw_torch", "adamw_bnb_8bit"):
        raise ConfigError(
            f"optimizer={cfg.optim.optimizer!r} is a torch option today (AdamWBF16's stochastically rounded "
            f"bfloat16 state); the jax backend trains with AdamW in float32 ('adamw_torch') or with 8-bit moments "
            f"('adamw_bnb_8bit'): use --optimizer adamw_torch or --backend torch."
        )


@partial(jax.jit, static_argnums=(0,), donate_argnums=(1, 2))
def apply_updates(optimizer: optax.GradientTransformation, params, opt_state, grads):
    """(new params, new optimizer state, pre-clip global gradient norm)."""
    grad_norm = optax.global_norm(grads)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, grad_norm


@partial(jax.jit, donate_argnums=(0,))
def _add(tree_a, tree_b):
    """``tree_a + tree_b``, written into ``tree_a``'s buffers (donated): accumulating a micro-batch's gradients holds
    the running sum and the new gradients, not a third copy."""
    return jax.tree.map(jnp.add, tree_a, tree_b)


_global_norm = jax.jit(optax.global_norm)


def build_causal_lm(cfg: TrainConfig, vocab_size: int) -> CausalLM:
    """The model of ``cfg.model.model_config`` (a local folder, or a preset with ``common``'s initial
    weights) with float32 master weights (``dtype`` only changes the compute dtype, like torch autocast; a PEFT run
    stores its frozen base in ``common.models.peft.base_dtype``, bfloat16 under ``--dtype bfloat16``),
    attending with ``cfg.model.attn_implementation`` (``eager``: dense; else blocked, in tiles of
    ``memory.attention_block_size``) and with ``memory.tiled_mlp`` MLPs tiled by ``tiled_mlp_chunk_size``."""
    spec = cfg.model.model_config
    source = resolve_model_source(spec, cfg.model.init_weights)
    check_tokenizer_fits(source.config, vocab_size, spec)
    weights = (
        read_hf_checkpoint(source.weights_folder)[1]
        if source.weights_folder is not None
        else init_weights(source.config, seed=cfg.seed)
    )
    mem = cfg.memory
    model = CausalLM(
        source.config,
        weights,
        dtype=base_dtype(cfg.peft, cfg.model.dtype),
        attn_implementation=cfg.model.attn_implementation,
        attention_block_size=mem.attention_block_size,
        tiled_mlp_chunk_size=mem.tiled_mlp_chunk_size if mem.tiled_mlp else None,
    )
    return with_adapters(model, cfg)


def with_adapters(model: CausalLM, cfg: TrainConfig) -> CausalLM:
    """``model`` with the adapters of ``cfg.peft`` (``init_adapters`` with ``cfg.seed``), or ``model`` as is."""
    if not cfg.peft.use_peft:
        return model

    adapters = init_adapters(model.config, cfg.peft, seed=cfg.seed, base_weights=export_weights(model))
    return add_adapters(model, model.config, cfg.peft, adapters)


def compute_dtype(cfg: TrainConfig) -> Optional[str]:
    return None if cfg.model.dtype == "float32" else cfg.model.dtype


class JaxTrainer(TrainerTemplate):
    """The JAX hooks of ``common.run.trainer.TrainerTemplate``: (graphdef, params, opt_state), gradients added up over
    the micro-batches, torch's clip rule and AdamW in one jitted update; plus the state and the export. A task
    adds ``micro_step`` (loss, metrics and gradients of one micro-batch) and ``summarize``.

    With a ``mesh`` (``parallel.mesh_from_config``) every batch is a global micro-batch (all data
    replicas' rows, ``parallel.DataParallelSteps``); it is sharded over ``data`` x ``cp`` and the
    model attends with ``parallel.ring_attention_fn``. Without one, everything runs on one device.
    """

    def __init__(self, model: CausalLM, cfg: TrainConfig, mesh: Optional[Mesh] = None) -> None:
        self.cfg, self.mesh = cfg, mesh
        # A model with adapters trains them only: ``params`` are the adapters, ``frozen`` the rest (else None).
        self.graphdef, params, self.frozen = split_trainable(model)
        self.peft = has_adapters(model)
        self.params = jax.tree.map(jnp.copy, params)  # apply_updates donates: copy the caller's
        self.vocab_size = model.config.vocab_size
        self.moe_layers = moe_layers(model.config)  # the decoder layers of a MoE step's router counts, in order
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
        self._grads: Any = None
        self._dropout_step, self._dropout_passes = -1, 0
        if d.pad_to_multiple_of is None:
            logger.info(
                "pad_to_multiple_of is unset: padding every micro-batch to a multiple of %d tokens so "
                "that the step compiles once per length bucket",
                self.bucket,
            )

    # -- the step's backend hooks ----------------------------------------------------------

    def accumulate(self, out: tuple[Any, Any]) -> Any:
        record, micro_grads = out
        self._grads = micro_grads if self._grads is None else _add(self._grads, micro_grads)
        return record

    def current_lr(self) -> float:
        return float(self._lr(self.steps_done))

    def gradient_norm(self) -> float:
        return float(_global_norm(self._grads))

    def apply_update(self, grad_norm: Optional[float]) -> float:
        self.params, self.opt_state, applied_norm = apply_updates(
            self.optimizer, self.params, self.opt_state, self._grads
        )
        self.steps_done += 1
        return float(applied_norm)

    def discard_gradients(self) -> None:
        self._grads = None

    # -- evaluation's backend hooks ------------------------------------------------------------

    def eval_generate(
        self, prompt_ids: list[list[int]], *, max_new_tokens: int, eos_token_id: Optional[int], pad_token_id: int
    ) -> Any:
        """The KV-cache sampler, greedy, on the compute-dtype copy of the parameters (as GRPO samples)."""
        dtype = compute_dtype(self.cfg)
        policy = merge_state(self.graphdef, cast_floating(self.params, dtype), cast_floating(self.frozen, dtype))
        return generate(
            policy,
            prompt_ids,
            max_completion_length=max_new_tokens,
            do_sample=False,
            eos_token_id=eos_token_id,
            pad_token_id=pad_token_id,
            pad_to_multiple_of=self.cfg.data.pad_to_multiple_of or 16,
            min_new_tokens=1,  # as torch's generate: a completion is never a bare EOS
        ).completion_ids

    def next_dropout_key(self) -> Optional[jax.Array]:
        """The LoRA dropout key of the next policy pass of this step (``peft.dropout_key``: the seed, the step, the
        pass), None without adapters or with ``lora_dropout=0``: the torch trainer's PEFT dropout in train mode."""
        if not (self.peft and self.cfg.peft.lora_dropout > 0):
            return None
        if self._dropout_step != self.steps_done:
            self._dropout_step, self._dropout_passes = self.steps_done, 0
        self._dropout_passes += 1
        return dropout_key(self.cfg.seed, self.steps_done, self._dropout_passes - 1)

    # -- state and export --------------------------------------------------------------------

    def model(self) -> CausalLM:
        return merge_state(self.graphdef, self.params, self.frozen)

    def trained_model(self) -> CausalLM:
        """twinseq's ``CausalLM`` with the current parameters (adapters included under PEFT)."""
        return self.model()

    def mix_reference(self, alpha: float) -> None:
        ref = getattr(self, "ref_params", None)  # DPO, KTO, GRPO: the live reference copy, if any
        if ref is None:
            return super().mix_reference(alpha)
        self.ref_params = jax.tree.map(lambda r, p: (1.0 - alpha) * r + alpha * p.astype(r.dtype), ref, self.params)

    def state_dict(self) -> dict[str, Any]:
        """The trained parameters (a PEFT run: its adapters by PEFT key, the frozen base is rebuilt from the
        config), the optimizer state and the step count; weights and optimizer streamed (``LazyArray`` leaves).
        With ``sync_ref_model`` also the moving reference (HF names, as the weights)."""
        if self.peft:
            return {
                "adapters": export_adapters(self.model()),
                "optimizer": lazy_numpy_tree(self.opt_state),
                "steps_done": self.steps_done,
            }
        state = {
            "model": lazy_weights(self.model()),
            "optimizer": lazy_numpy_tree(self.opt_state),
            "steps_done": self.steps_done,
        }
        ref = getattr(self, "ref_params", None)
        if self.cfg.reference.sync_ref_model and ref is not None:
            state["reference"] = lazy_weights(merge_state(self.graphdef, ref, None))
        return state

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
        if self.cfg.reference.sync_ref_model and getattr(self, "ref_params", None) is not None and "reference" in state:
            ref = nnx.split(CausalLM(model.config, state["reference"], **model.options()))[1]
            self.ref_params = ref if self.mesh is None else shard_params(self.mesh, ref)
        self.opt_state = self._place_like(opt_state, self.opt_state)
        self.steps_done = int(state["steps_done"])

    def _load_adapter_state(self, model: CausalLM, state: dict[str, Any]) -> None:
        if not (self.peft and "adapters" in state):
            raise CheckpointError(
                f"the checkpoint holds {'adapters' if 'adapters' in state else 'full weights'} but "
                f"this run trains {'adapters' if self.peft else 'every weight'} (use_peft="
                f"{self.cfg.peft.use_peft}); resume with the run's own --use-peft setting."
            )
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
        """An HF model folder, or with PEFT the adapter folder (``common.run.trainer.save_adapter_folder``)."""
        model = self.model()
        if not self.peft:
            save_pretrained(model, path)
            return
        save_adapter_folder(
            path,
            self.cfg,
            model.config,
            self.cfg.peft,
            export_adapters(model),
            lambda base: save_pretrained(
                build_model(model.config, init_weights(model.config, seed=self.cfg.seed)), base
            ),
        )

    def peak_memory_bytes(self) -> int:
        """Accelerator peak bytes in use where JAX reports it, else the process's peak RSS (CPU)."""
        stats = jax.devices()[0].memory_stats() or {}
        return int(stats["peak_bytes_in_use"]) if "peak_bytes_in_use" in stats else peak_rss_bytes()


class SFTTrainer(JaxTrainer):
    """Next-token loss of each micro-batch, on one device or sharded over the mesh."""

    def _inputs(self, batch: Batch) -> tuple[tuple, Any, dict[str, Any]]:
        """(inputs, num_items, keywords) of ``grads_jit`` / ``loss_jit`` for one micro-batch: padded to the bucket,
        and on a mesh sharded (reordered for CP, targets shifted before the reorder)."""
        check_labels(batch.labels, self.vocab_size, batch.num_items_in_batch)
        rows = max(self.rows, batch.shape[0])
        if self.mesh is not None:  # an eval batch may hold more rows than a training one: whole rows per replica
            replicas = self.mesh.size // self.mesh.shape[CP_AXIS]
            rows = -(-rows // replicas) * replicas
        batch = pad_batch(batch, rows, self.bucket)
        kwargs: dict[str, Any] = dict(
            loss_type=self.cfg.loss.loss_type,
            chunk_size=self.cfg.loss.loss_chunk_size,
            compute_dtype=compute_dtype(self.cfg),
            frozen=self.frozen,
        )
        inputs = batch_inputs(batch, self.vocab_size)  # also range-checks the token ids
        num_items = jnp.asarray(batch.num_items_in_batch, jnp.int32)
        if self.mesh is not None:
            arrays = shard_batch(batch, self.mesh)
            inputs = tuple(arrays[k] for k in ("input_ids", "position_ids", "segment_ids", "targets"))
            kwargs.update(attend=self.attend, targets_are_shifted=True)
        return inputs, num_items, kwargs

    def micro_step(self, batch: Batch):
        dropout = self.next_dropout_key()
        inputs, num_items, kwargs = self._inputs(batch)
        micro = self.cfg.data.gradient_accumulation_steps  # divides a MoE model's aux loss (a per-micro-batch mean)
        (loss, metrics), grads = grads_jit(
            self.graphdef, self.params, inputs, num_items, dropout_key=dropout, num_micro_batches=micro, **kwargs
        )
        return {
            "loss": float(loss),
            **{
                k: metrics[k]
                for k in ("num_tokens", "num_correct_tokens", "entropy_sum", "aux_loss", COUNTS_KEY)
                if k in metrics
            },
        }, grads

    def eval_micro_step(self, batch: Batch) -> dict[str, float]:
        inputs, num_items, kwargs = self._inputs(batch)  # no dropout key: PEFT's eval mode
        loss, metrics = loss_jit(self.graphdef, self.params, inputs, num_items, **kwargs)
        sums = {k: float(metrics[k]) for k in ("num_tokens", "num_correct_tokens", "entropy_sum")}
        return {"loss": float(loss), **sums}

    def summarize(self, records: list[dict[str, Any]], micro_batches: list[Batch]) -> dict[str, Any]:
        sums = sft_step_sums(records, num_tokens=sum(b.num_tokens for b in micro_batches))
        return with_means(sums, self.moe_layers)


class DPOTrainer(JaxTrainer):
    """One DPO optimizer step per ``step(pbatches)``; the live reference is a frozen copy of the initial
    parameters (``ref_params``), unless the batches carry precomputed log-probs. With a ``mesh`` (context
    parallelism, ``data=1``: ``common.run.capabilities`` refuses a data axis for DPO) every micro-batch is
    sharded over ``cp`` by ``dpo.step_inputs`` and the policy and reference passes attend over the ring."""

    def __init__(
        self,
        model: CausalLM,
        cfg: TrainConfig,
        *,
        config,
        examples_per_step: int,
        live_reference: bool,
        mesh: Optional[Mesh] = None,
    ) -> None:
        super().__init__(model, cfg, mesh)
        self.config, self.examples_per_step = config, examples_per_step
        self.ref_graphdef = None
        if self.peft:  # the reference is the same parameters with the adapters switched off: no copy
            with adapters_disabled(model):
                self.ref_graphdef = split_trainable(model)[0]
            self.ref_params = None
            self.live_reference = live_reference
        else:
            self.ref_params = jax.tree.map(jnp.copy, self.params) if live_reference else None
            self.live_reference = live_reference

    def _step_inputs(self, pbatch) -> tuple[Any, tuple, dict[str, Any]]:
        """(padded batch, inputs, keywords of the jitted passes): ``dpo.step_inputs`` of the bucket-padded batch."""
        pbatch = pad_for_mesh(pbatch, self.mesh, self.bucket)
        inputs, keywords = step_inputs(pbatch, self.vocab_size, self.mesh, self.cfg.parallel.context_parallel_strategy)
        loss = self.cfg.loss
        keywords.update(
            loss_type=loss.loss_type, chunk_size=loss.loss_chunk_size, compute_dtype=compute_dtype(self.cfg)
        )
        return pbatch, inputs, keywords

    def _reference(self, pbatch, inputs, keywords: Optional[dict[str, Any]] = None):
        """(chosen [N], rejected [N]) reference log-probs: precomputed, or a pass of the reference on ``inputs``
        (``keywords`` as ``_step_inputs``; None: one device, the config's kernel)."""
        if not self.live_reference:
            return _ref_arrays(pbatch, None, None)
        if keywords is None:
            loss = self.cfg.loss
            keywords = dict(
                loss_type=loss.loss_type, chunk_size=loss.loss_chunk_size, compute_dtype=compute_dtype(self.cfg)
            )
        if self.peft:
            graphdef, state, frozen = self.ref_graphdef, self.params, self.frozen
        else:
            graphdef, state, frozen = self.graphdef, self.ref_params, None
        logps_D = sequence_logps_jit(graphdef, state, inputs, frozen=frozen, **keywords)
        return logps_D[: pbatch.num_examples], logps_D[pbatch.num_examples :]

    def micro_step(self, pbatch):
        pbatch, inputs, keywords = self._step_inputs(pbatch)
        ref_c, ref_r = self._reference(pbatch, inputs, keywords)
        (value, pairs), grads = dpo_grads_jit(
            self.graphdef,
            self.params,
            inputs,
            ref_c,
            ref_r,
            jnp.asarray(pbatch.num_examples_in_step or self.examples_per_step, jnp.float32),  # an epoch's last step
            config=self.config,
            frozen=self.frozen,
            dropout_key=self.next_dropout_key(),
            **keywords,
        )
        return (float(value), pairs), grads

    def micro_losses(self, records: list[Any]) -> list[float]:
        return [value for value, _ in records]

    def eval_micro_step(self, pbatch: Any) -> dict[str, Any]:
        pbatch, inputs, keywords = self._step_inputs(pbatch)
        logps_D = sequence_logps_jit(self.graphdef, self.params, inputs, frozen=self.frozen, **keywords)
        n = pbatch.num_examples
        out = {"chosen_logps": logps_D[:n], "rejected_logps": logps_D[n:]}
        if self.live_reference:
            out["ref_chosen_logps"], out["ref_rejected_logps"] = self._reference(pbatch, inputs, keywords)
        return {k: np.asarray(v, np.float64) for k, v in out.items()}

    def summarize(self, records: list[Any], micro_batches: list[Any]) -> dict[str, Any]:
        per_pair = {
            k: [np.asarray(pairs[k], np.float64) for _, pairs in records]
            for k in ("chosen_rewards", "rejected_rewards", "chosen_logps", "rejected_logps")
        }
        return dpo_step_metrics(
            [value for value, _ in records],
            per_pair,
            num_tokens=sum(pb.batch.num_tokens for pb in micro_batches),
            num_label_tokens=sum(pb.batch.num_label_tokens for pb in micro_batches),
        )


# --------------------------------------------------------------------------------------
# `twinseq train --backend jax`
# --------------------------------------------------------------------------------------


def describe(cfg: TrainConfig, trainer: JaxTrainer) -> str:
    """``common.run.trainer.describe_run`` of a JAX trainer: its parameters (or adapters), device or mesh, remat."""
    num_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(trainer.params))
    params = f"{num_params / 1e6:.2f}M params"
    if trainer.peft:
        total = num_params + sum(int(np.prod(x.shape)) for x in jax.tree.leaves(trainer.frozen))
        params = peft_summary(cfg.peft, trainable=num_params, total=total, quantized=cfg.peft.load_in_4bit)
    where = (
        str(jax.devices()[0])
        if trainer.mesh is None
        else f"a mesh {dict(trainer.mesh.shape)} (cp attention: {cfg.parallel.context_parallel_strategy})"
    )
    model = trainer.model()
    return describe_run(
        cfg,
        backend="jax",
        model_type=model.config.model_type,
        params=params,
        where=where,
        details=[f"remat={model.model.remat_policy}"],
    )


def build_step_source(cfg: TrainConfig, mesh: Optional[Mesh], inputs: RunInputs = NO_INPUTS):
    """(step source, tokenizer, stats): ``common.data.sft_steps``'s iterator, or on a mesh one per data replica."""
    if mesh is None:
        return build_step_iterator(cfg, dataset=inputs.train_dataset, tokenizer=inputs.tokenizer)
    rows, tokenizer, stats = prepare_sft_dataset(cfg, inputs.train_dataset, inputs.tokenizer)
    cp = mesh.shape[CP_AXIS]
    multiple = sequence_multiple(cfg.data.pad_to_multiple_of or DEFAULT_BUCKET, cp)
    return DataParallelSteps(rows, cfg, tokenizer.pad_token_id, mesh.size // cp, multiple), tokenizer, stats


def refuse_built_model(inputs: RunInputs) -> None:
    """The jax backend builds its model from a folder or a preset; a built (torch) model object is not one."""
    if inputs.model is not None:
        raise ConfigError(
            f"model={type(inputs.model).__name__} (a built model object) is for backend='torch'; on the jax backend "
            f"pass the model's folder, a Hub id in the local cache, or a preset name."
        )


def build_sft(cfg: TrainConfig, inputs: RunInputs = NO_INPUTS):
    """(trainer, step source, tokenizer, announce lines) of an SFT run, on one device or a (data, cp) mesh."""
    refuse_built_model(inputs)
    mesh = mesh_from_config(cfg)  # None unless context_parallel_size > 1
    source, tokenizer, stats = build_step_source(cfg, mesh, inputs)
    cfg = with_resolved_max_steps(cfg, source)  # max_steps=-1: num_train_epochs passes over the source
    trainer = SFTTrainer(parallelize(build_causal_lm(cfg, tokenizer.vocab_size), mesh, cfg), cfg, mesh)
    return trainer, source, tokenizer, [describe(cfg, trainer), f"data: {stats}"]


def build_dpo(cfg: TrainConfig, inputs: RunInputs = NO_INPUTS):
    """(trainer, step source, tokenizer, announce lines) of a DPO run, on one device or, with
    ``context_parallel_size > 1``, on a (data=1, cp) mesh (reference passes included)."""
    refuse_built_model(inputs)
    config = validate_dpo_config(
        cfg.dpo.dpo_loss_type, cfg.dpo.loss_weights, cfg.dpo.beta, cfg.dpo.label_smoothing, cfg.dpo.discopop_tau
    )
    mesh = mesh_from_config(cfg)  # None unless context_parallel_size > 1 (then data=1: capabilities' rule)
    rows, tokenizer, stats = prepare_dpo_dataset(cfg, inputs.train_dataset, inputs.tokenizer)
    model = parallelize(build_causal_lm(cfg, tokenizer.vocab_size), mesh, cfg)
    if cfg.dpo.precompute_ref_log_probs:  # the initial model, before any checkpoint is loaded
        t0 = time.perf_counter()
        reference = model
        if has_adapters(model):  # PEFT: the base, adapters switched off (a shallow copy shares the weights)
            reference = nnx.merge(*nnx.split(model))
            set_adapters_enabled(reference, False)
        rows = precompute_ref_logps(
            reference, rows, cfg, tokenizer.pad_token_id, cfg.data.pad_to_multiple_of or DEFAULT_BUCKET, mesh
        )
        logger.info("precomputed reference log-probs of %d pairs in %.1fs", len(rows), time.perf_counter() - t0)
    source = build_preference_iterator(cfg, rows, tokenizer.pad_token_id)
    cfg = with_resolved_max_steps(cfg, source)  # max_steps=-1: num_train_epochs passes over the source
    trainer = DPOTrainer(
        model,
        cfg,
        config=config,
        examples_per_step=source.examples_per_step,
        live_reference=not cfg.dpo.precompute_ref_log_probs,
        mesh=mesh,
    )
    announce = [
        describe(cfg, trainer),
        f"dpo_loss_type={list(config.loss_type)}, beta={config.beta}, reference="
        f"{reference_description(cfg, precomputed=cfg.dpo.precompute_ref_log_probs)}, "
        f"{source.examples_per_step} pairs per step; data: {stats}",
    ]
    return trainer, source, tokenizer, announce
