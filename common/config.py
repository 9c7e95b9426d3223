"""One tree of configuration dataclasses, nested by concern, shared by both backends, the CLI and YAML.

``TrainConfig`` holds the run itself (backend, task, steps, output) and one section per concern:

==========  ==================  ================================================================
section     class               knobs (TRL's names)
==========  ==================  ================================================================
model       ``ModelArgs``       model_config, attn_implementation, dtype
data        ``DataConfig``      dataset, truncation, packing, padding-free, batch sizes
optim       ``OptimConfig``     learning rate, schedule, AdamW, clipping
loss        ``LossConfig``      loss_type (the token-loss kernel), loss_chunk_size, use_liger_kernel
memory      ``MemoryConfig``    gradient_checkpointing, activation_offloading, torch_compile
parallel    ``ParallelConfig``  fsdp, context_parallel_size, context_parallel_strategy
dpo         ``DPOConfig``       beta, dpo_loss_type, loss_weights, label_smoothing, ...
grpo        ``GRPOConfig``      num_generations, grpo_beta, epsilon, grpo_loss_type, reward_funcs, vllm_*, ...
rloo        ``RLOOConfig``      rloo_beta, normalize_advantages, reward_clip_range (the rollout: ``grpo``'s)
kto         ``KTOConfig``       kto_loss_type, desirable_weight, undesirable_weight (beta: ``dpo``'s)
reference   ``ReferenceConfig`` sync_ref_model, ref_model_mixup_alpha, ref_model_sync_steps
peft        ``PeftConfig``      use_peft, lora_r, lora_alpha, lora_target_modules, load_in_4bit, ...
==========  ==================  ================================================================

Field names are unique across sections, so the CLI and YAML files stay flat, with TRL's names
(``--max-length``, ``max_length: 512``); the CLI is generated from these dataclasses by tyro.
Every field is checked for type and range in one place, ``_check_fields``, whatever its source
(YAML, CLI, Python); rules that tie fields together are in ``TrainConfig._check_combinations``.
An invalid value raises ``ConfigError``/``ConfigTypeError`` naming the field, the value and the fix.

>>> cfg = TrainConfig.from_flat(max_length=64, packing=True, learning_rate=3e-3)
>>> cfg.data.max_length, cfg.data.packing, cfg.optim.learning_rate
(64, True, 0.003)
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Mapping, Optional

import yaml

from twinseq.common.errors import ConfigError, ConfigTypeError
from twinseq.common.fields import _CHECKS_ON, _check_fields, _flag, deferred_checks, knob  # noqa: F401  (re-exported: the config surface)
from twinseq.common.models.configs import MODEL_PRESETS, MODEL_TYPES, ModelConfig, resolve_model_config  # noqa: F401  (re-exported: the config surface)
from twinseq.common.models.peft import (
    PeftConfig,  # noqa: F401  (re-exported: the config surface)
    check_peft_config,
)
from twinseq.common.objectives.dpo import DPO_TASK  # noqa: F401  (the built-in methods' TaskSpecs register on import)
from twinseq.common.objectives.grpo import (
    GRPOConfig,  # noqa: F401  (re-exported: the config surface)
)
from twinseq.common.objectives.kto import KTOConfig
from twinseq.common.objectives.nll import SFT_TASK  # noqa: F401
from twinseq.common.objectives.reference import ReferenceConfig, check_ref_sync
from twinseq.common.objectives.rloo import RLOOConfig
from twinseq.common.tasks import task_spec, task_specs

Backend = Literal["torch", "jax"]
TASKS = tuple(spec.name for spec in task_specs())
"""The ``task`` choices: every registered ``common.tasks.TaskSpec`` (each method's objectives module declares its
own; the section classes imported above import them)."""
if typing.TYPE_CHECKING:
    Task = str
else:
    Task = Literal[TASKS]
TruncationMode = Literal["keep_start", "keep_end"]
PackingStrategy = Literal["bfd", "bfd_split", "wrapped"]
LossType = Literal["nll", "chunked_nll", "fused_linear", "liger", "triton"]
AttnImplementation = Literal["sdpa", "eager", "flex_attention", "varlen", "flash_attention_2", "flash_attention_3"]
DType = Literal["float32", "bfloat16"]
InitWeights = Literal["pretrained", "random"]
TritonGradients = Literal["exact", "cce"]
PaddingSide = Literal["right", "left"]
LRScheduler = Literal["constant", "linear", "cosine"]
ContextParallelStrategy = Literal["allgather", "ring", "ulysses"]
ReportTo = Literal["none", "tensorboard", "wandb"]
Optimizer = Literal["adamw_torch", "adamw_bnb_8bit", "adamw_bf16", "adamw_bf16_8bit"]
DeepSpeedZeroStage = Literal[0, 3]
EvalStrategy = Literal["no", "steps", "epoch"]

BACKENDS = typing.get_args(Backend)
TRUNCATION_MODES = typing.get_args(TruncationMode)
PACKING_STRATEGIES = typing.get_args(PackingStrategy)
LOSS_TYPES = typing.get_args(LossType)
ATTN_IMPLEMENTATIONS = typing.get_args(AttnImplementation)
DTYPES = typing.get_args(DType)
PADDING_SIDES = typing.get_args(PaddingSide)
LR_SCHEDULERS = typing.get_args(LRScheduler)
CONTEXT_PARALLEL_STRATEGIES = typing.get_args(ContextParallelStrategy)
REPORT_TO = typing.get_args(ReportTo)
OPTIMIZERS = typing.get_args(Optimizer)
EVAL_STRATEGIES = typing.get_args(EvalStrategy)

# Which attention path runs, shared by the backends and the memory planner (``common.run.memory_plan``):
DEFAULT_ATTENTION_BLOCK_SIZE = 512
"""Tokens per query/key block of the blocked (online-softmax) attention (``MemoryConfig.attention_block_size``)."""
BLOCKED_MIN_SEQ_LEN = 2048
"""torch: from this row length on, ``sdpa``/``eager`` on CPU run the blocked attention (``torch_backend.attention``):
the dense float mask is 4 T^2 bytes per row (16 MiB at 2048) and CPU sdpa/eager with a mask hold H such score
matrices."""
JAX_DENSE_ATTN_IMPLEMENTATIONS = ("eager",)
"""jax: ``attn_implementation`` values that run the dense reference; every other value runs the blocked kernel for
rows longer than one block (rows that fit one block take the dense path: ``jax_backend.attention``)."""
DEFAULT_CHUNK_SIZE = 256
"""Tokens per chunk of the chunked and fused losses and log-probs, on both backends."""
DEFAULT_LEARNING_RATES: dict[tuple[str, bool], float] = {
    (spec.name, use_peft): spec.peft_learning_rate if use_peft else spec.learning_rate
    for spec in task_specs()
    for use_peft in (False, True)
}
"""``learning_rate`` when none is given, by (task, use_peft): TRL's defaults for full fine-tuning (``SFTConfig``
2e-5, ``DPOConfig`` and ``GRPOConfig`` 1e-6), and with LoRA about ten times those, as TRL's PEFT guides train
adapters (SFT with LoRA: 1e-4). Tuned for pretrained checkpoints; a freshly initialised model wants far more (the
configs under ``configs/`` use 1e-3 to 3e-2)."""
TRITON_DW_SLICE_BYTES = 64 * 2**20
"""loss_type='triton': the float32 lm_head gradient is accumulated a vocabulary slice of at most this size at a time
(1/30 of a 248k x 2048 head), each slice cast to the weight's dtype when done."""


