"""Sampling from the NNX ``CausalLM`` with a static-shape KV cache: GRPO's rollouts on the JAX backend.

``generate(model, prompts, max_completion_length=C, ...)`` left-pads the prompts to ``P`` tokens, runs one
prefill pass over them, then decodes ``C - 1`` more tokens one at a time inside a ``jax.lax.while_loop``.
Every shape depends on ``(B, P, C)`` only, so a rollout compiles once per bucket:

- the cache of every layer is ``[B, K, P + C, D]`` for keys and values, written in place
  (``lax.dynamic_update_slice``) at slot ``P + i`` for the i-th completion token;
- a query at slot ``s`` may attend to a cached key at slot ``j`` iff the key is a real token
  (not left padding) and ``j <= s`` (and, on a sliding layer, ``pos(s) - pos(j) < sliding_window``);
- RoPE positions count from each prompt's first real token (``cumsum(mask) - 1``), so a left-padded
  prompt gets the angles it would get alone, as Hugging Face's ``generate`` computes them;
- a row that emitted an EOS token keeps decoding (static shapes) but its later tokens are replaced by
  ``pad_token_id`` and masked out of ``completion_mask``; the loop stops early once every row is done.

The decoder layers are the model's own (norms, residuals, q/k norms, soft-caps and windows of every
family); only their attention is swapped for ``_CachedAttention`` through the model's ``attend`` hook.
``use_cache=False`` instead re-runs the full forward pass over the ``P + C`` slots at every step: the
naive equivalent the cache must match (``tests/jax_backend/test_jax_generation.py``).

Sampling follows ``transformers``' processors in their order: temperature, then top-k, then top-p
(nucleus: the smallest set of most likely tokens whose mass reaches ``top_p``, at least one token),
then a categorical draw from a ``jax.random`` key; ``do_sample=False`` is greedy (argmax).
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from twinseq.common.backend import Model
from twinseq.common.errors import ConfigError
from twinseq.jax_backend.attention import dot_product_attention
from twinseq.jax_backend.losses import logits_f32
from twinseq.jax_backend.model import CausalLM


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How the next token is chosen (hashable: a static argument of the jitted rollout).

    ``do_sample`` False: greedy, the other fields are ignored. ``top_k`` 0 and ``top_p`` 1.0 disable
    their filter, as in ``transformers.GenerationConfig``.
    """

    do_sample: bool = True
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ConfigError(f"temperature={self.temperature!r} must be > 0; use do_sample=False for greedy decoding.")
        if int(self.top_k) < 0:
            raise ConfigError(f"top_k={self.top_k!r} must be >= 0; pass 0 to disable the top-k filter.")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"top_p={self.top_p!r} must be in (0, 1]; pass 1.0 to disable nucleus sampling.")


@dataclasses.dataclass
class Completions:
    """What ``generate`` returns, numpy int32.

    ``prompt_ids`` / ``prompt_mask`` [B, P]: the left-padded prompts (1 = real token);
    ``completion_ids`` [B, C]: the sampled tokens, ``pad_token_id`` after a row's first EOS;
    ``completion_mask`` [B, C]: 1 up to and including the first EOS, 0 after it.
    """

    prompt_ids: np.ndarray
    prompt_mask: np.ndarray
    completion_ids: np.ndarray
    completion_mask: np.ndarray


