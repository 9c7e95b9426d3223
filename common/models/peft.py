"""Parameter-efficient fine-tuning, backend-neutral: the LoRA/QLoRA/trainable-token rules both backends follow.

One ``PeftConfig`` (TRL's flag names: ``--use-peft --lora-r 16 --lora-alpha 32``) describes the adapters;
this module decides everything the two backends must agree on:

- **where** adapters go: ``lora_target_modules`` resolved against the family's linear layers
  (``all-linear``: every linear layer of every decoder layer, never ``lm_head``, as PEFT does), and
  ``lora_target_parameters`` on the fused expert tensors of MoE layers (PEFT's ``target_parameters``: per expert
  ``W[e] + scaling * B_e @ A_e``, ``lora_A`` ``[E * r, in]`` and ``lora_B`` ``[out, r * E]`` under PEFT's nested
  ``ParamWrapper`` names, ``expert_adapter_keys``);
- **what they start as**: ``init_adapters`` draws ``lora_A`` (Kaiming-uniform, PEFT's default) and
  ``lora_B`` (zeros, so the adapted model starts equal to its base) from one numpy generator, in PEFT's
  own key names, so the torch and JAX backends load the same numbers;
- **how they scale**: ``lora_scaling`` (``alpha / r``, or ``alpha / sqrt(r)`` with rsLoRA);
- **how they merge**: ``merge_adapters`` folds LoRA (and DoRA's magnitude) and trainable tokens into
  plain Hugging Face weights, for export;
- **how they are stored**: ``save_adapters``/``read_adapters`` write and read PEFT's own folder
  (``adapter_config.json`` + ``adapter_model.safetensors``), which ``peft.PeftModel.from_pretrained``
  loads, and which twinseq loads back from PEFT.

Key names are PEFT's saved names, e.g. ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``
(``[r, in_features]``), ``...lora_B.weight`` (``[out_features, r]``), ``...lora_magnitude_vector``
(``[out_features]``, DoRA) and ``base_model.model.model.embed_tokens.token_adapter.trainable_tokens_delta``
(``[len(trainable_token_indices), hidden_size]``: despite PEFT's name, the *new values* of the selected
embedding rows, which replace them; they start as a copy of the base rows).

>>> from twinseq.common.models.configs import ModelConfig
>>> cfg = ModelConfig.preset("tiny")
>>> peft = PeftConfig(use_peft=True, lora_r=4, lora_alpha=8, lora_target_modules=["q_proj", "v_proj"])
>>> sorted(lora_targets(cfg, peft))[:2]
['model.layers.0.self_attn.q_proj', 'model.layers.0.self_attn.v_proj']
>>> a = init_adapters(cfg, peft, seed=0)
>>> a[adapter_key("model.layers.0.self_attn.q_proj", "lora_A")].shape
(4, 96)
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional

import numpy as np

from twinseq.common.errors import CheckpointError, ConfigError
from twinseq.common.fields import _CHECKS_ON, _check_fields, _flag, knob
from twinseq.common.models.configs import ModelConfig, parameter_shapes

__all__ = [
    "PeftConfig",
    "ADAPTER_CONFIG_FILE",
    "ADAPTER_WEIGHTS_FILE",
    "LINEAR_MODULES",
    "EXPERT_PARAMETERS",
    "NF4_BLOCKSIZE",
    "NF4_EXPERTS_PER_CHUNK",
    "nf4_expert_tensors",
    "expert_targets",
    "expert_adapter_keys",
    "adapter_key",
    "check_peft_config",
    "check_token_indices",
    "init_adapters",
    "lora_scaling",
    "base_dtype",
    "lora_targets",
    "merge_adapters",
    "read_adapters",
    "save_adapters",
    "adapter_shapes",
    "trainable_parameter_count",
    "TOKENS_KEY",
]

ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
PREFIX = "base_model.model."
TOKENS_KEY = PREFIX + "model.embed_tokens.token_adapter.trainable_tokens_delta"
LINEAR_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The linear layers of one decoder layer, in every family twinseq builds (``lm_head`` is never adapted)."""
NF4_BLOCKSIZE = 64
"""QLoRA's NF4 block: one float32 ``absmax`` per 64 weights (bitsandbytes' default), so an NF4 weight costs 0.5 byte
per number plus 4 / 64 bytes of statistics (no double quantisation)."""
NF4_EXPERTS_PER_CHUNK = 8
"""How many experts of one NF4 expert tensor the torch kernel dequantises to float32 at a time (a chunk of whole
experts, used and dropped; the jax kernel dequantises one per scan step): the planner's NF4 experts workspace row."""
EXPERT_PARAMETERS = ("experts.gate_up_proj", "experts.down_proj")
"""The fused 3-D expert tensors of a mixture-of-experts layer (transformers 5's ``[E, out, in]``), in parameter order:
PEFT's ``target_parameters`` (``lora.ParamWrapper``), twinseq's ``lora_target_parameters``."""