# ---------------------------------------------------------------------------------------
# The sections of a training run
# ---------------------------------------------------------------------------------------


class _Section:
    def __post_init__(self) -> None:
        if _CHECKS_ON.get():
            _check_fields(self)


@dataclass
class ModelArgs(_Section):
    """Which model to train and how its layers compute."""

    model_config: str = "tiny"
    """A preset (tiny, small, tiny-llama3, tiny-qwen2, tiny-qwen3, tiny-qwen3-moe, tiny-mistral, tiny-mixtral,
    tiny-gpt-oss, tiny-gemma2, tiny-gemma3), a local Hugging Face checkpoint folder (Llama, Qwen2, Qwen3, Qwen3-MoE,
    Mistral, Mixtral, gpt-oss, Gemma 2, Gemma 3 text), or a folder with a config.json alone (with
    ``init_weights='random'``). TRL's ``model_name_or_path`` (``--model-name-or-path``) is an alias."""
    init_weights: InitWeights = "pretrained"
    """``pretrained``: a model folder's own weights; a folder with a config.json and no weights is refused, naming
    the missing files. ``random``: weights drawn from the run's seed, for that folder's architecture (its weights,
    if any, are not read). A preset always starts from random weights."""
    attn_implementation: AttnImplementation = "sdpa"
    """Attention path; every path masks packed documents (a path that cannot refuses to run)."""
    dtype: DType = "float32"
    """Compute dtype; parameters stay float32 (mixed precision, like torch autocast)."""