def left_pad(
    prompts: Sequence[Sequence[int]], pad_token_id: int, pad_to_multiple_of: Optional[int] = None
) -> tuple[np.ndarray, np.ndarray]:
    """(ids [B, P], mask [B, P]) int32, each prompt right-aligned (padding on the left).

    >>> ids, mask = left_pad([[5, 6, 7], [8]], pad_token_id=0)
    >>> ids.tolist(), mask.tolist()
    ([[5, 6, 7], [0, 0, 8]], [[1, 1, 1], [0, 0, 1]])
    """
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ConfigError(
            f"prompts must be a non-empty list of non-empty token lists, got lengths {[len(p) for p in prompts][:8]} "
            "(an empty prompt has no token to condition on); drop empty prompts or prepend a BOS token."
        )
    length = max(len(p) for p in prompts)
    if pad_to_multiple_of:
        length = -(-length // pad_to_multiple_of) * pad_to_multiple_of
    ids = np.full((len(prompts), length), pad_token_id, np.int32)
    mask = np.zeros((len(prompts), length), np.int32)
    for row, prompt in enumerate(prompts):
        ids[row, length - len(prompt) :] = prompt
        mask[row, length - len(prompt) :] = 1
    return ids, mask


# --------------------------------------------------------------------------------------
# Token choice
# --------------------------------------------------------------------------------------


def filter_logits(logits_BV: jax.Array, params: SamplingParams) -> jax.Array:
    """float32 [B, V]: ``logits / temperature`` with the tokens outside top-k / top-p set to -inf.

    Naive equivalent of top-p: sort the probabilities in decreasing order and keep a token iff the mass
    of the tokens before it is ``< top_p`` (the first token is always kept; ties with the last kept
    logit are kept too).
    """
    scores_BV = logits_BV.astype(jnp.float32) / jnp.float32(params.temperature)
    if params.top_k and params.top_k < scores_BV.shape[-1]:
        kth_B1 = jax.lax.top_k(scores_BV, int(params.top_k))[0][:, -1:]
        scores_BV = jnp.where(scores_BV < kth_B1, -jnp.inf, scores_BV)
    if params.top_p < 1.0:
        sorted_BV = -jnp.sort(-scores_BV, axis=-1)
        probs_BV = jax.nn.softmax(sorted_BV, axis=-1)
        mass_before_BV = jnp.cumsum(probs_BV, axis=-1) - probs_BV
        kept_BV = (mass_before_BV < params.top_p).at[:, 0].set(True)
        cutoff_B1 = jnp.min(jnp.where(kept_BV, sorted_BV, jnp.inf), axis=-1, keepdims=True)
        scores_BV = jnp.where(scores_BV < cutoff_B1, -jnp.inf, scores_BV)
    return scores_BV


def choose_tokens(logits_BV: jax.Array, key: jax.Array, params: SamplingParams) -> jax.Array:
    """int32 [B]: argmax (greedy) or a draw from the filtered distribution."""
    if not params.do_sample:
        return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
    return jax.random.categorical(key, filter_logits(logits_BV, params), axis=-1).astype(jnp.int32)


# --------------------------------------------------------------------------------------
# The cached forward pass
# --------------------------------------------------------------------------------------


class _CachedAttention:
    """An ``AttendFn`` that writes this step's keys and values into one layer's cache, then attends over
    the whole cache with the slot mask of the module docstring.

    The updated cache is left on ``self.k_BKSD`` / ``self.v_BKSD`` for the caller (the model's layer
    returns only its hidden states). It is called once per layer call, inside the caller's trace.
    """

    def __init__(self, k_BKSD, v_BKSD, start, query_pos_BT, key_pos_BS, key_valid_BS):
        self.k_BKSD, self.v_BKSD = k_BKSD, v_BKSD
        self.start, self.query_pos_BT = start, query_pos_BT
        self.key_pos_BS, self.key_valid_BS = key_pos_BS, key_valid_BS

    def __call__(
        self,
        q_BNTD,
        k_BKTD,
        v_BKTD,
        scaling,
        *,
        sliding_window: Optional[int] = None,
        softcap: Optional[float] = None,
        sinks: Optional[jax.Array] = None,
    ) -> jax.Array:
        at = (0, 0, self.start, 0)
        self.k_BKSD = jax.lax.dynamic_update_slice(self.k_BKSD, k_BKTD.astype(self.k_BKSD.dtype), at)
        self.v_BKSD = jax.lax.dynamic_update_slice(self.v_BKSD, v_BKTD.astype(self.v_BKSD.dtype), at)
        t, s = q_BNTD.shape[2], self.k_BKSD.shape[2]
        query_slot_T = self.start + jnp.arange(t)
        allowed_B1TS = self.key_valid_BS[:, None, None, :] & (jnp.arange(s)[None, :] <= query_slot_T[:, None])
        if sliding_window is not None:
            distance_BTS = self.query_pos_BT[:, :, None] - self.key_pos_BS[:, None, :]
            allowed_B1TS = allowed_B1TS & (distance_BTS < sliding_window)[:, None]
        return dot_product_attention(
            q_BNTD, self.k_BKSD, self.v_BKSD, allowed_B1TS, scaling, softcap=softcap, sinks_N=sinks
        )


def _cached_forward(model: CausalLM, cache: tuple, input_ids_BT, start, query_pos_BT, key_pos_BS, key_valid_BS):
    """(float32 logits of the last query [B, V], updated cache): ``input_ids_BT`` fill slots ``[start, start + T)``;
    ``key_pos_BS`` / ``key_valid_BS`` already describe them."""
    decoder = model.model
    x_BTH = decoder.embed_tokens(input_ids_BT)
    new_cache = []
    for layer, (cos, sin), (k_BKSD, v_BKSD) in zip(
        decoder.layers, decoder.layer_rope(query_pos_BT, x_BTH.dtype), cache
    ):
        attend = _CachedAttention(k_BKSD, v_BKSD, start, query_pos_BT, key_pos_BS, key_valid_BS)
        x_BTH = layer(x_BTH, cos, sin, (), attend)
        new_cache.append((attend.k_BKSD, attend.v_BKSD))
    hidden_BH = decoder.norm(x_BTH[:, -1])
    return logits_f32(hidden_BH, model.lm_head_VH(), model.final_logit_softcapping), tuple(new_cache)


def _full_forward(model: CausalLM, ids_BS, pos_BS, valid_BS, last_slot):
    """float32 logits [B, V] at slot ``last_slot`` from a plain forward pass over every slot (no cache)."""
    hidden_BSH = model(ids_BS, pos_BS, valid_BS.astype(jnp.int32))
    hidden_BH = jax.lax.dynamic_index_in_dim(hidden_BSH, last_slot, axis=1, keepdims=False)
    return logits_f32(hidden_BH, model.lm_head_VH(), model.final_logit_softcapping)


def _empty_cache(model: CausalLM, batch_size: int, num_slots: int) -> tuple:
    cfg = model.config
    shape = (batch_size, cfg.num_key_value_heads, num_slots, cfg.head_dim)
    dtype = model.model.embed_tokens.weight[...].dtype
    return tuple((jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)) for _ in range(cfg.num_hidden_layers))


