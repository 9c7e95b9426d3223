"""GRPO (group relative policy optimisation): the config section, the rules and the numpy reference.

Online RL in TRL 1.16's shape. For every prompt the policy samples ``num_generations``
completions (a *group*); reward functions score them; each completion's advantage is its
reward relative to its group:

    A_i = (r_i - mean_group(r)) / (std(r) + 1e-4)

with ``std`` the group's (``scale_rewards='group'``), the whole batch's (``'batch'``) or 1
(``'none'``, Dr. GRPO's choice); ``std`` is the unbiased estimate, as ``torch.std`` in TRL.
The policy then takes ``num_iterations`` optimizer steps on that batch with the clipped surrogate:
``common.objectives.grpo_loss``, the loss family GRPO and RLOO share, in numpy. Everything here is float64
numpy: the reference the backends are tested against.
"""

from __future__ import annotations

import inspect
import logging
import typing
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Mapping, Optional, Sequence

import numpy as np

from twinseq.common.data.batching import collate
from twinseq.common.data.preference_batching import _target_doc_ids
from twinseq.common.data.prefix_sharing import SharedGroup, collate_shared, group_consecutive
from twinseq.common.errors import ConfigError, ConfigTypeError, DataError
from twinseq.common.fields import _CHECKS_ON, _check_fields, knob
from twinseq.common.tasks import TaskSpec, register_task

logger = logging.getLogger(__name__)

GRPOLossType = Literal["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"]
ImportanceSamplingLevel = Literal["token", "sequence"]
MultiObjectiveAggregation = Literal["sum_then_normalize", "normalize_then_sum"]
ScaleRewards = Literal["group", "batch", "none"]
VLLMMode = Literal["colocate", "server"]
VLLMISMode = Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]
GRPO_LOSS_TYPES = typing.get_args(GRPOLossType)
IMPORTANCE_SAMPLING_LEVELS = typing.get_args(ImportanceSamplingLevel)
SCALE_REWARDS = typing.get_args(ScaleRewards)
STD_EPS = 1e-4
"""Added to the reward std before dividing (TRL's constant), so a constant group gives 0, not NaN."""

RewardFunc = Callable[..., Sequence[Optional[float]]]
"""``f(prompts, completions, **columns) -> [float | None] * len(completions)`` (TRL's signature)."""