@dataclass
class DataConfig(_Section):
    """What goes into one optimizer step: the dataset, its truncation, packing and batching."""

    dataset_name: str = "embedded"
    """``embedded`` (built offline from the stdlib), a local JSONL/Parquet/CSV path, or a hub name."""
    dataset_split: str = "train"
    tokenizer_name_or_path: Optional[str] = None
    """``embedded``, or a local Hugging Face tokenizer folder. None: the tokenizer of the model folder
    (``--model-config DIR`` holding a ``tokenizer.json``), else the embedded one."""
    max_length: Optional[int] = knob(512, ge=1)
    truncation_mode: TruncationMode = "keep_start"
    max_prompt_length: Optional[int] = knob(256, ge=1)
    max_completion_length: Optional[int] = knob(None, ge=1)
    completion_only_loss: Optional[bool] = None
    """None: mask the prompt when the data has a completion mask."""
    assistant_only_loss: bool = False
    packing: bool = False
    packing_strategy: PackingStrategy = "bfd"
    padding_free: bool = False
    pad_to_multiple_of: Optional[int] = knob(None, ge=1)
    padding_side: PaddingSide = "right"
    per_device_train_batch_size: int = knob(8, ge=1)
    gradient_accumulation_steps: int = knob(1, ge=1)
    per_device_eval_batch_size: int = knob(8, ge=1)
    """Examples (SFT rows, packed rows with ``packing``, DPO pairs, GRPO prompts) per evaluation micro-batch."""
    eval_dataset_name: Optional[str] = None
    """The eval set, as ``dataset_name`` takes it (a file, a folder, a hub name, ``embedded``), read at
    ``eval_split``. None: ``dataset_name`` when ``eval_split`` is given. See also ``eval_fraction``."""
    eval_split: Optional[str] = None
    """The split (or slice: ``train[90%:]``) of the eval set (None: ``train`` for ``eval_dataset_name``). A single
    file or an embedded dataset has the split ``train`` only: hold out a part of it with ``eval_fraction``."""
    eval_fraction: Optional[float] = knob(None, gt=0, lt=1)
    """Hold out this fraction of the training rows (``dataset_name`` at ``dataset_split``, or ``train_dataset``) as
    the eval set, drawn from ``seed`` (``ceil(fraction x rows)`` rows, as ``datasets``' ``train_test_split``); the
    run trains on the rest only."""


@dataclass
class OptimConfig(_Section):
    """AdamW with a warmup schedule and gradient clipping (the same rule on both backends)."""

    learning_rate: Optional[float] = knob(None, ge=0)
    """None: the task's default for a pretrained checkpoint, TRL's (``DEFAULT_LEARNING_RATES``: SFT 2e-5, DPO and
    GRPO 1e-6; with ``use_peft`` 1e-4, 1e-5 and 1e-5), resolved when the config is checked, so ``to_dict()`` and
    every checkpoint hold the number. twinseq's presets train random tiny models: their YAML files set their own."""
    lr_scheduler_type: LRScheduler = "cosine"
    warmup_steps: int = knob(0, ge=0)
    warmup_ratio: float = knob(0.0, ge=0, lt=1)
    weight_decay: float = knob(0.0, ge=0)
    adam_beta1: float = knob(0.9, ge=0, lt=1)
    adam_beta2: float = knob(0.999, ge=0, lt=1)
    adam_epsilon: float = knob(1e-8, gt=0)
    max_grad_norm: Optional[float] = knob(1.0, gt=0)
    optimizer: Optimizer = "adamw_torch"
    """``adamw_torch`` (float32 moments), ``adamw_bnb_8bit`` (8-bit blockwise moments, HF's ``optim`` name:
    bitsandbytes' ``AdamW8bit`` on torch, the same rule as an optax transformation on jax,
    ``common/run/adamw_8bit.py``) or ``adamw_bf16`` (torch, full fine-tune: bfloat16 weights, gradients and
    moments, 8 bytes of state per parameter instead of 16, every write stochastically rounded;
    ``torch_backend/bf16_adamw.py``) or ``adamw_bf16_8bit`` (torch, full fine-tune: those bfloat16 weights and
    gradients with the 8-bit moments of ``common/run/adamw_8bit.py``: about 6 bytes per parameter, 4 with
    ``optimizer_in_backward``)."""
    optimizer_in_backward: bool = False
    """torch: step each parameter in its gradient's hook, as soon as backward has produced the gradient, and free the
    gradient there (torchtune's ``optimizer_in_bwd``): one gradient is alive at a time, not all of them. Needs
    ``gradient_accumulation_steps=1`` and ``max_grad_norm=None`` (no step sees every gradient); the norm is still
    logged. One process (not FSDP2, DeepSpeed or context parallelism); with twinseq's own AdamW (``adamw_torch``,
    ``adamw_bf16``, ``adamw_bf16_8bit``), not bitsandbytes'."""
    skip_nonfinite_steps: bool = False
    """A step whose loss or gradient norm is NaN/Inf is skipped (counted, logged) instead of stopping the run."""


@dataclass
class LossConfig(_Section):
    """The token-loss kernel: how next-token NLL (or DPO's log-probs) are computed from hidden states."""

    loss_type: LossType = "nll"
    """nll (full logits), chunked_nll, fused_linear (no [tokens, vocab] tensor), liger (CUDA) or triton (twinseq's
    Triton kernel on CUDA; elsewhere it runs fused_linear and logs so)."""
    loss_chunk_size: int = knob(DEFAULT_CHUNK_SIZE, ge=1)
    use_liger_kernel: bool = False
    """TRL's switch: with loss_type nll it selects Liger's fused linear cross-entropy."""
    triton_gradients: TritonGradients = "exact"
    """The SFT loss's gradients under loss_type triton: ``exact`` (every logit, float32 accumulators) or ``cce`` (cut
    cross-entropy's numerics: target-free tiles whose probabilities are all below the dtype's eps / 32 skipped,
    gradients accumulated in the input dtype; the least memory and time, docs/loss-kernels.md)."""