@partial(
    jax.jit,
    static_argnums=(0,),
    static_argnames=("max_completion_length", "params", "eos_ids", "pad_id", "use_cache", "min_new_tokens"),
)
def _generate_jit(
    graphdef,
    state,
    prompt_ids_BP,
    prompt_mask_BP,
    key,
    *,
    max_completion_length: int,
    params: SamplingParams,
    eos_ids: tuple,
    pad_id: int,
    use_cache: bool,
    min_new_tokens: int = 0,
):
    """int32 completion ids [B, C]; the rollout of ``generate``, compiled once per (B, P, C) and settings."""
    model = nnx.merge(graphdef, state)
    (b, p), c = prompt_ids_BP.shape, max_completion_length
    prompt_len_B = jnp.sum(prompt_mask_BP, axis=1).astype(jnp.int32)
    # left padding: real tokens are contiguous and end at slot P - 1, so position = slot - (P - prompt_len)
    pos_BS = jnp.arange(p + c)[None, :] - (p - prompt_len_B)[:, None]
    pos_BS = jnp.maximum(pos_BS, 0).astype(jnp.int32)
    valid_BS = jnp.concatenate([prompt_mask_BP.astype(bool), jnp.zeros((b, c), bool)], axis=1)
    ids_BS = jnp.concatenate([prompt_ids_BP, jnp.full((b, c), pad_id, jnp.int32)], axis=1)
    eos_E = jnp.asarray(eos_ids if eos_ids else (-1,), jnp.int32)

    if use_cache:
        cache = _empty_cache(model, b, p + c)
        logits_BV, cache = _cached_forward(model, cache, prompt_ids_BP, 0, pos_BS[:, :p], pos_BS, valid_BS)
    else:
        cache = ()
        logits_BV = _full_forward(model, ids_BS, pos_BS, valid_BS, p - 1)

    def emit(i, logits_BV, key, tokens_BC, done_B):
        if min_new_tokens and eos_ids:  # HF's MinNewTokensLengthLogitsProcessor: no EOS before min_new_tokens
            logits_BV = jnp.where(
                (i < min_new_tokens) & jnp.isin(jnp.arange(logits_BV.shape[-1]), eos_E), -jnp.inf, logits_BV
            )
        token_B = jnp.where(done_B, pad_id, choose_tokens(logits_BV, key, params))
        return tokens_BC.at[:, i].set(token_B), done_B | jnp.isin(token_B, eos_E), token_B

    keys = jax.random.split(key, c)
    tokens_BC, done_B, _ = emit(0, logits_BV, keys[0], jnp.full((b, c), pad_id, jnp.int32), jnp.zeros(b, bool))

    def cond(carry):
        i, _, done_B, _, _ = carry
        return (i < c) & ~jnp.all(done_B)

    def body(carry):
        i, tokens_BC, done_B, cache, valid_BS = carry
        slot = p + i - 1  # the slot of the token emitted last, fed back now
        last_B1 = jax.lax.dynamic_slice_in_dim(tokens_BC, i - 1, 1, axis=1)
        valid_BS = jax.lax.dynamic_update_slice(valid_BS, jnp.ones((b, 1), bool), (0, slot))
        if use_cache:
            query_pos_B1 = jax.lax.dynamic_slice_in_dim(pos_BS, slot, 1, axis=1)
            logits_BV, cache = _cached_forward(model, cache, last_B1, slot, query_pos_B1, pos_BS, valid_BS)
        else:
            ids_BS_now = jax.lax.dynamic_update_slice(ids_BS, tokens_BC, (0, p))
            logits_BV = _full_forward(model, ids_BS_now, pos_BS, valid_BS, slot)
        tokens_BC, done_B, _ = emit(i, logits_BV, keys[i], tokens_BC, done_B)
        return i + 1, tokens_BC, done_B, cache, valid_BS

    carry = (jnp.asarray(1, jnp.int32), tokens_BC, done_B, cache, valid_BS)
    return jax.lax.while_loop(cond, body, carry)[1]


