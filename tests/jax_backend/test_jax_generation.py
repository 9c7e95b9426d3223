"""The JAX KV-cache sampler (``jax_backend.generation``), without torch.

Invariants (float32, ``highest`` matmul precision):
- the cached rollout gives the same greedy tokens as re-running the full forward pass at every step, on a
  plain Llama, a sliding-window family (rollouts longer than the window) and Gemma 2 (soft-caps, sandwich
  norms, alternating windows);
- left padding changes nothing: a prompt decoded alone gives the tokens it gets in a batch of longer ones;
- after a row's first EOS every token is ``pad_token_id`` and ``completion_mask`` is 0, before it 1;
- top-k = 1 sampling is greedy; top-p keeps exactly the tokens of transformers' rule (numpy restatement);
  the same key gives the same sample, another key another one;
- what the sampler cannot do is refused with the field and the fix.
"""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")

import jax.numpy as jnp  # noqa: E402

from twinseq.common.config import ModelConfig  # noqa: E402
from twinseq.common.errors import ConfigError  # noqa: E402
from twinseq.common.models.init import init_weights  # noqa: E402
from twinseq.jax_backend.generation import (SamplingParams, completion_mask, filter_logits, generate,  # noqa: E402
                                            left_pad)
from twinseq.jax_backend.model import build_model  # noqa: E402

PROMPT_LENGTHS = (7, 3, 12, 1)
COMPLETION = 10


pytestmark = pytest.mark.usefixtures("highest_precision")


def _model(preset: str):
    cfg = ModelConfig.preset(preset)
    return build_model(cfg, init_weights(cfg, seed=0))


def _prompts(vocab_size: int, lengths=PROMPT_LENGTHS, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab_size, n).tolist() for n in lengths]


@pytest.fixture(scope="module")
def tiny():
    return _model("tiny")


@pytest.mark.parametrize("preset", ["tiny", pytest.param("tiny-mistral", marks=pytest.mark.slow),
                                    pytest.param("tiny-gemma2", marks=pytest.mark.slow),
                                    pytest.param("tiny-gemma3", marks=pytest.mark.slow),
                                    pytest.param("tiny-qwen3-moe", marks=pytest.mark.slow),
                                    pytest.param("tiny-mixtral", marks=pytest.mark.slow)])
def test_cache_equals_full_forward_every_step(preset, tiny):
    model = tiny if preset == "tiny" else _model(preset)
    if model.config.sliding_window is not None:
        assert max(PROMPT_LENGTHS) + COMPLETION > model.config.sliding_window  # the window really cuts
    prompts = _prompts(model.config.vocab_size)
    cached = generate(model, prompts, max_completion_length=COMPLETION, do_sample=False, eos_token_id=None)
    full = generate(model, prompts, max_completion_length=COMPLETION, do_sample=False, eos_token_id=None,
                    use_cache=False)
    np.testing.assert_array_equal(cached.completion_ids, full.completion_ids)
    assert cached.completion_mask.all()
    assert len({tuple(row) for row in cached.completion_ids.tolist()}) == len(prompts)  # not a degenerate model


def test_left_padding_does_not_change_a_prompts_tokens(tiny):
    prompts = _prompts(tiny.config.vocab_size)
    batched = generate(tiny, prompts, max_completion_length=COMPLETION, do_sample=False, eos_token_id=None)
    shortest = int(np.argmin(PROMPT_LENGTHS))
    alone = generate(tiny, [prompts[shortest]], max_completion_length=COMPLETION, do_sample=False,
                     eos_token_id=None)
    assert batched.prompt_mask[shortest].sum() == 1 and batched.prompt_mask.shape[1] == max(PROMPT_LENGTHS)
    np.testing.assert_array_equal(alone.completion_ids[0], batched.completion_ids[shortest])


def test_eos_stops_a_row_and_pads_after_it(tiny):
    prompts = _prompts(tiny.config.vocab_size)
    free = generate(tiny, prompts, max_completion_length=COMPLETION, do_sample=False, eos_token_id=None)
    eos = int(free.completion_ids[0, 3])
    first_B = [row.index(eos) if eos in row else None for row in free.completion_ids.tolist()]
    out = generate(tiny, prompts, max_completion_length=COMPLETION, do_sample=False, eos_token_id=eos,
                   pad_token_id=0)
    for row, first in enumerate(first_B):
        end = COMPLETION if first is None else first + 1
        np.testing.assert_array_equal(out.completion_ids[row, :end], free.completion_ids[row, :end])
        assert (out.completion_ids[row, end:] == 0).all()
        assert out.completion_mask[row].tolist() == [1] * end + [0] * (COMPLETION - end)
    assert first_B[0] <= 3