@dataclass
class MemoryConfig(_Section):
    """Activation memory: recompute, offload, compile."""

    gradient_checkpointing: bool = False
    activation_offloading: bool = False
    torch_compile: bool = False
    tiled_mlp: bool = False
    """Run each decoder MLP over chunks of ``tiled_mlp_chunk_size`` tokens, recomputed in backward (ALST's
    tiled MLP): the ``[tokens, intermediate]`` activations of one chunk are live at a time, not of the sequence."""
    tiled_mlp_chunk_size: int = knob(4096, ge=1)
    """Tokens per MLP tile (with ``tiled_mlp``)."""
    attention_block_size: int = knob(DEFAULT_ATTENTION_BLOCK_SIZE, ge=1)
    """Query and key block of the blocked (online-softmax) attention paths: their memory is
    O(tokens x block), never O(tokens^2)."""
    share_prefix: bool = True
    """GRPO/RLOO and DPO: the completions of one prompt share one copy of it in the log-prob forward (prefix
    sharing: ``P - 1 + G * (C + 1)`` tokens per group instead of ``G * (P + C)``), exact; ``False`` repeats the
    prompt for each completion. Where a run cannot share (context parallelism, Liger's DPO loss) it is off, logged."""


@dataclass
class ParallelConfig(_Section):
    """FSDP2 and context parallelism (a multi-process torch launch always shards with FSDP2)."""

    fsdp: bool = False
    context_parallel_size: int = knob(1, ge=1)
    """Ranks (torch) or devices (jax) that split every sequence; must divide the world size."""
    context_parallel_strategy: ContextParallelStrategy = "allgather"
    """``allgather``: packed/padding-free safe, CPU or GPU. ``ring``: torch's ring attention, CUDA,
    unpacked only (jax's ring runs everywhere). ``ulysses`` (torch only): DeepSpeed-Ulysses sequence parallelism,
    an all-to-all per attention layer trades the sequence shard for a slice of the heads over the whole row;
    packed/padding-free safe, CPU or GPU; ``num_attention_heads`` must be a multiple of ``context_parallel_size``."""
    deepspeed_zero_stage: DeepSpeedZeroStage = 0
    """0: off. 3: DeepSpeed ZeRO-3 (torch only, ``pip install 'twinseq[deepspeed]'``): parameters, gradients and
    optimizer state partitioned over the ranks of a torchrun launch; not with fsdp or context parallelism.
    Stages 1 and 2 are not wired (FSDP2 covers their use)."""


@dataclass
class DPOConfig(_Section):
    """Direct preference optimisation (read with ``task=dpo`` only)."""

    beta: float = knob(0.1, gt=0)
    dpo_loss_type: list[str] = field(default_factory=lambda: ["sigmoid"])
    """TRL's DPO ``loss_type`` (one or several); ``loss_type`` names the token-loss kernel."""
    loss_weights: Optional[list[float]] = None
    label_smoothing: float = knob(0.0, ge=0, le=0.5)
    discopop_tau: float = knob(0.05, gt=0)
    """``discopop``: the temperature of the sigmoid that mixes its logistic and exponential parts (TRL's name)."""
    precompute_ref_log_probs: bool = False
    """Compute reference log-probs once before training instead of keeping a frozen model copy."""


SECTIONS: dict[str, type] = {
    "model": ModelArgs,
    "data": DataConfig,
    "optim": OptimConfig,
    "loss": LossConfig,
    "memory": MemoryConfig,
    "parallel": ParallelConfig,
    "dpo": DPOConfig,
    "peft": PeftConfig,
}
SECTIONS["grpo"] = GRPOConfig
SECTIONS["rloo"] = RLOOConfig
SECTIONS["kto"] = KTOConfig
SECTIONS["reference"] = ReferenceConfig
ONLINE_TASKS = tuple(spec.name for spec in task_specs() if spec.online)
"""The tasks that generate their batches (``common.run.rollout``), with the ``grpo`` section's rollout knobs."""
REFERENCE_TASKS = tuple(spec.name for spec in task_specs() if spec.reference)
"""The tasks with a reference model (the ``reference`` section is read by these only)."""
TASK_SECTIONS: dict[str, tuple[str, ...]] = {
    section: tuple(spec.name for spec in task_specs() if section in spec.sections)
    for section in sorted({section for spec in task_specs() for section in spec.sections})
}
TASK_SECTIONS["reference"] = REFERENCE_TASKS
"""Sections read by some tasks only (section: those tasks, from their ``TaskSpec.sections``): setting them on
another task is refused, not ignored."""