# --------------------------------------------------------------------------------------
# Public entry point
# --------------------------------------------------------------------------------------


def completion_mask(completion_ids_BC: np.ndarray, eos_ids: Sequence[int]) -> np.ndarray:
    """int32 [B, C]: 1 up to and including each row's first EOS token, 0 after it (TRL's rule).

    >>> completion_mask(np.array([[4, 2, 0, 0], [4, 5, 6, 7]]), eos_ids=[2]).tolist()
    [[1, 1, 0, 0], [1, 1, 1, 1]]
    """
    is_eos_BC = np.isin(completion_ids_BC, list(eos_ids))
    eos_before_BC = np.cumsum(is_eos_BC, axis=1) - is_eos_BC  # EOS strictly before this token
    return (eos_before_BC == 0).astype(np.int32)


def _eos_ids(eos_token_id: Union[int, Sequence[int], None]) -> tuple[int, ...]:
    if eos_token_id is None:
        return ()
    return (int(eos_token_id),) if isinstance(eos_token_id, (int, np.integer)) else tuple(int(e) for e in eos_token_id)


def check_generation_supported(model: CausalLM, total_length: int) -> None:
    """Refuse what the cached rollout would get wrong: ``dynamic`` RoPE past ``max_position_embeddings``
    (its frequencies depend on the longest sequence, so cached keys would carry stale angles)."""
    cfg = model.config
    if cfg.rope_type == "dynamic" and total_length > cfg.max_position_embeddings:
        raise ConfigError(
            f"rope_type='dynamic' with a prompt plus max_completion_length of {total_length} tokens "
            f"> max_position_embeddings={cfg.max_position_embeddings}: the JAX sampler does not "
            f"re-rotate cached keys when the NTK base stretches; shorten max_completion_length or "
            f"the prompts."
        )