@dataclass
class PeftConfig:
    """LoRA, DoRA, rsLoRA, QLoRA (a 4-bit NF4 base) and trainable tokens, with TRL's flag names."""

    use_peft: bool = False
    """Train LoRA adapters on a frozen base instead of every weight."""
    lora_r: int = knob(16, ge=1)
    lora_alpha: float = knob(32.0, gt=0)
    lora_dropout: float = knob(0.05, ge=0, lt=1)
    lora_target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    """Linear layer names (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj) or ``all-linear``."""
    use_rslora: bool = False
    """Rank-stabilised LoRA: scale by ``alpha / sqrt(r)`` instead of ``alpha / r``."""
    use_dora: bool = False
    """DoRA: a learned magnitude per output row on top of the LoRA direction."""
    load_in_4bit: bool = False
    """QLoRA: quantise the frozen base to 4-bit NF4 (torch: bitsandbytes; jax: qwix)."""
    trainable_token_indices: Optional[list[int]] = None
    """Token ids whose embedding rows (and tied lm_head rows) train, e.g. new special tokens."""
    lora_target_parameters: Optional[list[str]] = None
    """LoRA on the experts of MoE layers (PEFT's ``target_parameters``): ``experts.gate_up_proj`` and/or
    ``experts.down_proj``, a rank-``lora_r`` pair per expert; needs ``lora_dropout=0`` and no DoRA (with
    ``load_in_4bit`` the experts' base is NF4 too)."""

    def __post_init__(self) -> None:
        if _CHECKS_ON.get():
            _check_fields(self)

    @property
    def enabled(self) -> bool:
        return self.use_peft

    @property
    def scaling(self) -> float:
        return lora_scaling(self.lora_alpha, self.lora_r, self.use_rslora)


def base_dtype(peft: PeftConfig, compute_dtype: str) -> str:
    """The storage dtype of the frozen base of an adapter run, on both backends: the compute dtype (bfloat16 under
    ``--dtype bfloat16``, half the bytes of a float32 base, as a bf16 checkpoint under TRL + PEFT), with the adapters
    in float32. float32 without adapters (the master weights train) and with ``load_in_4bit`` (the NF4 layers compute
    in float32; their embeddings, norms and lm_head stay so too).

    >>> base_dtype(PeftConfig(use_peft=True), "bfloat16"), base_dtype(PeftConfig(), "bfloat16")
    ('bfloat16', 'float32')
    """
    return compute_dtype if peft.use_peft and not peft.load_in_4bit else "float32"


def lora_scaling(alpha: float, r: int, use_rslora: bool = False) -> float:
    """The factor on ``B @ A``: ``alpha / r`` (PEFT's default) or ``alpha / sqrt(r)`` (rsLoRA)."""
    return float(alpha) / (math.sqrt(r) if use_rslora else r)