@dataclass
class GRPOConfig:
    """Group relative policy optimisation (read with ``task=grpo`` only). TRL 1.16 names, except
    ``grpo_loss_type`` and ``grpo_beta`` (``loss_type`` is the token-loss kernel, ``beta`` is DPO's)."""

    num_generations: int = knob(8, ge=1)
    """Completions sampled per prompt (a group); at least 2, since advantages compare within a group."""
    temperature: float = knob(1.0, gt=0)
    top_p: float = knob(1.0, gt=0, le=1)
    top_k: int = knob(0, ge=0)
    """Sample among the k most likely tokens only; 0 disables (TRL's 0/None)."""
    grpo_beta: float = knob(0.0, ge=0)
    """KL coefficient (TRL's GRPO ``beta``). 0: no reference model is loaded or run."""
    use_bias_correction_kl: bool = True
    """Multiply the k3 KL by the importance ratio (TRL 1.16's default, DeepSeek-V3.2): the KL gradient is then the
    unbiased reverse-KL gradient. It changes the gradient whenever ``grpo_beta > 0``, on-policy too (the ratio is 1
    but differentiable). False: the uncorrected k3 term of the original GRPO."""
    epsilon: float = knob(0.2, gt=0, lt=1)
    """Lower clip of the importance ratio: ρ >= 1 - epsilon."""
    epsilon_high: Optional[float] = knob(None, gt=0)
    """Upper clip: ρ <= 1 + epsilon_high (None: epsilon; DAPO's clip-higher uses e.g. 0.28). With
    ``grpo_loss_type='cispo'`` the cap of the detached ratio itself (ScaleRL's ε_max, e.g. 5.0)."""
    delta: Optional[float] = knob(None, gt=1)
    """Two-sided clipping (INTELLECT-2): the unclipped ratio is capped at delta too (None: off; above 1 + ε)."""
    importance_sampling_level: ImportanceSamplingLevel = "token"
    """``sequence``: one ratio per completion, exp of its mean token log-ratio (GSPO; pair it with ``grpo``)."""
    sapo_temperature_pos: float = knob(1.0, gt=0)
    """``sapo``: the sigmoid's temperature for tokens with a positive advantage."""
    sapo_temperature_neg: float = knob(1.05, gt=0)
    """``sapo``: the temperature for the others."""
    top_entropy_quantile: float = knob(1.0, gt=0, le=1)
    """Train on the highest-entropy tokens only: the policy loss keeps the tokens at or above the ``1 - q``
    quantile of the micro-batch's completion-token entropies (1.0: every token; the paper's 0.2)."""
    entropy_coef: float = 0.0
    """Entropy bonus (TRL 1.16's): the loss subtracts ``entropy_coef`` times the mean entropy of the completion tokens
    (the ``top_entropy_quantile`` tokens when below 1): a plain token mean of each micro-batch for every loss type,
    divided only for gradient accumulation. Positive: keep exploring. 0: off (no entropy gradient is computed). With
    ``use_adaptive_entropy`` it is the starting coefficient."""
    use_adaptive_entropy: bool = False
    """Adaptive entropy control (Skywork-OR1, TRL's): after every optimizer step the coefficient moves by
    ``entropy_coef_delta``, up when the step's mean entropy (over every rank's bonus tokens) is at or below
    ``entropy_target``, down otherwise, within ``[entropy_coef_min, entropy_coef_max]``; a step applies the bonus
    only when the previous step's entropy was at or below the target (the first step applies none)."""
    entropy_coef_min: float = knob(0.0, ge=0)
    """Adaptive control: the coefficient's floor."""
    entropy_coef_max: float = knob(1.0, ge=0)
    """Adaptive control: the coefficient's ceiling."""
    entropy_coef_delta: float = knob(0.005, ge=0)
    """Adaptive control: the coefficient's change per optimizer step."""
    entropy_target: float = knob(0.2, ge=0)
    """Adaptive control: the mean token entropy (nats) at or below which the bonus applies and grows."""
    off_policy_mask_threshold: Optional[float] = knob(None, ge=0)
    """Off-policy sequence masking (DeepSeek-V3.2): a completion with a negative advantage whose mean token
    ``log π_old - log π`` exceeds this gets no policy loss (None: off)."""
    vespo_k_pos: float = knob(2.0, ge=0)
    """``vespo``: the power k of the gamma weight φ(w) = e^λ w^k e^(-λw) for a non-negative advantage."""
    vespo_lambda_pos: float = knob(3.0, ge=0)
    """``vespo``: its decay λ for a non-negative advantage."""
    vespo_k_neg: float = knob(3.0, ge=0)
    """``vespo``: k for a negative advantage."""
    vespo_lambda_neg: float = knob(2.0, ge=0)
    """``vespo``: λ for a negative advantage."""
    num_iterations: int = knob(1, ge=1)
    """Optimizer steps per generated batch (μ); above 1 the sampling policy's log-probs are kept."""
    steps_per_generation: Optional[int] = knob(None, ge=1)
    """Micro-batches of ``per_device_train_batch_size`` completions (per rank) that one generation fills (TRL's name;
    None: ``gradient_accumulation_steps``, one generation per optimizer step). A multiple k of
    ``gradient_accumulation_steps``: one generation, its advantages taken over all of it, feeds k optimizer steps
    (times ``num_iterations``), and the sampling policy's log-probs are kept. Exclusive with
    ``generation_batch_size``."""
    generation_batch_size: Optional[int] = knob(None, ge=1)
    """Completions per generation over every rank (TRL's name): ``per_device_train_batch_size x ranks x
    steps_per_generation``, the other way to set it (None: from ``steps_per_generation``)."""
    scale_rewards: ScaleRewards = "group"
    multi_objective_aggregation: MultiObjectiveAggregation = "sum_then_normalize"
    """How several reward functions make one advantage (TRL's names): ``sum_then_normalize`` weighs and sums the
    rewards, then normalises within the group (``scale_rewards``); ``normalize_then_sum`` normalises each function's
    rewards within the group first, weighs and sums them, then normalises the sums over the batch (GDPO; it reads
    no ``scale_rewards``)."""
    grpo_loss_type: GRPOLossType = "dapo"
    reward_funcs: list[str] = field(default_factory=lambda: ["exact_match", "format"])
    """Names of built-in reward functions (``common.data.prompts.REWARD_FUNCTIONS``); the Python API also takes
    callables ``f(prompts, completions, **columns)``."""
    reward_weights: Optional[list[float]] = None
    """One weight per reward function (None: all 1.0); the reward is the weighted sum."""
    mask_truncated_completions: bool = False
    """Completions cut by max_completion_length (no EOS) get no loss."""
    generation_greedy: bool = False
    """Decode greedily instead of sampling (evaluation, tests); a group is then num_generations copies."""
    log_completions: bool = False
    """Write the completions (TRL's name): every generation's prompts, completions, rewards and advantages to
    ``<output_dir>/completions.jsonl``, and at each evaluation the held-out prompts' greedy completions with their
    rewards to ``<output_dir>/samples/step_N.jsonl`` and ``.md``."""
    ds3_gather_for_generation: bool = True
    """Under ZeRO-3, gather the full weights for generation (False: generate sharded, slow; HF only)."""
    use_vllm: bool = False
    vllm_mode: VLLMMode = "colocate"
    vllm_enable_sleep_mode: bool = False
    """Offload vLLM's weights and KV cache while training (TRL's name; the guide's ``vllm_sleep_enabled``)."""
    vllm_sleep_level: int = knob(1, ge=1, le=2)
    """1: offload weights to CPU and drop the KV cache; 2: drop both (reloaded each generation)."""
    vllm_gpu_memory_utilization: float = knob(0.3, gt=0, le=1)
    vllm_importance_sampling_correction: bool = True
    """With vLLM: weigh each token's loss by the ratio of the trainer's log-prob to the engine's (TRL's default on;
    ``common.objectives.grpo_loss.vllm_importance_ratio``)."""
    vllm_importance_sampling_mode: VLLMISMode = "sequence_mask"
    """Per token or per completion (the summed log-ratio); ``*_truncate`` clips the ratio to the bounds, ``*_mask``
    zeroes it outside them."""
    vllm_importance_sampling_clip_max: Optional[float] = knob(3.0, gt=0)
    """C_max (None: no upper bound)."""
    vllm_importance_sampling_clip_min: Optional[float] = knob(None, ge=0)
    """C_min (None: no lower bound)."""

    def __post_init__(self) -> None:
        if _CHECKS_ON.get():
            _check_fields(self)