@dataclass
class TrainConfig:
    """Everything one training run needs. ``twinseq train --help`` lists every field as a flag."""

    backend: Backend = field(default_factory=lambda: os.environ.get("TWINSEQ_BACKEND", "torch"))  # type: ignore
    """Which backend runs the job; ``TWINSEQ_BACKEND`` sets the default."""
    task: Task = "sft"
    output_dir: str = "runs/latest"
    overwrite_output_dir: bool = False
    """Train into an ``output_dir`` that already holds a run (its ``metrics.jsonl``, ``checkpoint-N`` or ``final/``);
    without it (or ``resume_from_checkpoint``) such a folder is refused (HF's ``overwrite_output_dir``)."""
    seed: int = 0
    max_steps: int = knob(100, ge=-1)
    """Optimizer steps to run; -1: as many as ``num_train_epochs`` passes over the data take (Hugging Face's rule:
    a positive ``max_steps`` wins over ``num_train_epochs``)."""
    num_train_epochs: float = knob(3.0, gt=0)
    """Passes over the training data when ``max_steps=-1`` (fractions allowed: 0.5 is half a pass): the run takes
    ceil(num_train_epochs x steps per epoch) optimizer steps, the last step of each epoch taking the rows left."""
    logging_steps: int = knob(1, ge=1)
    """Write a metrics line every N optimizer steps (averaged over them)."""
    save_steps: int = knob(0, ge=0)
    """Write a resumable checkpoint every N optimizer steps (0: no intermediate checkpoint)."""
    save_final_checkpoint: bool = True
    """Write a resumable ``checkpoint-<max_steps>`` at the end of the run as well as the ``final`` model folder
    (``--no-save-final-checkpoint``: the model folder only, which cannot resume or extend the run)."""
    save_total_limit: Optional[int] = knob(None, ge=1)
    """Keep only the newest N checkpoints (None: keep all); with ``load_best_model_at_end`` the best one is kept
    too (HF's rule)."""
    eval_strategy: EvalStrategy = "no"
    """When to evaluate on the eval set (HF's name): ``no``; ``steps``: every ``eval_steps`` optimizer steps;
    ``epoch``: at the end of every pass over the training data (and at the last step). Needs an eval set:
    ``eval_dataset_name`` / ``eval_split``, ``eval_fraction``, or ``eval_dataset=`` from Python."""
    eval_steps: Optional[int] = knob(None, ge=1)
    """Evaluate every N optimizer steps with ``eval_strategy='steps'`` (None: ``logging_steps``, as HF)."""
    eval_on_start: bool = False
    """Evaluate once before the first optimizer step (HF's ``eval_on_start``): the starting point of the curve."""
    load_best_model_at_end: bool = False
    """Keep the checkpoint of the best evaluation (``metric_for_best_model``) and end the run with its weights: the
    ``final`` folder holds them (the last ``checkpoint-N`` stays the last state, to resume from). A checkpoint is
    written at every evaluation (``save_steps`` 0), or ``save_steps`` must be a multiple of ``eval_steps``."""
    metric_for_best_model: Optional[str] = None
    """The evaluation metric ``load_best_model_at_end`` and early stopping compare, with or without its ``eval_``
    prefix (None: ``eval_loss``; GRPO, which has no loss on held-out prompts: ``eval_reward``)."""
    greater_is_better: Optional[bool] = None
    """Whether a larger ``metric_for_best_model`` is better (None: True unless the metric's name ends in
    ``loss``, as HF)."""
    early_stopping_patience: Optional[int] = knob(None, ge=1)
    """Stop the run when ``metric_for_best_model`` has not improved for N evaluations in a row (the run adds
    ``common.run.callbacks.EarlyStoppingCallback``, transformers' own rule). None: never."""
    early_stopping_threshold: float = knob(0.0, ge=0)
    """The smallest change of ``metric_for_best_model`` that counts as an improvement (with
    ``early_stopping_patience``)."""
    eval_generate_samples: int = knob(0, ge=0)
    """SFT: at every evaluation, greedily complete the prompts of the first N eval rows and write them beside their
    reference (``<output_dir>/samples/step_N.jsonl`` and ``.md``). 0: none."""
    resume_from_checkpoint: Optional[str] = None
    """A ``checkpoint-N`` directory, or ``latest`` for the newest complete one in output_dir."""
    disable_tqdm: bool = False
    report_to: list[ReportTo] = field(default_factory=lambda: ["none"])
    """Extra metric sinks besides metrics.jsonl: ``tensorboard`` (event files in output_dir/runs), ``wandb`` (a
    Weights & Biases run, extra ``twinseq[wandb]``; project ``WANDB_PROJECT``, default ``twinseq``;
    ``WANDB_MODE=offline`` needs no account)."""
    run_name: Optional[str] = None
    """The run's name in a tracker of ``report_to`` (wandb); None: the tracker's own (``WANDB_NAME``, or a random
    name)."""

    model: ModelArgs = field(default_factory=ModelArgs)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    dpo: DPOConfig = field(default_factory=DPOConfig)
    peft: PeftConfig = field(default_factory=PeftConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    rloo: RLOOConfig = field(default_factory=RLOOConfig)
    kto: KTOConfig = field(default_factory=KTOConfig)
    reference: ReferenceConfig = field(default_factory=ReferenceConfig)

    def __post_init__(self) -> None:
        if _CHECKS_ON.get():
            self.validate()

    def validate(self) -> "TrainConfig":
        """Check every field of every section, then the rules that tie them together; returns ``self``."""
        _check_fields(self)
        for name, cls in SECTIONS.items():
            if not isinstance(getattr(self, name), cls):
                raise ConfigTypeError(
                    f"TrainConfig.{name} must be a {cls.__name__}, got "
                    f"{type(getattr(self, name)).__name__}; build configs with "
                    f"TrainConfig.from_flat(...) or from_dict(...)."
                )
            _check_fields(getattr(self, name))
        self._check_combinations()
        self._resolve_task_defaults()
        return self

    def _resolve_task_defaults(self) -> None:
        """``learning_rate`` None becomes the number of ``DEFAULT_LEARNING_RATES`` for this task (and ``use_peft``);
        ``task_defaults()`` then names it, so that a copy for another task (``replace``, the CLI's flags over a
        YAML file) resolves it again rather than inheriting this task's number."""
        if self.optim.learning_rate is None:
            self.optim.learning_rate = DEFAULT_LEARNING_RATES[(self.task, self.peft.use_peft)]
            object.__setattr__(self.optim, _TASK_DEFAULT, self.optim.learning_rate)

    def task_defaults(self) -> list[str]:
        """The fields that hold a task default set by the last ``validate`` (``["learning_rate"]``), not a given
        value."""
        resolved = getattr(self.optim, _TASK_DEFAULT, None)
        return ["learning_rate"] if resolved is not None and self.optim.learning_rate == resolved else []

    def _check_combinations(self) -> None:
        """Rules that tie fields of different sections together."""
        d, loss = self.data, self.loss
        if d.packing and d.max_length is None:
            raise ConfigError("packing=True needs max_length (the packed row length); set --max-length.")
        if self.max_steps == 0:
            raise ConfigError(
                "max_steps=0 is not valid: pass a positive number of optimizer steps (--max-steps 100), or -1 to "
                "train for num_train_epochs passes over the data (--max-steps -1 --num-train-epochs 2)."
            )
        for section, tasks in TASK_SECTIONS.items():
            if self.task not in tasks:
                changed = _changed_fields(getattr(self, section))
                if changed:
                    raise ConfigError(
                        f"{', '.join(changed)} {'is' if len(changed) == 1 else 'are'} read by "
                        f"task={' or '.join(repr(t) for t in tasks)} only, and this run has task={self.task!r}; "
                        f"drop {' '.join(_flag(c) for c in changed)} or set --task {tasks[0]}."
                    )
        check = task_spec(self.task).check
        if check is not None:
            check(self)

        check_ref_sync(
            self.reference,
            task=self.task,
            use_peft=self.peft.use_peft,
            precompute_ref_log_probs=self.dpo.precompute_ref_log_probs,
            kl_beta=self.reference_kl_beta,
            kl_beta_name=task_spec(self.task).kl_beta,
        )
        check_peft_config(self.peft)
        self._check_evaluation()
        if loss.use_liger_kernel and loss.loss_type not in ("nll", "liger"):
            raise ConfigError(
                f"use_liger_kernel=True selects Liger's fused cross-entropy, but loss_type="
                f"{loss.loss_type!r} asks for another kernel; drop --use-liger-kernel or use "
                f"--loss-type liger."
            )
        if loss.triton_gradients != "exact" and loss.loss_type != "triton":
            raise ConfigError(
                f"triton_gradients={loss.triton_gradients!r} is read by loss_type='triton' only, and "
                f"this run has loss_type={loss.loss_type!r}; add --loss-type triton or drop "
                f"--triton-gradients."
            )
        if loss.use_liger_kernel:
            # TRL's use_liger_kernel switches the loss to Liger's fused linear cross-entropy.
            loss.loss_type = "liger"
        if len(set(self.report_to)) != len(self.report_to) or ("none" in self.report_to and len(self.report_to) > 1):
            raise ConfigError(
                f"report_to={self.report_to!r} is not valid: give 'none' alone, or any of 'tensorboard', 'wandb' once."
            )

    def _check_evaluation(self) -> None:
        """The evaluation fields together (HF's rules where HF has them)."""
        d, evaluates = self.data, self.eval_strategy != "no"
        if d.eval_fraction is not None and (d.eval_dataset_name is not None or d.eval_split is not None):
            raise ConfigError(
                f"eval_fraction={d.eval_fraction} holds out part of the training data as the eval set, and "
                f"eval_dataset_name/eval_split name another one; give one of them."
            )
        if self.load_best_model_at_end:
            if not evaluates:
                raise ConfigError(
                    "load_best_model_at_end=True needs evaluations to compare: set --eval-strategy steps (or epoch)."
                )
            if self.save_steps and (self.eval_strategy == "epoch" or self.save_steps % self.effective_eval_steps):
                raise ConfigError(
                    f"load_best_model_at_end=True with save_steps={self.save_steps} and eval_strategy="
                    f"{self.eval_strategy!r} (eval_steps={self.effective_eval_steps}): the checkpoints must be "
                    f"written at evaluations (HF's rule: save_steps a multiple of eval_steps); set --save-steps to a "
                    f"multiple of {self.effective_eval_steps}, or 0 (a checkpoint at every evaluation)."
                )
        if self.early_stopping_patience is not None and not evaluates:
            raise ConfigError(
                f"early_stopping_patience={self.early_stopping_patience} counts evaluations, and eval_strategy='no' "
                f"runs none: set --eval-strategy steps (or epoch)."
            )
        if self.early_stopping_threshold and self.early_stopping_patience is None:
            raise ConfigError(
                f"early_stopping_threshold={self.early_stopping_threshold} is read with early_stopping_patience "
                f"only; add --early-stopping-patience N or drop --early-stopping-threshold."
            )
        if self.eval_generate_samples and self.task != "sft":
            raise ConfigError(
                f"eval_generate_samples={self.eval_generate_samples} is SFT's (GRPO logs its evaluation completions "
                f"with --log-completions); drop --eval-generate-samples with task={self.task!r}."
            )
        if (evaluates or self.eval_on_start) and self.parallel.deepspeed_zero_stage:
            raise ConfigError(
                "evaluation during training is not wired under deepspeed_zero_stage=3; drop --eval-strategy / "
                "--eval-on-start, or train with FSDP2 (--fsdp) instead."
            )

    @property
    def reference_kl_beta(self) -> float:
        """The KL coefficient of an online task (GRPO's ``grpo_beta``, RLOO's ``rloo_beta``; 0 for the others):
        above 0 the reference model's log-probs are computed."""
        path = task_spec(self.task).kl_beta
        if path is None:
            return 0.0
        section, name = path.split(".")
        return float(getattr(getattr(self, section), name))

    @property
    def effective_eval_steps(self) -> int:
        """``eval_steps``, else ``logging_steps`` (HF's default)."""
        return self.eval_steps or self.logging_steps

    @property
    def effective_metric_for_best_model(self) -> str:
        """``metric_for_best_model`` with its ``eval_`` prefix; None: ``eval_loss`` (GRPO: ``eval_reward``)."""
        name = self.metric_for_best_model or ("reward" if self.task in ONLINE_TASKS else "loss")
        return name if name.startswith("eval_") else f"eval_{name}"

    @property
    def effective_greater_is_better(self) -> bool:
        """``greater_is_better``, else True unless the metric's name ends in ``loss`` (HF's rule)."""
        if self.greater_is_better is not None:
            return self.greater_is_better
        return not self.effective_metric_for_best_model.endswith("loss")

    @property
    def effective_learning_rate(self) -> float:
        """``optim.learning_rate``: the given one, or the task's default (``DEFAULT_LEARNING_RATES``; ``validate``
        stores it in the field)."""
        lr = self.optim.learning_rate
        return DEFAULT_LEARNING_RATES[(self.task, self.peft.use_peft)] if lr is None else lr

    @property
    def effective_warmup_steps(self) -> int:
        """``warmup_steps``, else ``warmup_ratio`` of ``max_steps`` (with ``max_steps=-1``, of the resolved config:
        ``common.run.schedule.with_resolved_max_steps``)."""
        if self.optim.warmup_steps:
            return self.optim.warmup_steps
        assert self.max_steps > 0, "max_steps=-1: resolve it from the data first (with_resolved_max_steps)"
        return int(self.optim.warmup_ratio * self.max_steps)

    # -- construction from flat (TRL-style) or nested values ----------------------------

    @classmethod
    def from_flat(cls, **values: Any) -> "TrainConfig":
        """Build from TRL-style flat keyword arguments (``max_length=64, packing=True``)."""
        return cls.from_dict(values, source="arguments")

    @classmethod
    def from_yaml(cls, path: str | Path, **overrides: Any) -> "TrainConfig":
        return cls.from_dict({**load_yaml(path), **overrides}, source=str(path))

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], *, source: str = "config") -> "TrainConfig":
        """From flat keys (``max_length``), section mappings (``data: {max_length: ...}``) or both."""
        top: dict[str, Any] = {}
        sections: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
        unknown = []
        for key, value in values.items():
            key = FIELD_ALIASES.get(key, key) if isinstance(key, str) else key
            if not isinstance(key, str):
                raise ConfigTypeError(
                    f"{source}: key {key!r} is not a field name; write `field: value` with a "
                    f"field listed by `twinseq train --help`."
                )
            if key in SECTIONS and not isinstance(value, Mapping):
                raise ConfigTypeError(
                    f"{source}: section {key!r} must be a mapping of its fields (e.g. {key}: "
                    f"{{{next(iter(_fields_of(key)))}: ...}}), not a {type(value).__name__}."
                )
            if key in SECTIONS:
                for sub_key, sub_value in value.items():
                    if not isinstance(sub_key, str):
                        raise ConfigTypeError(
                            f"{source}: key {key}.{sub_key!r} is not a field name; write "
                            f"`{key}: {{field: value}}` with fields of that section."
                        )
                    if _FLAT_INDEX.get(sub_key) != key:
                        unknown.append(f"{key}.{sub_key}")
                    sections[key][sub_key] = sub_value
            elif key in _FLAT_INDEX:
                target = _FLAT_INDEX[key]
                (top if target is None else sections[target])[key] = value
            else:
                unknown.append(key)
        if unknown:
            hints = [
                f"{u} (did you mean {m[0]!r}?)"
                if (m := difflib.get_close_matches(u.split(".")[-1], list(_FLAT_INDEX), n=1))
                else u
                for u in unknown
            ]
            raise ConfigError(
                f"{source}: unknown field(s) {', '.join(hints)}; the valid fields are listed by `twinseq train --help`."
            )
        built = {name: SECTIONS[name](**kw) for name, kw in sections.items()}
        return cls(**top, **built)

    def to_dict(self) -> dict:
        """Nested plain values (the form written into checkpoints; ``from_dict`` reads it back)."""
        return dataclasses.asdict(self)

    def to_flat_dict(self) -> dict:
        """Flat TRL-style values (the form of the YAML files and the CLI flags)."""
        flat = {k: v for k, v in self.to_dict().items() if k not in SECTIONS}
        for name in SECTIONS:
            flat.update(dataclasses.asdict(getattr(self, name)))
        return flat

    def replace(self, **flat: Any) -> "TrainConfig":
        """A copy with some fields changed, by their flat names (a task default is resolved again for the copy)."""
        unset = dict.fromkeys(self.task_defaults())
        return self.from_dict({**self.to_flat_dict(), **unset, **flat}, source="replace()")


