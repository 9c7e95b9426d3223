"""One tree of configuration dataclasses, shared by both backends, the CLI and YAML files.

Field names follow TRL's ``SFTConfig``/``DPOConfig`` where TRL has the knob. The CLI and
YAML loading are generated from these dataclasses (``twinseq.common.cli`` uses tyro), never
written by hand. Every invalid value raises ``ValueError`` in ``__post_init__`` naming the
field, the value and the allowed values.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional

import yaml

BACKENDS = ("torch", "jax")
TASKS = ("sft", "dpo")
TRUNCATION_MODES = ("keep_start", "keep_end")
PACKING_STRATEGIES = ("bfd", "bfd_split", "wrapped")
LOSS_TYPES = ("nll", "chunked_nll", "fused_linear", "liger")
ATTN_IMPLEMENTATIONS = ("sdpa", "eager", "flex_attention", "varlen", "flash_attention_2", "flash_attention_3")
DTYPES = ("float32", "bfloat16")
PADDING_SIDES = ("right", "left")
LR_SCHEDULERS = ("constant", "linear", "cosine")
CONTEXT_PARALLEL_STRATEGIES = ("allgather", "ring")


def _check_choice(name: str, value: Any, allowed: tuple) -> None:
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not valid; choose one of {', '.join(map(repr, allowed))}.")


def _check_positive(name: str, value: Optional[float], *, allow_none: bool = False, allow_zero: bool = False) -> None:
    if value is None and allow_none:
        return
    ok = value is not None and (value >= 0 if allow_zero else value > 0)
    if not ok:
        bound = "non-negative" if allow_zero else "positive"
        hint = " or None" if allow_none else ""
        raise ValueError(f"{name}={value!r} is not valid; it must be {bound}{hint}.")


# ---------------------------------------------------------------------------------------
# Model architecture
# ---------------------------------------------------------------------------------------


@dataclass
class ModelConfig:
    """Architecture of a Llama-family causal LM, in Hugging Face ``LlamaConfig`` names.

    Both backends build exactly this architecture: RMSNorm with ``rms_norm_eps``, default
    (non-scaled) RoPE with ``rope_theta`` on the half-split layout of HF Llama, grouped-query
    attention, SwiGLU MLP, and tied or untied embeddings.
    """

    vocab_size: int = 8192
    hidden_size: int = 64
    intermediate_size: int = 176
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: Optional[int] = None
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = True
    initializer_range: float = 0.02
    bos_token_id: int = 1
    eos_token_id: int = 2
    pad_token_id: int = 0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "max_position_embeddings"):
            _check_positive(f"ModelConfig.{name}", getattr(self, name))
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(
                    f"ModelConfig.hidden_size={self.hidden_size} is not divisible by "
                    f"num_attention_heads={self.num_attention_heads}; set head_dim explicitly or "
                    f"change one of them.")
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"ModelConfig.num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads={self.num_key_value_heads} (grouped-query attention).")
        _check_positive("ModelConfig.rms_norm_eps", self.rms_norm_eps)
        _check_positive("ModelConfig.rope_theta", self.rope_theta)

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> "ModelConfig":
        """Named architecture presets: ``tiny`` (~1.0M params, tests) and ``small`` (~12.6M, demo)."""
        if name not in MODEL_PRESETS:
            raise ValueError(f"model preset {name!r} is unknown; choose one of {sorted(MODEL_PRESETS)} "
                             f"or pass a path to a local Hugging Face checkpoint.")
        return cls(**{**MODEL_PRESETS[name], **overrides})

    @classmethod
    def from_dict(cls, values: dict) -> "ModelConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in known})

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def num_parameters(self) -> int:
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q = self.num_attention_heads * self.head_dim
        kv = self.num_key_value_heads * self.head_dim
        per_layer = h * q * 2 + h * kv * 2 + 3 * h * i + 2 * h
        lm_head = 0 if self.tie_word_embeddings else v * h
        return v * h + self.num_hidden_layers * per_layer + h + lm_head


MODEL_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(vocab_size=8192, hidden_size=96, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2),
    "small": dict(vocab_size=8192, hidden_size=384, intermediate_size=1024, num_hidden_layers=6,
                  num_attention_heads=6, num_key_value_heads=2),
}


# ---------------------------------------------------------------------------------------
# Training run
# ---------------------------------------------------------------------------------------


@dataclass
class TrainConfig:
    """Everything one training run needs. ``twinseq train --help`` lists these as flags."""

    backend: Literal["torch", "jax"] = field(default_factory=lambda: os.environ.get("TWINSEQ_BACKEND", "torch"))  # type: ignore[assignment]
    """Which backend runs the job; ``TWINSEQ_BACKEND`` sets the default."""
    task: Literal["sft", "dpo"] = "sft"
    model_config: str = "tiny"
    """A preset name (tiny, small) or the path of a local Hugging Face checkpoint."""
    output_dir: str = "runs/latest"
    seed: int = 0
    max_steps: int = 100
    logging_steps: int = 1
    save_steps: int = 0
    """Write a resumable checkpoint every N optimizer steps (0: only at the end)."""
    resume_from_checkpoint: Optional[str] = None
    disable_tqdm: bool = False

    dataset_name: str = "embedded"
    """``embedded`` (built offline from the stdlib), a local JSONL/Parquet/CSV path, or a hub name."""
    dataset_split: str = "train"
    tokenizer_name_or_path: str = "embedded"
    max_length: Optional[int] = 512
    truncation_mode: Literal["keep_start", "keep_end"] = "keep_start"
    max_prompt_length: Optional[int] = 256
    max_completion_length: Optional[int] = None
    completion_only_loss: Optional[bool] = None
    """None: mask the prompt when the data has a completion mask."""
    assistant_only_loss: bool = False

    packing: bool = False
    packing_strategy: Literal["bfd", "bfd_split", "wrapped"] = "bfd"
    padding_free: bool = False
    pad_to_multiple_of: Optional[int] = None
    padding_side: Literal["right", "left"] = "right"
    per_device_train_batch_size: int = 8
    gradient_accumulation_steps: int = 1

    attn_implementation: Literal["sdpa", "eager", "flex_attention", "varlen", "flash_attention_2", "flash_attention_3"] = "sdpa"
    dtype: Literal["float32", "bfloat16"] = "float32"
    gradient_checkpointing: bool = False
    activation_offloading: bool = False
    torch_compile: bool = False

    loss_type: Literal["nll", "chunked_nll", "fused_linear", "liger"] = "nll"
    loss_chunk_size: int = 256
    use_liger_kernel: bool = False

    learning_rate: float = 1e-3
    lr_scheduler_type: Literal["constant", "linear", "cosine"] = "cosine"
    warmup_steps: int = 0
    warmup_ratio: float = 0.0
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    max_grad_norm: Optional[float] = 1.0

    beta: float = 0.1
    dpo_loss_type: list[str] = field(default_factory=lambda: ["sigmoid"])
    """TRL's DPO ``loss_type`` (one or several); ``loss_type`` here names the token-loss kernel."""
    loss_weights: Optional[list[float]] = None
    label_smoothing: float = 0.0
    precompute_ref_log_probs: bool = False
    """Compute reference log-probs once before training instead of keeping a frozen model copy."""

    ds3_gather_for_generation: bool = True
    vllm_sleep_enabled: bool = False

    # Parallelism (torch backend; twinseq.torch_backend.parallel). A multi-process launch
    # (torchrun, accelerate launch) always shards with FSDP2; ``fsdp=True`` also does it in one process.
    fsdp: bool = False
    context_parallel_size: int = 1
    """Ranks that split every sequence (context parallelism); must divide the world size."""
    context_parallel_strategy: Literal["allgather", "ring"] = "allgather"
    """``allgather``: packed/padding-free safe, CPU or GPU. ``ring``: torch's ring attention, CUDA, unpacked only."""

    def __post_init__(self) -> None:
        _check_choice("backend", self.backend, BACKENDS)
        _check_choice("task", self.task, TASKS)
        _check_choice("truncation_mode", self.truncation_mode, TRUNCATION_MODES)
        _check_choice("packing_strategy", self.packing_strategy, PACKING_STRATEGIES)
        _check_choice("padding_side", self.padding_side, PADDING_SIDES)
        _check_choice("attn_implementation", self.attn_implementation, ATTN_IMPLEMENTATIONS)
        _check_choice("dtype", self.dtype, DTYPES)
        _check_choice("loss_type", self.loss_type, LOSS_TYPES)
        _check_choice("lr_scheduler_type", self.lr_scheduler_type, LR_SCHEDULERS)
        _check_positive("per_device_train_batch_size", self.per_device_train_batch_size)
        _check_positive("gradient_accumulation_steps", self.gradient_accumulation_steps)
        _check_positive("max_steps", self.max_steps)
        _check_positive("logging_steps", self.logging_steps)
        _check_positive("save_steps", self.save_steps, allow_zero=True)
        _check_positive("max_length", self.max_length, allow_none=True)
        _check_positive("max_prompt_length", self.max_prompt_length, allow_none=True)
        _check_positive("max_completion_length", self.max_completion_length, allow_none=True)
        _check_positive("pad_to_multiple_of", self.pad_to_multiple_of, allow_none=True)
        _check_positive("loss_chunk_size", self.loss_chunk_size)
        _check_positive("learning_rate", self.learning_rate, allow_zero=True)
        _check_positive("warmup_steps", self.warmup_steps, allow_zero=True)
        _check_positive("max_grad_norm", self.max_grad_norm, allow_none=True)
        _check_positive("beta", self.beta)
        if isinstance(self.context_parallel_size, bool) or not isinstance(self.context_parallel_size, int) \
                or self.context_parallel_size < 1:
            raise ValueError(f"context_parallel_size={self.context_parallel_size!r} is not valid; it must be an "
                             f"integer >= 1 (1 = no context parallelism).")
        _check_choice("context_parallel_strategy", self.context_parallel_strategy, CONTEXT_PARALLEL_STRATEGIES)
        if not 0.0 <= self.warmup_ratio < 1.0:
            raise ValueError(f"warmup_ratio={self.warmup_ratio!r} is not valid; it must be in [0, 1).")
        if self.packing and self.max_length is None:
            raise ValueError("packing=True needs max_length (the packed row length); set --max-length.")
        if self.task == "dpo":
            from twinseq.common.dpo import validate_dpo_config

            validate_dpo_config(loss_type=list(self.dpo_loss_type), loss_weights=self.loss_weights,
                                beta=self.beta, label_smoothing=self.label_smoothing)
        if self.use_liger_kernel and self.loss_type == "nll":
            # TRL's use_liger_kernel switches the loss to Liger's fused linear cross-entropy.
            self.loss_type = "liger"

    @property
    def effective_warmup_steps(self) -> int:
        return self.warmup_steps or int(self.warmup_ratio * self.max_steps)

    @classmethod
    def from_yaml(cls, path: str | Path, **overrides: Any) -> "TrainConfig":
        return cls.from_dict({**load_yaml(path), **overrides}, source=str(path))

    @classmethod
    def from_dict(cls, values: dict, *, source: str = "config") -> "TrainConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"{source}: unknown field(s) {unknown}; valid fields are listed by "
                             f"`twinseq train --help`.")
        return cls(**values)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def load_yaml(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"config file {str(path)!r} does not exist; pass an existing YAML file to --config.")
    with path.open() as f:
        values = yaml.safe_load(f) or {}
    if not isinstance(values, dict):
        raise ValueError(f"config file {str(path)!r} must hold a mapping of field: value, "
                         f"not a {type(values).__name__}.")
    return values


def resolve_model_config(name_or_path: str) -> ModelConfig:
    """A preset name, or a directory holding a Hugging Face ``config.json``."""
    if name_or_path in MODEL_PRESETS:
        return ModelConfig.preset(name_or_path)
    config_json = Path(name_or_path) / "config.json"
    if config_json.is_file():
        import json

        values = json.loads(config_json.read_text())
        # transformers 5 keeps rope_theta inside rope_parameters.
        rope = values.get("rope_parameters") or {}
        if "rope_theta" not in values and "rope_theta" in rope:
            values["rope_theta"] = rope["rope_theta"]
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"{config_json}: rope_type={rope['rope_type']!r} is not supported; twinseq "
                             f"builds default (unscaled) RoPE only.")
        return ModelConfig.from_dict(values)
    raise ValueError(f"model_config={name_or_path!r} is neither a preset ({sorted(MODEL_PRESETS)}) nor a "
                     f"directory with a config.json; pass a preset name or a local checkpoint path.")