# ---------------------------------------------------------------------------------------
# Config rules
# ---------------------------------------------------------------------------------------

VLLM_IS_FIELDS = (
    "vllm_importance_sampling_correction",
    "vllm_importance_sampling_mode",
    "vllm_importance_sampling_clip_max",
    "vllm_importance_sampling_clip_min",
)


def _check_vllm_importance_sampling(grpo: GRPOConfig) -> None:
    changed = [f for f in VLLM_IS_FIELDS if getattr(grpo, f) != getattr(GRPOConfig, f, None)]
    if changed and not grpo.use_vllm:
        raise ConfigError(
            f"{', '.join(f'{f}={getattr(grpo, f)!r}' for f in changed)} corrects vLLM's sampling, and use_vllm=False "
            f"(generation by the trained model itself needs no correction); add --use-vllm or drop "
            f"{' '.join('--' + f.replace('_', '-') for f in changed)}."
        )
    lo, hi = grpo.vllm_importance_sampling_clip_min, grpo.vllm_importance_sampling_clip_max
    if lo is not None and hi is not None and lo > hi:
        raise ConfigError(
            f"vllm_importance_sampling_clip_min={lo} is above vllm_importance_sampling_clip_max={hi}; give min <= max."
        )
    mode = grpo.vllm_importance_sampling_mode
    if grpo.use_vllm and grpo.vllm_importance_sampling_correction and grpo.grpo_loss_type == "vespo":
        if mode not in ("token_truncate", "token_mask"):
            raise ConfigError(
                f"grpo_loss_type='vespo' reads per-token importance ratios, and vllm_importance_sampling_mode="
                f"{mode!r} is per completion (TRL's rule); use --vllm-importance-sampling-mode token_truncate or "
                f"token_mask."
            )


def check_grpo_config(grpo: GRPOConfig, *, per_device_train_batch_size: int, gradient_accumulation_steps: int) -> None:
    """The rules that tie GRPO's knobs together; raises ``ConfigError`` naming the fields and the fix.

    The generation batch of one optimizer step is ``per_device_train_batch_size *
    gradient_accumulation_steps`` completions (TRL counts completions, not prompts); it must
    hold whole groups.
    """
    g = grpo.num_generations
    if g < 2:
        raise ConfigError(
            f"num_generations={g} is not valid: GRPO's advantage compares a completion with the "
            f"others of its group, so a group needs at least 2 completions: pass --num-generations 2 "
            f"or more (TRL's default is 8)."
        )
    _check_entropy_bonus(grpo)
    if grpo.generation_batch_size is None or grpo.steps_per_generation is not None:
        generation_steps(grpo, per_device_train_batch_size, gradient_accumulation_steps)
    elif grpo.generation_batch_size % per_device_train_batch_size:  # on any number of ranks
        raise ConfigError(
            f"generation_batch_size={grpo.generation_batch_size} is not divisible by per_device_train_batch_size="
            f"{per_device_train_batch_size} (x ranks); make it a multiple of per_device_train_batch_size x ranks."
        )
    # else generation_batch_size counts every rank's completions: the builders resolve it once the ranks are known
    if grpo.use_vllm and grpo.vllm_mode != "colocate":
        raise ConfigError(
            f"vllm_mode={grpo.vllm_mode!r} is not supported: twinseq runs vLLM in colocate mode (the "
            f"training process owns the engine); use --vllm-mode colocate, or TRL's `trl vllm-serve` "
            f"setup for a separate server."
        )
    if grpo.use_vllm and not grpo.ds3_gather_for_generation:
        raise ConfigError(
            "ds3_gather_for_generation=False cannot be used with use_vllm=True: vLLM needs the full "
            "weights to be pushed to its engine; drop --no-ds3-gather-for-generation or --use-vllm."
        )
    if grpo.vllm_enable_sleep_mode and not grpo.use_vllm:
        raise ConfigError(
            "vllm_enable_sleep_mode=True (vllm_sleep_enabled) puts a vLLM engine to sleep, but "
            "use_vllm=False: there is none; add --use-vllm or drop --vllm-enable-sleep-mode."
        )
    _check_vllm_importance_sampling(grpo)
    if grpo.vllm_sleep_level not in (1, 2):
        raise ConfigError(
            f"vllm_sleep_level={grpo.vllm_sleep_level!r} is not valid; choose 1 (weights to CPU, "
            f"KV cache dropped) or 2 (both dropped) (--vllm-sleep-level)."
        )
    if grpo.reward_weights is not None and len(grpo.reward_weights) != len(grpo.reward_funcs):
        raise ConfigError(
            f"reward_weights={grpo.reward_weights!r} has {len(grpo.reward_weights)} entries but "
            f"reward_funcs={grpo.reward_funcs!r} has {len(grpo.reward_funcs)}; give one weight per "
            f"reward function, or none (all 1.0)."
        )
    if not grpo.reward_funcs:
        raise ConfigError(
            "reward_funcs=[] is not valid: GRPO needs at least one reward function; pass e.g. "
            "--reward-funcs exact_match format."
        )