_TASK_DEFAULT = "_twinseq_task_default"
"""The attribute (no field: never in ``to_dict`` or the CLI) where ``OptimConfig`` keeps a resolved task default."""


def _fields_of(section: str) -> list[str]:
    return [f.name for f in dataclasses.fields(SECTIONS[section])]


def _changed_fields(section: Any) -> list[str]:
    default = type(section)()
    return [f.name for f in dataclasses.fields(section) if getattr(section, f.name) != getattr(default, f.name)]


def _flat_index() -> dict[str, Optional[str]]:
    """Flat field name -> its section (None for TrainConfig's own fields); names are unique."""
    index: dict[str, Optional[str]] = {f.name: None for f in dataclasses.fields(TrainConfig) if f.name not in SECTIONS}
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            assert f.name not in index, f"config field {f.name!r} appears in two sections"
            index[f.name] = section
    return index


_FLAT_INDEX = _flat_index()
FIELD_ALIASES = {"vllm_sleep_enabled": "vllm_enable_sleep_mode", "model_name_or_path": "model_config"}
"""Other spellings accepted in YAML files, Python and on the command line (``--model-name-or-path`` is listed by
``twinseq train --help`` beside ``--model-config``): TRL's ``model_name_or_path`` (its ``ModelConfig``), and the TRL
guide's ``vllm_sleep_enabled``."""