def generate(
    model: CausalLM,
    prompts: Union[Sequence[Sequence[int]], tuple[np.ndarray, np.ndarray]],
    *,
    max_completion_length: int,
    key: Optional[jax.Array] = None,
    do_sample: bool = True,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    eos_token_id: Union[int, Sequence[int], None, str] = "config",
    pad_token_id: Optional[int] = None,
    use_cache: bool = True,
    pad_to_multiple_of: Optional[int] = None,
    min_new_tokens: int = 0,
) -> Completions:
    """Sample up to ``max_completion_length`` tokens after each prompt.

    ``prompts``: token lists (left-padded here, to a multiple of ``pad_to_multiple_of`` to bound the
    number of compiled shapes), or an already left-padded ``(ids [B, P], mask [B, P])`` pair.
    ``eos_token_id`` defaults (``"config"``) to the model config's (None: no EOS stopping); ``pad_token_id`` to the
    config's (or 0). ``key`` is a ``jax.random`` key (needed when ``do_sample``). ``min_new_tokens``: EOS
    cannot be chosen before that many tokens (transformers' option of the same name).

    >>> from twinseq.common.config import ModelConfig
    >>> from twinseq.jax_backend.model import build_model
    >>> out = generate(build_model(ModelConfig.preset("tiny")), [[5, 6, 7], [8]], max_completion_length=4,
    ...                do_sample=False)
    >>> out.completion_ids.shape, out.prompt_mask.tolist()
    ((2, 4), [[1, 1, 1], [0, 0, 1]])
    """
    cfg = model.config
    if int(max_completion_length) < 1:
        raise ConfigError(
            f"max_completion_length={max_completion_length!r} must be >= 1; pass the number of tokens to generate."
        )
    params = SamplingParams(bool(do_sample), float(temperature), int(top_k), float(top_p))
    if do_sample and key is None:
        raise ConfigError(
            "generate(do_sample=True) needs key=jax.random.key(seed); pass one, or do_sample=False for greedy decoding."
        )
    if pad_token_id is None:
        pad_token_id = 0 if cfg.pad_token_id is None else cfg.pad_token_id
    pad_id = int(pad_token_id)
    eos_ids = _eos_ids(cfg.eos_token_id if isinstance(eos_token_id, str) else eos_token_id)
    if isinstance(prompts, tuple) and len(prompts) == 2 and isinstance(prompts[0], np.ndarray):
        ids_BP, mask_BP = (np.asarray(a, np.int32) for a in prompts)
    else:
        ids_BP, mask_BP = left_pad(prompts, pad_id, pad_to_multiple_of)
    _check_left_padded(mask_BP)
    check_generation_supported(model, ids_BP.shape[1] + int(max_completion_length))
    graphdef, state = nnx.split(model)
    tokens_BC = _generate_jit(
        graphdef,
        state,
        jnp.asarray(ids_BP),
        jnp.asarray(mask_BP),
        jax.random.key(0) if key is None else key,
        max_completion_length=int(max_completion_length),
        params=params,
        eos_ids=eos_ids,
        pad_id=pad_id,
        use_cache=bool(use_cache),
        min_new_tokens=min(int(min_new_tokens), int(max_completion_length)),
    )
    tokens_BC = np.asarray(tokens_BC, np.int32)
    return Completions(ids_BP, mask_BP, tokens_BC, completion_mask(tokens_BC, eos_ids))


def complete_prompts(
    model: Model,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    seed: int = 0,
    eos_token_id: Optional[int] = None,
    pad_token_id: int = 0,
) -> np.ndarray:
    """int32 [N, C] completions (``common.backend.Backend.complete_prompts``): ``generate`` with the KV cache,
    greedy at ``temperature`` 0, else sampled with ``jax.random.key(seed)``; EOS is not allowed first, as torch's
    ``generate`` (``min_new_tokens=1``)."""
    sample = temperature > 0
    return generate(
        model,
        prompts,
        max_completion_length=max_new_tokens,
        key=jax.random.key(seed),
        do_sample=sample,
        temperature=float(temperature) if sample else 1.0,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        min_new_tokens=1,
    ).completion_ids


def _check_left_padded(mask_BP: np.ndarray) -> None:
    """Every row's real tokens must be contiguous and end at the last column (left padding)."""
    ends_real = mask_BP[:, -1] == 1
    contiguous = np.all(np.diff(mask_BP, axis=1) >= 0, axis=1)
    if not (ends_real.all() and contiguous.all()):
        raise ConfigError(
            "prompt_mask must describe left-padded prompts (0s then 1s in every row, a real token in "
            f"the last column); rows {np.flatnonzero(~(ends_real & contiguous))[:8].tolist()} are not: build them "
            "with generation.left_pad."
        )