def test_completion_mask_stops_at_the_first_eos_of_any_id():
    ids = np.array([[5, 2, 9, 2], [3, 7, 4, 4], [7, 1, 1, 1]])
    assert completion_mask(ids, [2, 7]).tolist() == [[1, 1, 0, 0], [1, 1, 0, 0], [1, 0, 0, 0]]


@pytest.mark.slow
def test_top_k_one_is_greedy_and_keys_decide_samples(tiny):
    prompts = _prompts(tiny.config.vocab_size)
    kwargs = dict(max_completion_length=6, eos_token_id=None)
    greedy = generate(tiny, prompts, do_sample=False, **kwargs)
    top1 = generate(tiny, prompts, key=jax.random.key(1), top_k=1, temperature=0.7, **kwargs)
    np.testing.assert_array_equal(top1.completion_ids, greedy.completion_ids)
    a = generate(tiny, prompts, key=jax.random.key(1), **kwargs)
    b = generate(tiny, prompts, key=jax.random.key(1), **kwargs)
    c = generate(tiny, prompts, key=jax.random.key(2), **kwargs)
    np.testing.assert_array_equal(a.completion_ids, b.completion_ids)
    assert (a.completion_ids != c.completion_ids).any()


def _hf_top_p_keep(scores_V: np.ndarray, top_p: float) -> np.ndarray:
    """transformers' TopPLogitsWarper restated: sort ascending, drop the tokens whose cumulative probability is
    <= 1 - top_p, always keep the most likely one."""
    order = np.argsort(scores_V, kind="stable")
    probs = np.exp(scores_V[order] - scores_V.max())
    cumulative = np.cumsum(probs / probs.sum())
    remove = cumulative <= 1 - top_p
    remove[-1] = False
    keep = np.ones_like(scores_V, bool)
    keep[order[remove]] = False
    return keep


@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.9])
def test_top_p_keeps_the_nucleus(top_p):
    rng = np.random.default_rng(0)
    logits_BV = rng.normal(size=(3, 50)).astype(np.float32) * 2
    scores_BV = np.asarray(filter_logits(jnp.asarray(logits_BV), SamplingParams(top_p=top_p, temperature=0.8)))
    for row in range(3):
        np.testing.assert_array_equal(np.isfinite(scores_BV[row]), _hf_top_p_keep(logits_BV[row] / 0.8, top_p))


def test_top_k_keeps_k_and_temperature_divides():
    logits_BV = jnp.asarray([[0.0, 3.0, 1.0, 2.0, -1.0]])
    scores = np.asarray(filter_logits(logits_BV, SamplingParams(top_k=2, temperature=2.0)))
    assert scores.tolist() == [[-np.inf, 1.5, -np.inf, 1.0, -np.inf]]


def test_left_pad_and_bad_inputs_are_refused(tiny):
    ids, mask = left_pad([[4, 5], [6, 7, 8]], pad_token_id=0, pad_to_multiple_of=4)
    assert ids.tolist() == [[0, 0, 4, 5], [0, 6, 7, 8]] and mask.sum() == 5
    with pytest.raises(ConfigError, match="temperature"):
        SamplingParams(temperature=0.0)
    with pytest.raises(ConfigError, match="top_p"):
        SamplingParams(top_p=1.5)
    with pytest.raises(ConfigError, match="key"):
        generate(tiny, [[4, 5]], max_completion_length=2)
    with pytest.raises(ConfigError, match="left-padded"):
        generate(tiny, (ids[:, ::-1].copy(), mask[:, ::-1].copy()), max_completion_length=2, do_sample=False)
    with pytest.raises(ConfigError, match="non-empty"):
        left_pad([[4], []], pad_token_id=0)


def test_dynamic_rope_past_its_range_is_refused():
    cfg = ModelConfig.preset("tiny", rope_type="dynamic", rope_factor=2.0, max_position_embeddings=8)
    model = build_model(cfg, init_weights(cfg, seed=0))
    with pytest.raises(ConfigError, match="max_position_embeddings"):
        generate(model, [[4, 5, 6]], max_completion_length=6, do_sample=False)


@pytest.mark.slow
def test_min_new_tokens_forbids_an_early_eos(tiny):
    prompts = _prompts(tiny.config.vocab_size)
    free = generate(tiny, prompts, max_completion_length=4, do_sample=False, eos_token_id=None)
    eos = int(free.completion_ids[0, 0])  # row 0's greedy first token, made the EOS
    early = generate(tiny, prompts, max_completion_length=4, do_sample=False, eos_token_id=eos)
    late = generate(tiny, prompts, max_completion_length=4, do_sample=False, eos_token_id=eos, min_new_tokens=2)
    assert early.completion_mask[0].tolist() == [1, 0, 0, 0]
    assert late.completion_ids[0, 0] != eos and late.completion_ids[0, 1] != eos