def check_peft_config(peft: PeftConfig) -> None:
    """Rules that tie PEFT fields together (model-independent; ``lora_targets`` checks names per model)."""
    if not peft.use_peft:
        changed = [
            f.name
            for f in dataclasses.fields(peft)
            if f.name != "use_peft" and getattr(peft, f.name) != getattr(PeftConfig(), f.name)
        ]
        if changed:
            raise ConfigError(
                f"{', '.join(changed)} {'is' if len(changed) == 1 else 'are'} read only with "
                f"use_peft=True; add --use-peft or drop {' '.join(_flag(c) for c in changed)}."
            )
        return
    if not peft.lora_target_modules and not peft.lora_target_parameters:
        raise ConfigError(
            "lora_target_modules=[] adapts nothing; name linear layers (q_proj v_proj ...) or use "
            "--lora-target-modules all-linear (or name expert tensors with --lora-target-parameters)."
        )
    if peft.lora_target_parameters is not None:
        check_expert_parameters(peft)
    unknown = [m for m in peft.lora_target_modules if m != "all-linear" and m not in LINEAR_MODULES]
    if unknown:
        raise ConfigError(
            f"lora_target_modules={peft.lora_target_modules!r}: {', '.join(map(repr, unknown))} "
            f"{'is' if len(unknown) == 1 else 'are'} not a linear layer of the models twinseq "
            f"builds; choose from {', '.join(LINEAR_MODULES)} or 'all-linear' (lm_head and "
            f"embed_tokens are not LoRA targets: use --trainable-token-indices for new tokens)."
        )
    if peft.trainable_token_indices is not None:
        if not peft.trainable_token_indices:
            raise ConfigError("trainable_token_indices=[] trains no token; give token ids or drop the flag.")
        if len(set(peft.trainable_token_indices)) != len(peft.trainable_token_indices):
            raise ConfigError(
                f"trainable_token_indices={peft.trainable_token_indices!r} repeats a token id; give each id once."
            )


def check_expert_parameters(peft: PeftConfig) -> None:
    """``lora_target_parameters``: known expert tensors, each once, and only what PEFT's ``ParamWrapper`` can do (it
    adds ``scaling * B @ A`` to the whole expert weight, so it has no input to drop out and no DoRA). An NF4 base
    (``load_in_4bit``) is allowed: the backends add the same delta to each dequantised expert themselves."""
    targets = peft.lora_target_parameters or []
    unknown = [t for t in targets if t not in EXPERT_PARAMETERS]
    if not targets or unknown or len(set(targets)) != len(targets):
        raise ConfigError(
            f"lora_target_parameters={peft.lora_target_parameters!r}: name each of {', '.join(EXPERT_PARAMETERS)} "
            f"at most once (the fused expert tensors of qwen3_moe and mixtral), or drop --lora-target-parameters."
        )
    refused = (
        (
            "lora_dropout",
            peft.lora_dropout != 0,
            "pass --lora-dropout 0 (PEFT's ParamWrapper merges B @ A into the "
            "expert weight, so there is no LoRA input to drop out)",
        ),
        ("use_dora", peft.use_dora, "drop --use-dora (PEFT's ParamWrapper has no DoRA)"),
    )
    for name, bad, fix in refused:
        if bad:
            raise ConfigError(
                f"{name}={getattr(peft, name)!r} cannot combine with lora_target_parameters="
                f"{peft.lora_target_parameters!r} (LoRA on the experts): {fix}."
            )