ENTROPY_CONTROL_FIELDS = ("entropy_coef_min", "entropy_coef_max", "entropy_coef_delta", "entropy_target")


def _check_entropy_bonus(grpo: GRPOConfig) -> None:
    changed = [f for f in ENTROPY_CONTROL_FIELDS if getattr(grpo, f) != getattr(GRPOConfig, f)]
    if changed and not grpo.use_adaptive_entropy:
        raise ConfigError(
            f"{', '.join(f'{f}={getattr(grpo, f)!r}' for f in changed)} steer the adaptive entropy coefficient, and "
            f"use_adaptive_entropy=False (the coefficient stays entropy_coef={grpo.entropy_coef}); add "
            f"--use-adaptive-entropy or drop {' '.join('--' + f.replace('_', '-') for f in changed)}."
        )
    if grpo.use_adaptive_entropy and grpo.entropy_coef_min > grpo.entropy_coef_max:
        raise ConfigError(
            f"entropy_coef_min={grpo.entropy_coef_min} is above entropy_coef_max={grpo.entropy_coef_max}; give "
            f"min <= max."
        )


def generation_steps(
    grpo: GRPOConfig, per_device_train_batch_size: int, gradient_accumulation_steps: int, world: int = 1
) -> int:
    """``steps_per_generation`` resolved (TRL's rule): the micro-batches per rank one generation fills, from
    ``steps_per_generation``, or ``generation_batch_size / (per_device_train_batch_size x world)``, or
    ``gradient_accumulation_steps``; a multiple of ``gradient_accumulation_steps`` (twinseq generates at optimizer
    step boundaries). Raises ``ConfigError`` naming the fields and the fix.

    >>> generation_steps(GRPOConfig(generation_batch_size=32), 4, 2, world=2)
    4
    """
    steps, size, ga = grpo.steps_per_generation, grpo.generation_batch_size, gradient_accumulation_steps
    if steps is not None and size is not None:
        raise ConfigError(
            f"steps_per_generation={steps} and generation_batch_size={size} are two ways to set one thing (TRL "
            f"refuses both too); drop one of --steps-per-generation / --generation-batch-size."
        )
    if size is not None:
        global_batch = per_device_train_batch_size * world
        if size % global_batch:
            raise ConfigError(
                f"generation_batch_size={size} is not divisible by per_device_train_batch_size x ranks = "
                f"{per_device_train_batch_size} x {world} = {global_batch}; make it a multiple of {global_batch}."
            )
        steps = size // global_batch
    if steps is None:
        steps = ga
        if per_device_train_batch_size * ga % grpo.num_generations:
            raise ConfigError(
                f"the generation batch per_device_train_batch_size x gradient_accumulation_steps = "
                f"{per_device_train_batch_size} x {ga} = {per_device_train_batch_size * ga} "
                f"completions is not divisible by num_generations={grpo.num_generations}: every prompt needs its "
                f"whole group in one step; make it a multiple of {grpo.num_generations} (e.g. "
                f"--per-device-train-batch-size {grpo.num_generations})."
            )
    if per_device_train_batch_size * steps % grpo.num_generations:
        raise ConfigError(
            f"the generation batch per_device_train_batch_size x steps_per_generation = {per_device_train_batch_size} "
            f"x {steps} = {per_device_train_batch_size * steps} completions is not divisible by num_generations="
            f"{grpo.num_generations}: every prompt needs its whole group in one generation; make it a multiple of "
            f"{grpo.num_generations}."
        )
    if steps % ga:
        what = f"steps_per_generation={steps}" + ("" if size is None else f" (generation_batch_size={size})")
        raise ConfigError(
            f"{what} is not a multiple of gradient_accumulation_steps={ga}: twinseq generates at optimizer-step "
            f"boundaries, so one generation must fill whole steps; use a multiple of {ga} (e.g. "
            f"--steps-per-generation {ga * max(steps // ga, 1)})."
        )
    return steps


DEFAULT_MAX_COMPLETION_LENGTH = 512
"""Tokens generated per completion when ``max_completion_length`` is unset (TRL 1.16's GRPOConfig default), on
both backends."""


LIGER_GRPO_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
"""The loss types twinseq runs through Liger's fused GRPO loss (the others are not checked against it on a GPU)."""


def check_liger_grpo_config(grpo: GRPOConfig) -> None:
    """Liger's fused GRPO loss (``loss_type='liger'``) runs the min-clip loss types with token-level ratios only."""
    if grpo.grpo_loss_type not in LIGER_GRPO_LOSS_TYPES:
        raise ConfigError(
            f"grpo_loss_type={grpo.grpo_loss_type!r} does not run with use_liger_kernel=True (loss_type='liger'), "
            f"which twinseq runs for {LIGER_GRPO_LOSS_TYPES}; use --loss-type fused_linear, which runs every loss type."
        )
    if grpo.entropy_coef != 0.0 or grpo.use_adaptive_entropy:
        raise ConfigError(
            f"entropy_coef={grpo.entropy_coef}, use_adaptive_entropy={grpo.use_adaptive_entropy}: Liger's fused GRPO "
            f"loss (use_liger_kernel=True, loss_type='liger') has no entropy bonus; use --loss-type fused_linear, "
            f"which differentiates the entropy chunk by chunk, or drop --entropy-coef/--use-adaptive-entropy."
        )
    if grpo.importance_sampling_level != "token" or grpo.delta is not None:
        raise ConfigError(
            f"importance_sampling_level={grpo.importance_sampling_level!r}, delta={grpo.delta} do not run with "
            f"use_liger_kernel=True (loss_type='liger'), which twinseq runs with token-level ratios and no delta; "
            f"use --loss-type fused_linear, or drop --importance-sampling-level/--delta."
        )