def _accepting_flat_names(dataclass_init):
    """``TrainConfig(max_length=512, per_device_train_batch_size=2)``: TRL's flat names in the constructor, beside
    (or instead of) the sections; a name that is no field gets ``ConfigError`` with the closest field."""
    own = {f.name for f in dataclasses.fields(TrainConfig)}

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if args or own.issuperset(kwargs):
            dataclass_init(self, *args, **kwargs)
            return
        values = {
            k: dataclasses.asdict(v) if k in SECTIONS and dataclasses.is_dataclass(v) else v  # type: ignore[arg-type]
            for k, v in kwargs.items()
        }
        built = TrainConfig.from_dict(values, source="TrainConfig(...)")
        dataclass_init(self, **{name: getattr(built, name) for name in own})

    __init__.__doc__ = dataclass_init.__doc__
    return __init__


TrainConfig.__init__ = _accepting_flat_names(TrainConfig.__init__)  # type: ignore[method-assign]


def flag_names() -> list[str]:
    """Every ``twinseq train`` flag (``--max-length``, ...) and alias flag (``--model-name-or-path``), for
    suggestions."""
    return ["--" + name.replace("_", "-") for name in [*_FLAT_INDEX, *FIELD_ALIASES]]


def aliases_of(name: str) -> list[str]:
    """The other spellings of field ``name`` (``aliases_of("model_config") == ["model_name_or_path"]``)."""
    return [alias for alias, target in FIELD_ALIASES.items() if target == name]


def load_yaml(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist; pass an existing YAML file to --config.")
    try:
        with path.open() as f:
            values = yaml.safe_load(f) or {}
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ConfigError(f"{where}: YAML syntax error: {problem}; fix the file (key: value per line).") from None
    if not isinstance(values, dict):
        raise ConfigError(
            f"config file {str(path)!r} must hold a mapping of field: value, not a {type(values).__name__}."
        )
    return values