def nf4_expert_tensors(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """``{name: shape}`` of the fused 3-D expert tensors QLoRA stores as NF4 (``gate_up_proj``, ``down_proj``; the
    biases of gpt_oss stay float), empty for a model without experts."""
    return {n: s for n, s in parameter_shapes(cfg).items() if len(s) == 3 and ".mlp.experts." in n}


def check_token_indices(cfg: ModelConfig, peft: PeftConfig) -> None:
    """Every trainable token id must be a row of the embedding (``0 <= id < vocab_size``)."""
    bad = [i for i in (peft.trainable_token_indices or []) if not 0 <= i < cfg.vocab_size]
    if bad:
        raise ConfigError(
            f"trainable_token_indices={peft.trainable_token_indices!r}: {bad} "
            f"{'is' if len(bad) == 1 else 'are'} outside the vocabulary [0, {cfg.vocab_size}) of "
            f"this {cfg.model_type} model; use ids the tokenizer gives (add the tokens to the "
            f"tokenizer and resize the model first)."
        )


def lora_targets(cfg: ModelConfig, peft: PeftConfig) -> dict[str, tuple[int, int]]:
    """``{module path: (in_features, out_features)}`` of every adapted linear layer, in parameter order."""
    check_peft_config(peft)
    names = set(LINEAR_MODULES) if "all-linear" in peft.lora_target_modules else set(peft.lora_target_modules)
    targets: dict[str, tuple[int, int]] = {}
    for name, shape in parameter_shapes(cfg).items():
        if not name.endswith(".weight") or len(shape) != 2:
            continue
        module = name[: -len(".weight")]
        if module.rsplit(".", 1)[-1] in names:
            out_features, in_features = shape
            targets[module] = (in_features, out_features)
    return targets


def expert_targets(cfg: ModelConfig, peft: PeftConfig) -> dict[str, tuple[int, int, int]]:
    """``{parameter path: (num_experts, in_features, out_features)}`` of every adapted expert tensor (PEFT's
    ``target_parameters``), in parameter order; ``ConfigError`` where the model has no experts."""
    check_peft_config(peft)
    names = set(peft.lora_target_parameters or [])
    if names and cfg.expert_biases:
        raise ConfigError(
            f"lora_target_parameters={peft.lora_target_parameters!r}: LoRA on the experts of model_type "
            f"{cfg.model_type!r} is not built (its expert tensors are input-major [E, in, out] with biases, not the "
            "[E, out, in] of qwen3_moe and mixtral that expert LoRA adapts); drop --lora-target-parameters (LoRA on "
            "the attention projections, lora_target_modules, works), or train qwen3_moe or mixtral."
        )
    targets: dict[str, tuple[int, int, int]] = {}
    for name, shape in parameter_shapes(cfg).items():
        if len(shape) == 3 and ".".join(name.split(".")[-2:]) in names:
            num_experts, out_features, in_features = shape
            targets[name] = (num_experts, in_features, out_features)
    if names and not targets:
        raise ConfigError(
            f"lora_target_parameters={peft.lora_target_parameters!r}: this {cfg.model_type} model has no expert "
            f"tensors (no mixture-of-experts layer); drop --lora-target-parameters, or train qwen3_moe or mixtral."
        )
    return targets


def expert_adapter_keys(cfg: ModelConfig, peft: PeftConfig) -> dict[str, str]:
    """``{expert parameter path: its adapter module path}``, PEFT's nesting: each targeted tensor of one experts
    module gets a ``ParamWrapper`` around the previous one, in parameter order, so all but the last sit one
    ``base_layer`` deeper per later wrapper (``...experts.base_layer.lora_A.weight`` for ``gate_up_proj`` when
    ``down_proj`` is a target too, ``...experts.lora_A.weight`` for the outermost)."""
    by_module: dict[str, list[str]] = {}
    for path in expert_targets(cfg, peft):
        by_module.setdefault(path.rpartition(".")[0], []).append(path)
    out: dict[str, str] = {}
    for module, paths in by_module.items():
        for i, path in enumerate(paths):
            out[path] = module + ".base_layer" * (len(paths) - 1 - i)
    return out


def expert_factors(adapters: Mapping[str, np.ndarray], module: str, num_experts: int) -> tuple[np.ndarray, np.ndarray]:
    """PEFT's per-expert factors of one ``ParamWrapper``: (A_ERI ``[E, r, in]``, B_EOR ``[E, out, r]``) from
    ``lora_A`` ``[E * r, in]`` (rows expert-major) and ``lora_B`` ``[out, r * E]`` (columns expert-minor), so that
    expert ``e``'s delta is ``scaling * B_EOR[e] @ A_ERI[e]`` (``ParamWrapper.get_delta_factors``)."""
    a = np.asarray(adapters[adapter_key(module, "lora_A")])
    b = np.asarray(adapters[adapter_key(module, "lora_B")])
    a_ERI = a.reshape(num_experts, -1, a.shape[-1])
    b_EOR = b.reshape(b.shape[0], -1, num_experts).transpose(2, 0, 1)
    return a_ERI, b_EOR


def adapter_key(module: str, part: str) -> str:
    """PEFT's saved key of one adapter tensor: ``part`` is ``lora_A``, ``lora_B`` or ``lora_magnitude_vector``."""
    suffix = "" if part == "lora_magnitude_vector" else ".weight"
    return f"{PREFIX}{module}.{part}{suffix}"


def adapter_shapes(cfg: ModelConfig, peft: PeftConfig) -> dict[str, tuple[int, ...]]:
    """``{PEFT key: shape}`` of every trainable adapter tensor (the keys ``init_adapters`` returns)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for module, (fan_in, fan_out) in lora_targets(cfg, peft).items():
        shapes[adapter_key(module, "lora_A")] = (peft.lora_r, fan_in)
        shapes[adapter_key(module, "lora_B")] = (fan_out, peft.lora_r)
        if peft.use_dora:
            shapes[adapter_key(module, "lora_magnitude_vector")] = (fan_out,)
    modules = expert_adapter_keys(cfg, peft)
    for path, (num_experts, fan_in, fan_out) in expert_targets(cfg, peft).items():
        shapes[adapter_key(modules[path], "lora_A")] = (num_experts * peft.lora_r, fan_in)
        shapes[adapter_key(modules[path], "lora_B")] = (fan_out, peft.lora_r * num_experts)
    if peft.trainable_token_indices:
        shapes[TOKENS_KEY] = (len(peft.trainable_token_indices), cfg.hidden_size)
    return shapes


def trainable_parameter_count(cfg: ModelConfig, peft: PeftConfig) -> int:
    """How many numbers train (what ``print_trainable_parameters`` of PEFT reports)."""
    return int(sum(int(np.prod(s)) for s in adapter_shapes(cfg, peft).values()))


def init_adapters(
    cfg: ModelConfig,
    peft: PeftConfig,
    seed: int = 0,
    base_weights: Optional[Mapping[str, np.ndarray]] = None,
    lora_b_std: float = 0.0,
) -> dict[str, np.ndarray]:
    """float32 adapter tensors in PEFT key names, drawn from one numpy generator (``seed``).

    - ``lora_A``: Kaiming-uniform with ``a = sqrt(5)``, i.e. U(-1/sqrt(in), 1/sqrt(in)), PEFT's default;
    - ``lora_B``: zeros (``lora_b_std`` > 0 draws N(0, std) instead: tests use it so that the adapted model
      differs from its base and every adapter gradient is non-zero);
    - DoRA's ``lora_magnitude_vector``: the row norms of ``W + scaling * B @ A`` (PEFT's start), which needs
      ``base_weights``;
    - trainable tokens: a copy of the selected embedding rows (PEFT stores the rows' values, not a delta),
      which needs ``base_weights``.
    """
    check_token_indices(cfg, peft)
    if (peft.use_dora or peft.trainable_token_indices) and base_weights is None:
        raise ConfigError(
            "use_dora=True and trainable_token_indices start from the base weights (row norms, "
            "embedding rows); pass base_weights (the HF-named weights the adapters go on)."
        )
    rng = np.random.default_rng(seed)
    out: dict[str, np.ndarray] = {}
    for module, (fan_in, fan_out) in lora_targets(cfg, peft).items():
        bound = 1.0 / math.sqrt(fan_in)
        a = rng.uniform(-bound, bound, size=(peft.lora_r, fan_in)).astype(np.float32)
        if lora_b_std > 0:
            b = (rng.standard_normal((fan_out, peft.lora_r)) * lora_b_std).astype(np.float32)
        else:
            b = np.zeros((fan_out, peft.lora_r), np.float32)
        out[adapter_key(module, "lora_A")] = a
        out[adapter_key(module, "lora_B")] = b
        if peft.use_dora:
            assert base_weights is not None  # init_adapters refuses DoRA without the base weights
            w = np.asarray(base_weights[module + ".weight"], np.float64)
            direction = w + peft.scaling * (b.astype(np.float64) @ a.astype(np.float64))
            out[adapter_key(module, "lora_magnitude_vector")] = np.linalg.norm(direction, axis=1).astype(np.float32)
    out.update(_init_expert_adapters(cfg, peft, rng, lora_b_std))
    if peft.trainable_token_indices:
        rows = np.asarray(peft.trainable_token_indices)
        assert base_weights is not None  # init_adapters refuses trainable tokens without the base weights
        out[TOKENS_KEY] = np.asarray(base_weights["model.embed_tokens.weight"], np.float32)[rows].copy()
    return out


def _init_expert_adapters(
    cfg: ModelConfig, peft: PeftConfig, rng: np.random.Generator, lora_b_std: float
) -> dict[str, np.ndarray]:
    """``init_adapters``' expert tensors, drawn after the linear layers': ``lora_A`` ``[E * r, in]`` Kaiming-uniform
    (PEFT's ``nn.Linear(in, r * E)``), ``lora_B`` ``[out, r * E]`` zeros (or N(0, ``lora_b_std``))."""
    out: dict[str, np.ndarray] = {}
    modules = expert_adapter_keys(cfg, peft)
    for path, (num_experts, fan_in, fan_out) in expert_targets(cfg, peft).items():
        bound = 1.0 / math.sqrt(fan_in)
        a = rng.uniform(-bound, bound, size=(num_experts * peft.lora_r, fan_in)).astype(np.float32)
        b_shape = (fan_out, peft.lora_r * num_experts)
        b = (rng.standard_normal(b_shape) * lora_b_std).astype(np.float32) if lora_b_std > 0 else np.zeros(b_shape)
        out[adapter_key(modules[path], "lora_A")] = a
        out[adapter_key(modules[path], "lora_B")] = b.astype(np.float32)
    return out


def check_adapters(cfg: ModelConfig, peft: PeftConfig, adapters: Mapping[str, np.ndarray], source: str) -> None:
    """``CheckpointError`` naming every missing, unexpected or mis-shaped adapter tensor."""
    expected = adapter_shapes(cfg, peft)
    missing = sorted(set(expected) - set(adapters))
    unexpected = sorted(set(adapters) - set(expected))
    wrong = [
        f"{k}: {tuple(np.shape(adapters[k]))} != {expected[k]}"
        for k in expected
        if k in adapters and tuple(np.shape(adapters[k])) != expected[k]
    ]
    problems = (
        ([f"missing {missing[:3]}"] if missing else [])
        + ([f"unexpected {unexpected[:3]}"] if unexpected else [])
        + (["wrong shape " + "; ".join(wrong[:3])] if wrong else [])
    )
    if problems:
        raise CheckpointError(
            f"{source}: the adapters do not match lora_r={peft.lora_r}, targets "
            f"{peft.lora_target_modules}, use_dora={peft.use_dora} on this {cfg.model_type} model: "
            + " | ".join(problems)
            + "; load them with the adapter_config.json they were saved with."
        )


def merge_adapters(
    cfg: ModelConfig, peft: PeftConfig, base_weights: Mapping[str, np.ndarray], adapters: Mapping[str, np.ndarray]
) -> dict[str, np.ndarray]:
    """Plain HF weights with the adapters folded in (float32; computed in float64):

    ``W' = W + s B A`` (LoRA; per expert ``W'[e] = W[e] + s B_e A_e`` on expert tensors, ``expert_factors``),
    ``W' = m * (W + s B A) / ||W + s B A||_row`` (DoRA), and the trainable-token
    rows written into the embedding (and so into a tied ``lm_head``; an untied head keeps its rows).
    """
    check_adapters(cfg, peft, adapters, "merge_adapters")
    merged = {k: np.asarray(v, np.float32).copy() for k, v in base_weights.items()}
    for module in lora_targets(cfg, peft):
        w = np.asarray(base_weights[module + ".weight"], np.float64)
        a = np.asarray(adapters[adapter_key(module, "lora_A")], np.float64)
        b = np.asarray(adapters[adapter_key(module, "lora_B")], np.float64)
        new = w + peft.scaling * (b @ a)
        if peft.use_dora:
            m = np.asarray(adapters[adapter_key(module, "lora_magnitude_vector")], np.float64)
            new = new * (m / np.linalg.norm(new, axis=1))[:, None]
        merged[module + ".weight"] = new.astype(np.float32)
    modules = expert_adapter_keys(cfg, peft)
    for path, (num_experts, _, _) in expert_targets(cfg, peft).items():
        a_ERI, b_EOR = expert_factors(adapters, modules[path], num_experts)
        delta_EOI = np.einsum("eor,eri->eoi", b_EOR.astype(np.float64), a_ERI.astype(np.float64))
        merged[path] = (np.asarray(base_weights[path], np.float64) + peft.scaling * delta_EOI).astype(np.float32)
    if peft.trainable_token_indices:
        emb = merged["model.embed_tokens.weight"]
        emb[np.asarray(peft.trainable_token_indices)] = np.asarray(adapters[TOKENS_KEY], np.float32)
    return merged


# ---------------------------------------------------------------------------------------
# PEFT's folder format
# ---------------------------------------------------------------------------------------


def adapter_config_json(peft: PeftConfig, base_model_name_or_path: Optional[str] = None) -> dict[str, Any]:
    """The ``adapter_config.json`` that ``peft.LoraConfig`` reads (only fields PEFT knows)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": peft.lora_r,
        "lora_alpha": peft.lora_alpha,
        "lora_dropout": peft.lora_dropout,
        "target_modules": (
            "all-linear" if "all-linear" in peft.lora_target_modules else sorted(peft.lora_target_modules)
        ),
        "use_rslora": peft.use_rslora,
        "use_dora": peft.use_dora,
        "bias": "none",
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "modules_to_save": None,
        "inference_mode": True,
        "trainable_token_indices": list(peft.trainable_token_indices) if peft.trainable_token_indices else None,
        "target_parameters": list(peft.lora_target_parameters) if peft.lora_target_parameters else None,
    }


def peft_config_from_json(values: Mapping[str, Any], source: str) -> PeftConfig:
    """A ``PeftConfig`` from PEFT's ``adapter_config.json``; what twinseq cannot reproduce is refused."""
    if values.get("peft_type") != "LORA":
        raise CheckpointError(
            f"{source}: peft_type={values.get('peft_type')!r}; twinseq loads LoRA adapters (peft_type 'LORA') only: "
            "train the adapters with LoRA."
        )
    for key, supported in (("bias", "none"), ("fan_in_fan_out", False)):
        if values.get(key, supported) != supported:
            raise CheckpointError(
                f"{source}: {key}={values[key]!r} is not supported; train the adapters with {key}={supported!r}."
            )
    if values.get("modules_to_save"):
        raise CheckpointError(
            f"{source}: modules_to_save={values['modules_to_save']!r} is not supported; twinseq "
            f"trains adapters and trainable tokens only: save the adapters without modules_to_save."
        )
    for key in ("alpha_pattern", "rank_pattern"):
        if values.get(key):
            raise CheckpointError(
                f"{source}: {key}={values[key]!r} (per-module ranks) is not supported; train the adapters with one "
                "lora_r and lora_alpha."
            )
    targets = values.get("target_modules") or []
    if isinstance(targets, str):
        if targets != "all-linear":
            raise CheckpointError(
                f"{source}: target_modules={targets!r} is a regular expression; write a "
                f"list of layer names or 'all-linear' there."
            )
        targets = ["all-linear"]
    # peft >= 0.1x saves "all-linear" (and any target it matched by suffix) as the full module paths it adapted,
    # e.g. "model.layers.0.self_attn.q_proj": read them as layer names; a folder that adapted only some layers
    # then fails check_adapters (missing tensors), as it should
    targets = list(dict.fromkeys(t.rsplit(".", 1)[-1] for t in sorted(targets)))
    tokens = values.get("trainable_token_indices")
    if isinstance(tokens, dict):
        if set(tokens) - {"embed_tokens"}:
            raise CheckpointError(
                f"{source}: trainable_token_indices for {sorted(tokens)}; twinseq adapts embed_tokens only: "
                "keep only its entry."
            )
        tokens = tokens.get("embed_tokens")
    parameters = values.get("target_parameters")
    if parameters is not None and not isinstance(parameters, list):
        raise CheckpointError(
            f"{source}: target_parameters={parameters!r} is not a list; write the expert tensors as a list "
            f"(e.g. ['experts.gate_up_proj', 'experts.down_proj'])."
        )
    # PEFT matches a target parameter by suffix: a full path (model.layers.0.mlp.experts.down_proj) names its tensor
    parameters = list(dict.fromkeys(".".join(str(p).split(".")[-2:]) for p in parameters or []))
    parameters.sort(key=lambda p: EXPERT_PARAMETERS.index(p) if p in EXPERT_PARAMETERS else len(EXPERT_PARAMETERS))
    return PeftConfig(
        use_peft=True,
        lora_r=int(values["r"]),
        lora_alpha=float(values["lora_alpha"]),
        lora_dropout=float(values.get("lora_dropout", 0.0)),
        lora_target_modules=list(targets),
        use_rslora=bool(values.get("use_rslora", False)),
        use_dora=bool(values.get("use_dora", False)),
        trainable_token_indices=list(tokens) if tokens else None,
        lora_target_parameters=parameters or None,
    )


def save_adapters(
    path: str | Path,
    cfg: ModelConfig,
    peft: PeftConfig,
    adapters: Mapping[str, np.ndarray],
    base_model_name_or_path: Optional[str] = None,
) -> Path:
    """Write PEFT's folder: ``adapter_config.json`` + ``adapter_model.safetensors`` (float32)."""
    from safetensors.numpy import save_file

    check_adapters(cfg, peft, adapters, str(path))
    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {k: np.ascontiguousarray(np.asarray(v, np.float32)) for k, v in adapters.items()}
    save_file(tensors, str(directory / ADAPTER_WEIGHTS_FILE), metadata={"format": "pt"})
    (directory / ADAPTER_CONFIG_FILE).write_text(
        json.dumps(adapter_config_json(peft, base_model_name_or_path), indent=2, sort_keys=True) + "\n"
    )
    return directory


def read_adapters(path: str | Path, cfg: Optional[ModelConfig] = None) -> tuple[PeftConfig, dict[str, np.ndarray]]:
    """Read a PEFT adapter folder -> (PeftConfig, float32 tensors by PEFT key); checked against ``cfg``."""
    from safetensors.numpy import load_file

    directory = Path(path)
    config_file, weights_file = directory / ADAPTER_CONFIG_FILE, directory / ADAPTER_WEIGHTS_FILE
    for file in (config_file, weights_file):
        if not file.is_file():
            raise CheckpointError(
                f"{directory}: {file.name} is missing; an adapter folder holds "
                f"{ADAPTER_CONFIG_FILE} and {ADAPTER_WEIGHTS_FILE}: copy the whole folder PEFT's save_pretrained wrote."
            )
    try:
        values = json.loads(config_file.read_text())
    except json.JSONDecodeError as err:
        raise CheckpointError(
            f"{config_file}: not valid JSON ({err.msg} at line {err.lineno}); fix the file, or save the adapters again."
        ) from None
    peft = peft_config_from_json(values, str(config_file))
    tensors = {k: np.asarray(v, np.float32) for k, v in load_file(str(weights_file)).items()}
    if cfg is not None:
        check_token_indices(cfg, peft)
        check_adapters(cfg, peft, tensors, str(directory))
    return peft, tensors