def completion_budget(max_completion_length: Optional[int]) -> int:
    """``max_completion_length``, or TRL's default (``DEFAULT_MAX_COMPLETION_LENGTH``) when unset (logged: the data
    section's None means "no truncation" for SFT/DPO, but generation needs a bound)."""
    if max_completion_length is None:
        logger.info(
            "max_completion_length is unset: GRPO generates up to %d tokens (TRL's default); set "
            "--max-completion-length to change it",
            DEFAULT_MAX_COMPLETION_LENGTH,
        )
        return DEFAULT_MAX_COMPLETION_LENGTH
    return max_completion_length


def epsilon_bounds(grpo: GRPOConfig) -> tuple[float, float]:
    """(ε_low, ε_high) of the ratio clip."""
    return grpo.epsilon, grpo.epsilon if grpo.epsilon_high is None else grpo.epsilon_high


# ---------------------------------------------------------------------------------------
# Rewards and advantages
# ---------------------------------------------------------------------------------------


def reward_func_name(func: Any) -> str:
    """The name metrics use: a built-in's registered name (``reward_name``), else the function's."""
    return getattr(func, "reward_name", None) or getattr(func, "__name__", None) or type(func).__name__


def _call_reward_func(
    func: RewardFunc, prompts: Sequence[Any], completions: Sequence[Any], columns: Mapping[str, Sequence[Any]]
) -> np.ndarray:
    name = reward_func_name(func)
    try:
        out = func(prompts=list(prompts), completions=list(completions), **columns)
    except Exception as err:  # a user's function: report which one failed, and why
        raise DataError(
            f"reward function {name!r} raised {type(err).__name__}: {err}; it is called as "
            f"{name}(prompts=..., completions=..., **columns) with columns {sorted(columns)} and "
            f"must return one float (or None) per completion: fix the function."
        ) from err
    if isinstance(out, (str, bytes)) or not hasattr(out, "__len__"):
        raise DataError(
            f"reward function {name!r} returned {type(out).__name__}, not a list of "
            f"{len(completions)} floats: return one float per completion (None to abstain)."
        )
    if len(out) != len(completions):
        raise DataError(
            f"reward function {name!r} returned {len(out)} rewards for {len(completions)} completions; "
            f"return one float (or None) per completion."
        )
    values = np.full(len(out), np.nan)
    for i, v in enumerate(out):
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)):
            raise DataError(
                f"reward function {name!r} returned {v!r} ({type(v).__name__}) for completion {i}; "
                f"return a float or None."
            )
        if np.isinf(v):  # NaN is an abstention, as TRL reads it; an infinite reward would make every advantage NaN
            raise DataError(
                f"reward function {name!r} returned {float(v)} for completion {i}; rewards must be "
                f"finite: return a float, or None (or NaN) to abstain."
            )
        values[i] = float(v)
    return values


def compute_rewards(
    funcs: Sequence[RewardFunc],
    prompts: Sequence[Any],
    completions: Sequence[Any],
    *,
    weights: Optional[Sequence[float]] = None,
    columns: Optional[Mapping[str, Sequence[Any]]] = None,
) -> tuple[np.ndarray, np.ndarray]:
    """(total reward [N], per-function rewards [N, F]) float64; None -> NaN, and the total is the
    NaN-ignoring weighted sum (TRL's ``nansum``), so a function may abstain on some completions. A completion that
    every function abstains on is unscorable: its total is NaN (TRL 1.16), which ``group_advantages`` leaves out of
    its group's mean and std and gives advantage 0.

    >>> def ones(prompts, completions, **kw): return [1.0] * len(completions)
    >>> def half(prompts, completions, **kw): return [0.5, None]
    >>> total, per = compute_rewards([ones, half], ["p", "p"], ["a", "b"], weights=[1.0, 2.0])
    >>> total.tolist(), np.isnan(per[:, 1]).tolist()
    ([2.0, 1.0], [False, True])
    >>> compute_rewards([half], ["p", "p"], ["a", "b"])[0].tolist()
    [0.5, nan]
    """
    if not funcs:
        raise ConfigError(f"funcs={list(funcs)!r} holds no reward functions: pass at least one (reward_funcs).")
    weights = [1.0] * len(funcs) if weights is None else list(weights)
    if len(weights) != len(funcs):
        raise ConfigError(
            f"reward_weights has {len(weights)} entries for {len(funcs)} reward functions; give one "
            f"weight per function."
        )
    columns = dict(columns or {})
    per = np.stack([_call_reward_func(f, prompts, completions, columns) for f in funcs], axis=1)
    all_none = np.isnan(per).all(axis=1)
    if all_none.any():
        logger.warning(
            "%d completion(s) got None from every reward function: unscorable, left out of their group's mean and "
            "std, advantage 0",
            int(all_none.sum()),
        )
    total = np.nansum(per * np.asarray(weights, np.float64)[None, :], axis=1)
    total[all_none] = np.nan
    return total, per


def _nanstd(x: np.ndarray, axis: Optional[int] = None) -> np.ndarray:
    """TRL's ``nanstd``: the Bessel-corrected std of the non-NaN values; NaN where fewer than two."""
    count = (~np.isnan(x)).sum(axis=axis)
    with np.errstate(invalid="ignore", divide="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # an all-NaN group: its mean is NaN, as TRL's
        mean = np.nanmean(x, axis=axis, keepdims=True)
        var = np.nanmean((x - mean) ** 2, axis=axis) * count / (count - 1)
    return np.where(count > 1, np.sqrt(var), np.nan)


def _group_std(r: np.ndarray, num_generations: int, scale_rewards: str) -> np.ndarray:
    """Per completion: the std that scales its advantage (its group's, or the batch's), TRL's ``std_rewards``."""
    if scale_rewards == "batch":
        return np.full_like(r, _nanstd(r) if r.size > 1 else 0.0)
    if num_generations == 1:
        return np.zeros_like(r)
    return np.repeat(_nanstd(r.reshape(-1, num_generations), axis=1), num_generations)


def group_advantages(rewards_N: np.ndarray, num_generations: int, scale_rewards: str = "group") -> np.ndarray:
    """float64 [N] advantages; completions ``g*G .. g*G+G-1`` are group g (TRL's order). A NaN reward (an
    unscorable completion) is left out of its group's mean and std, and its advantage is 0 (TRL 1.16).

    >>> group_advantages(np.array([1.0, 0.0, 2.0, 2.0]), 2).round(3).tolist()
    [0.707, -0.707, 0.0, 0.0]
    >>> group_advantages(np.array([1.0, 0.0, np.nan, 0.0]), 4).round(3).tolist()
    [1.155, -0.577, 0.0, -0.577]
    """
    r = np.asarray(rewards_N, np.float64)
    if r.ndim != 1 or r.size % num_generations:
        raise DataError(
            f"rewards of shape {r.shape} do not hold whole groups of num_generations={num_generations}; pass "
            f"num_generations completions' rewards per prompt, as a 1-D array."
        )
    if scale_rewards not in SCALE_REWARDS:
        raise ConfigError(f"scale_rewards={scale_rewards!r} is not valid; choose one of {SCALE_REWARDS}.")
    groups = r.reshape(-1, num_generations)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a group with no scored completion: NaN, advantage 0
        centred = (groups - np.nanmean(groups, axis=1, keepdims=True)).reshape(-1)
    adv = centred if scale_rewards == "none" else centred / (_group_std(r, num_generations, scale_rewards) + STD_EPS)
    return np.nan_to_num(adv, nan=0.0)


def _normalized_sum(per_NF: np.ndarray, weights: Sequence[float], num_generations: int) -> np.ndarray:
    """``normalize_then_sum``'s reward: each function's rewards normalised within the group (NaN-aware), weighted
    and summed; NaN where every function abstained."""
    per = np.asarray(per_NF, np.float64)
    grouped = per.reshape(-1, num_generations, per.shape[1])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        mean = np.nanmean(grouped, axis=1, keepdims=True)
        std = _nanstd(grouped, axis=1)[:, None, :] if num_generations > 1 else np.zeros_like(mean)
    normalized = ((grouped - mean) / (std + STD_EPS)).reshape(per.shape)
    total = np.nansum(normalized * np.asarray(weights, np.float64)[None, :], axis=1)
    total[np.isnan(per).all(axis=1)] = np.nan
    return total


def score_advantages(
    total_N: np.ndarray,
    per_NF: np.ndarray,
    num_generations: int,
    *,
    weights: Optional[Sequence[float]] = None,
    scale_rewards: str = "group",
    aggregation: str = "sum_then_normalize",
) -> tuple[np.ndarray, np.ndarray]:
    """(advantages [N], the std each advantage was scaled by [N]: what ``frac_reward_zero_std`` reads), by
    ``aggregation`` (``GRPOConfig.multi_objective_aggregation``). ``total_N`` is ``compute_rewards``' total,
    ``per_NF`` its per-function rewards."""
    if aggregation == "sum_then_normalize":
        r = np.asarray(total_N, np.float64)
        return group_advantages(r, num_generations, scale_rewards), _group_std(r, num_generations, scale_rewards)
    if aggregation != "normalize_then_sum":
        raise ConfigError(
            f"multi_objective_aggregation={aggregation!r} is not valid; choose one of "
            f"{typing.get_args(MultiObjectiveAggregation)}."
        )
    per = np.asarray(per_NF, np.float64)
    r = _normalized_sum(per, [1.0] * per.shape[1] if weights is None else weights, num_generations)
    std = np.full_like(r, _nanstd(r) if r.size > 1 else 0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        adv = (r - np.nanmean(r)) / (std + STD_EPS)
    return np.nan_to_num(adv, nan=0.0), std


# ---------------------------------------------------------------------------------------
# Completions: from generated ids to the mask the loss reads
# ---------------------------------------------------------------------------------------


def completion_mask(
    completion_ids_NC: np.ndarray, eos_token_id: Optional[int], pad_token_id: int, *, mask_truncated: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """(mask [N, C] int32: 1 up to and including the first EOS, truncated [N] bool: no EOS).

    Tokens after the first EOS are not the completion's (generation pads them). With
    ``mask_truncated`` a completion without EOS gets an all-zero mask (TRL's
    ``mask_truncated_completions``).

    >>> m, t = completion_mask(np.array([[5, 2, 0], [5, 6, 7]]), eos_token_id=2, pad_token_id=0)
    >>> m.tolist(), t.tolist()
    ([[1, 1, 0], [1, 1, 1]], [False, True])
    """
    ids = np.asarray(completion_ids_NC)
    n, c = ids.shape
    if eos_token_id is None:
        is_eos = np.zeros_like(ids, bool)
    else:
        is_eos = ids == eos_token_id
    has_eos = np.asarray(is_eos.any(axis=1))
    first_eos = np.where(has_eos, is_eos.argmax(axis=1), c)
    mask = np.arange(c)[None, :] <= first_eos[:, None]
    if eos_token_id is None:
        mask &= ids != pad_token_id
    if mask_truncated:
        mask &= has_eos[:, None]
    return mask.astype(np.int32), ~has_eos


def completion_lengths(mask_NC: np.ndarray) -> np.ndarray:
    return np.asarray(mask_NC).sum(axis=1)


def check_callable_reward(func: Any, index: int) -> None:
    if not callable(func):
        raise ConfigTypeError(
            f"reward_funcs[{index}]={func!r} is not callable; pass a function "
            f"f(prompts, completions, **columns) -> list[float | None] or a built-in name."
        )
    try:
        inspect.signature(func).bind_partial(prompts=[], completions=[])  # dataset columns come as keywords too
    except TypeError:
        raise ConfigTypeError(
            f"reward function {reward_func_name(func)!r} cannot be called as "
            f"f(prompts=..., completions=..., **columns); give it those keyword parameters "
            f"and **kwargs."
        ) from None
    except ValueError:  # builtins without a signature: let the call decide
        pass


# ---------------------------------------------------------------------------------------
# Prompt + completion batches for the log-probs (padded or padding-free)
# ---------------------------------------------------------------------------------------


@dataclass
class CompletionBatch:
    """N documents ``prompt_i + completion_i`` collated into one ``Batch``, completion tokens as targets.

    Padded: row i is document i. Padding-free: every document in one row, each its own segment.
    ``token_row_n``/``token_col_n`` place the n-th scored target (flattened order) in the
    ``[N, C]`` completion matrix, so a backend's per-token log-probs become ``logps[N, C]``.
    """

    batch: Any  # common.data.batching.Batch
    target_doc_ids: np.ndarray  # int32 [B, T]: document of the target labels[t + 1]; -1: none
    num_docs: int  # N
    token_row_n: np.ndarray  # int64 [n]
    token_col_n: np.ndarray  # int64 [n]
    num_columns: int  # C


def collate_completions(
    prompt_ids: Sequence[Sequence[int] | np.ndarray],
    completion_ids: Sequence[Sequence[int] | np.ndarray],
    *,
    padding_free: bool = False,
    pad_token_id: int = 0,
    num_columns: Optional[int] = None,
    pad_to_multiple_of: Optional[int] = None,
    share_prefix: bool = False,
) -> CompletionBatch:
    """Prompt and (trimmed, non-empty) completion ids -> a ``CompletionBatch``.

    ``share_prefix``: consecutive completions of an equal prompt (a GRPO group) share one copy of it
    (``common.data.prefix_sharing``); padded, a group is a row. The log-probs are those of the unshared batch.

    >>> cb = collate_completions([[1, 5], [1]], [[7, 2], [8]], padding_free=True)
    >>> cb.batch.input_ids.tolist(), cb.token_row_n.tolist(), cb.token_col_n.tolist()
    ([[1, 5, 7, 2, 1, 8]], [0, 0, 1], [0, 1, 0])
    """
    if len(prompt_ids) != len(completion_ids) or not len(prompt_ids):
        raise DataError(
            f"collate_completions needs one completion per prompt, got {len(prompt_ids)} prompts and "
            f"{len(completion_ids)} completions; pass one completion per prompt (at least one of each)."
        )
    _check_nonempty(prompt_ids, completion_ids)
    if share_prefix:
        groups = [
            SharedGroup(np.asarray(prompt_ids[run[0]]), tuple(np.asarray(completion_ids[i]) for i in run), tuple(run))
            for run in group_consecutive(prompt_ids)
        ]
        batch, target_doc_ids = collate_shared(
            groups, padding_free=padding_free, pad_token_id=pad_token_id, pad_to_multiple_of=pad_to_multiple_of
        )
        return _completion_batch(batch, target_doc_ids, completion_ids, num_columns)
    docs = []
    for p, c in zip(prompt_ids, completion_ids):
        p, c = np.asarray(p, np.int64), np.asarray(c, np.int64)
        docs.append(
            {
                "input_ids": np.concatenate([p, c]),
                "completion_mask": np.concatenate([np.zeros(p.size, np.int64), np.ones(c.size, np.int64)]),
            }
        )
    batch = collate(
        docs,
        padding_free=padding_free,
        pad_token_id=pad_token_id,
        pad_to_multiple_of=pad_to_multiple_of,
        completion_only_loss=True,
    )
    return _completion_batch(batch, _target_doc_ids(batch), completion_ids, num_columns)


def _check_nonempty(prompt_ids: Sequence[Any], completion_ids: Sequence[Any]) -> None:
    for i, (p, c) in enumerate(zip(prompt_ids, completion_ids)):
        p, c = np.asarray(p, np.int64), np.asarray(c, np.int64)
        if p.size == 0 or c.size == 0:
            raise DataError(
                f"document {i}: the {'prompt' if p.size == 0 else 'completion'} is empty "
                f"({(p if p.size == 0 else c).tolist()}); a prompt needs at "
                f"least one token (a BOS) to predict the completion's first token from: prepend a BOS token."
            )


def _completion_batch(
    batch: Any, target_doc_ids: np.ndarray, completion_ids: Sequence[Any], num_columns: Optional[int]
) -> CompletionBatch:
    """The ``CompletionBatch`` of a collated batch whose targets of document n are completion n's tokens, in order."""
    num_docs = len(completion_ids)
    doc_n = target_doc_ids[target_doc_ids >= 0].astype(np.int64)
    lengths = np.bincount(doc_n, minlength=num_docs)
    expected = np.array([len(c) for c in completion_ids])
    assert (lengths == expected).all(), (lengths, expected)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    col_n = np.arange(doc_n.size) - starts[doc_n]
    width = int(expected.max()) if num_columns is None else int(num_columns)
    return CompletionBatch(batch, target_doc_ids, num_docs, doc_n, col_n, width)


def scatter_tokens(values_n: np.ndarray, cb: CompletionBatch) -> np.ndarray:
    """Per-target values in flattened order -> float64 ``[N, C]`` (0 where there is no token)."""
    out = np.zeros((cb.num_docs, cb.num_columns), np.float64)
    out[cb.token_row_n, cb.token_col_n] = values_n
    return out


def reward_metrics(
    total_N: np.ndarray,
    per_NF: np.ndarray,
    names: Sequence[str],
    num_generations: int,
    scale_rewards: str = "group",
    std_N: Optional[np.ndarray] = None,
) -> dict[str, float]:
    """TRL 1.16's reward metrics of one generation, NaN (unscored) left out: ``reward`` (mean), ``reward_std`` (the
    std over the whole batch), ``frac_reward_zero_std`` (the share of completions whose advantage's scale, their
    group's std or the batch's by ``scale_rewards``, is 0) and each function's mean and std over the completions it
    scored. A std of fewer than two values is NaN, as TRL logs it. ``std_N``: the std each advantage was scaled by
    (``score_advantages``' second output; None: computed from ``scale_rewards``).

    >>> m = reward_metrics(np.array([1.0, 0.0, 1.0, 1.0]), np.array([[1.0], [0.0], [1.0], [np.nan]]), ["em"], 2)
    >>> m["reward"], m["frac_reward_zero_std"], m["rewards/em/mean"]
    (0.75, 0.5, 0.6666666666666666)
    """
    total_N = np.asarray(total_N, np.float64)
    scored = total_N[~np.isnan(total_N)]
    std = _group_std(total_N, num_generations, scale_rewards) if std_N is None else np.asarray(std_N, np.float64)
    out = {
        "reward": float(scored.mean()) if scored.size else float("nan"),
        "reward_std": float(_nanstd(total_N)),
        "frac_reward_zero_std": float(np.isclose(std, 0.0, rtol=1e-5, atol=1e-8).mean()),
    }
    for j, name in enumerate(names):
        column = np.asarray(per_NF[:, j], np.float64)
        ok = column[~np.isnan(column)]
        out[f"rewards/{name}/mean"] = float(ok.mean()) if ok.size else float("nan")
        out[f"rewards/{name}/std"] = float(_nanstd(column))
    return out


def check_online_run(cfg: Any) -> None:
    """The rules of a task that generates its batches (GRPO, RLOO) over a ``TrainConfig``."""
    d = cfg.data
    if d.packing:
        raise ConfigError(
            f"packing=True does not apply to task={cfg.task!r} (its batches are generated, one group of "
            "completions per prompt); use --padding-free to put them in one row."
        )
    check_grpo_config(
        cfg.grpo,
        per_device_train_batch_size=d.per_device_train_batch_size,
        gradient_accumulation_steps=d.gradient_accumulation_steps,
    )
    if cfg.task == "grpo" and (cfg.loss.loss_type == "liger" or cfg.loss.use_liger_kernel):
        check_liger_grpo_config(cfg.grpo)


GRPO_TASK = register_task(
    TaskSpec(
        name="grpo",
        trainer="GRPOTrainer",
        builder="grpo:build_grpo",
        order=2,
        sections=("grpo",),
        reference=True,
        online=True,
        kl_beta="grpo.grpo_beta",
        shares_prefix=True,
        learning_rate=1e-6,
        peft_learning_rate=1e-5,
        plot_keys=("loss", "reward", "completions/mean_length", "tokens_per_second"),
        check=check_online_run,
        evaluator="twinseq.common.run.eval_set:grpo_evaluator",
    )
)
"""Group relative policy optimisation (TRL's ``GRPOTrainer``)."""
