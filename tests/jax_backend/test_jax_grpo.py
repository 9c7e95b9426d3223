"""JAX GRPO: the loss family against the numpy reference, completion log-probs, micro-batches and the trainer.

Invariants (float32; JAX runs with x64 off):
- ``grpo_loss_jax`` equals ``common.objectives.grpo_loss.grpo_loss`` within 1e-6 (relative, or absolute near 0) and its clip
  and KL metrics within 1e-6, for every loss type, on- and off-policy, with and without the KL term, as one
  micro-batch's share of a larger step;
- completion log-probs from hidden states equal ``log_softmax(logits / temperature)`` of the full forward pass
  picked at each completion token (1e-5 absolute), for every kernel, padded and padding-free; the entropy
  equals the naive one;
- two micro-batches' shares add up to the whole batch's loss and gradients;
- ``twinseq train --task grpo --backend jax`` runs, refuses what it cannot do, and on the embedded last-word
  task its mean reward rises (slow).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

jax = pytest.importorskip("jax")

import jax.numpy as jnp  # noqa: E402

from twinseq.common.config import ModelConfig, TrainConfig  # noqa: E402
from twinseq.common.errors import ConfigError  # noqa: E402
from twinseq.common.objectives.grpo import GRPO_LOSS_TYPES, collate_completions  # noqa: E402
from twinseq.common.objectives.grpo_loss import CLIP_LOSS_TYPES, grpo_loss  # noqa: E402
from twinseq.common.models.init import init_weights  # noqa: E402
from twinseq.jax_backend import grpo as jgrpo  # noqa: E402
from twinseq.jax_backend.model import build_model, logits  # noqa: E402

N, C = 6, 5


pytestmark = pytest.mark.usefixtures("highest_precision")


@pytest.fixture(scope="module")
def tiny():
    cfg = ModelConfig.preset("tiny")
    return build_model(cfg, init_weights(cfg, seed=0))


def _loss_inputs(seed: int = 0):
    """float32 log-probs, sampling-policy log-probs 0.3 away (so both clips fire), reference log-probs, advantages
    of both signs, and completions of 1..C tokens."""
    rng = np.random.default_rng(seed)
    logps = (-rng.uniform(0.1, 4.0, (N, C))).astype(np.float32)
    old = (logps + rng.normal(0.0, 0.3, (N, C))).astype(np.float32)
    ref = (logps + rng.normal(0.0, 0.5, (N, C))).astype(np.float32)
    adv = rng.normal(0.0, 1.0, N).astype(np.float32)
    lengths = np.array([5, 1, 3, 4, 2, 5])
    mask = (np.arange(C)[None, :] < lengths[:, None]).astype(np.float32)
    return logps, old, ref, adv, mask


CASES = [dict(loss_type=t) for t in GRPO_LOSS_TYPES] + [
    dict(loss_type=t, off_policy=True, beta=0.04, epsilon_high=0.28) for t in GRPO_LOSS_TYPES] + [
    dict(loss_type=t, off_policy=True, share=True) for t in GRPO_LOSS_TYPES]
# the fast tier keeps the first four loss types; cispo, sapo, luspo and vespo (each a jit) run in make test-all
CASES = [c if c["loss_type"] in ("grpo", "bnpo", "dr_grpo", "dapo") else pytest.param(c, marks=pytest.mark.slow)
         for c in CASES]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_loss_family_equals_numpy_reference(case):
    logps, old, ref, adv, mask = _loss_inputs()
    beta, eps_high = case.get("beta", 0.0), case.get("epsilon_high")
    old_or_none = old if case.get("off_policy") else None
    # as one of 3 micro-batches of a step of 20 completions and 70 completion tokens
    share = dict(num_sequences_in_step=20, num_tokens_in_step=70, num_micro_batches=3) if case.get("share") else {}
    expected = grpo_loss(logps.astype(np.float64), adv, mask, old_logps_NC=old_or_none, ref_logps_NC=ref,
                         loss_type=case["loss_type"], epsilon=0.2, epsilon_high=eps_high, beta=beta,
                         max_completion_length=C, **share)
    spec = jgrpo.LossSpec(case["loss_type"], 0.2, eps_high, beta, C)
    loss, metrics = jgrpo.grpo_loss_jax(jnp.asarray(logps), jnp.asarray(adv), jnp.asarray(mask),
                                        jgrpo.loss_norms(mask, **share), spec,
                                        old_logps_NC=None if old_or_none is None else jnp.asarray(old),
                                        ref_logps_NC=jnp.asarray(ref))
    assert abs(float(loss) - expected.loss) <= 1e-6 * max(abs(expected.loss), 1.0), (float(loss), expected.loss)
    assert set(metrics) == set(expected.metrics)
    for k, v in expected.metrics.items():
        assert abs(float(metrics[k]) - v) <= 1e-6, (k, float(metrics[k]), v)
    if case.get("off_policy") and case["loss_type"] in CLIP_LOSS_TYPES:
        assert expected.metrics["clip_ratio/low_mean"] > 0 and expected.metrics["clip_ratio/high_mean"] > 0


def test_on_policy_gradient_is_minus_advantage_over_tokens():
    """ratio = exp(l - stop_grad(l)): value 1, d ratio / d l = 1, so dapo's d loss / d l = -A m / Σ m."""
    logps, _, _, adv, mask = _loss_inputs()
    spec = jgrpo.LossSpec("dapo", 0.2, None, 0.0, C)
    grad = jax.grad(lambda lp: jgrpo.grpo_loss_jax(lp, jnp.asarray(adv), jnp.asarray(mask),
                                                   jgrpo.loss_norms(mask), spec)[0])(jnp.asarray(logps))
    np.testing.assert_allclose(np.asarray(grad), -adv[:, None] * mask / mask.sum(), rtol=1e-6, atol=1e-8)


def _completions(vocab_size: int, seed: int = 1):
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, vocab_size, n).tolist() for n in (4, 2, 7, 3)]
    completions = [rng.integers(3, vocab_size, n).tolist() for n in (3, 5, 1, 4)]
    return prompts, completions


def _naive_logps(model, cb, temperature: float) -> np.ndarray:
    logits_BTV = logits(model, cb.batch).astype(np.float64) / temperature
    logp_BTV = logits_BTV - np.log(np.exp(logits_BTV - logits_BTV.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - logits_BTV.max(-1, keepdims=True)
    out = np.zeros((cb.num_docs, cb.num_columns))
    flat = np.flatnonzero(cb.target_doc_ids.reshape(-1) >= 0)
    b_idx, t_idx = np.unravel_index(flat, cb.target_doc_ids.shape)
    targets = cb.batch.input_ids[b_idx, t_idx + 1]
    out[cb.token_row_n, cb.token_col_n] = logp_BTV[b_idx, t_idx, targets]
    return out


@pytest.mark.parametrize("padding_free", [False, True])
@pytest.mark.parametrize("loss_type", [pytest.param("nll", marks=pytest.mark.slow),
                                       pytest.param("chunked_nll", marks=pytest.mark.slow), "fused_linear"])
def test_completion_logps_equal_the_full_log_softmax(tiny, padding_free, loss_type):
    prompts, completions = _completions(tiny.config.vocab_size)
    cb = collate_completions(prompts, completions, padding_free=padding_free, num_columns=C)
    got = jgrpo.compute_completion_logps(tiny, cb, loss_type=loss_type, chunk_size=8, temperature=0.7)
    np.testing.assert_allclose(got, _naive_logps(tiny, cb, 0.7), atol=1e-5, rtol=0)
    assert (got[np.arange(C)[None, :] >= np.array([len(c) for c in completions])[:, None]] == 0).all()


def test_entropy_equals_the_naive_one():
    rng = np.random.default_rng(0)
    h, w = rng.normal(size=(11, 8)).astype(np.float32), rng.normal(size=(30, 8)).astype(np.float32)
    logits_nV = (h.astype(np.float64) @ w.T.astype(np.float64))
    logp = logits_nV - logits_nV.max(-1, keepdims=True)
    logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))
    naive = -(np.exp(logp) * logp).sum(-1)
    np.testing.assert_allclose(np.asarray(jgrpo.chunked_entropy(jnp.asarray(h), jnp.asarray(w), chunk_size=4)),
                               naive, rtol=1e-5)


@pytest.mark.slow
def test_micro_batch_shares_add_up_to_the_batch(tiny):
    prompts, completions = _completions(tiny.config.vocab_size)
    mask = (np.arange(C)[None, :] < np.array([len(c) for c in completions])[:, None]).astype(np.float32)
    adv = np.array([0.9, -1.1, 0.4, -0.2], np.float32)
    spec = jgrpo.LossSpec("dapo", 0.2, None, 0.0, C)
    whole = jgrpo.grpo_loss_and_grads(tiny, collate_completions(prompts, completions, num_columns=C), mask, adv, spec)
    step = dict(num_sequences_in_step=4, num_tokens_in_step=int(mask.sum()), num_micro_batches=2)
    parts = [jgrpo.grpo_loss_and_grads(tiny, collate_completions(prompts[s], completions[s], num_columns=C),
                                       mask[s], adv[s], spec, **step) for s in (slice(0, 2), slice(2, 4))]
    assert abs(parts[0][0] + parts[1][0] - whole[0]) <= 1e-6 * abs(whole[0])
    for name, g in whole[1].items():
        summed = parts[0][1][name] + parts[1][1][name]
        assert np.linalg.norm(summed - g) <= 1e-5 * np.linalg.norm(g), name


def _cfg(tmp_path, **overrides) -> TrainConfig:
    values = dict(task="grpo", backend="jax", model_config="tiny", dataset_name="embedded", max_steps=2,
                  learning_rate=3e-3, lr_scheduler_type="constant", per_device_train_batch_size=8,
                  num_generations=4, max_prompt_length=64, max_completion_length=6, padding_free=True,
                  loss_type="fused_linear", output_dir=str(tmp_path / "run"))
    values.update(overrides)
    return TrainConfig.from_dict(values)


@pytest.mark.parametrize("overrides, match", [
    (dict(use_vllm=True), "use_vllm"),
    (dict(loss_type="liger"), "liger"),
    (dict(model_config="tiny-gemma2", temperature=0.7), "temperature"),
])
def test_trainer_refuses_what_it_cannot_do(tmp_path, overrides, match):
    from twinseq.jax_backend.recipes import train

    cfg = _cfg(tmp_path, **overrides)
    with pytest.raises(ConfigError, match=match):
        train(cfg)


def _rewards(path) -> list[float]:
    return [json.loads(line)["reward"] for line in open(path)]


@pytest.mark.slow
def test_two_steps_run_and_log_trl_metrics(tmp_path):
    from twinseq.jax_backend.recipes import train

    path = train(_cfg(tmp_path, num_iterations=2, grpo_beta=0.04))
    rows = [json.loads(line) for line in open(path)]
    assert len(rows) == 2 and all(np.isfinite(r["loss"]) for r in rows)
    assert {"reward", "reward_std", "kl", "entropy", "clip_ratio/region_mean", "completions/mean_length"} <= set(rows[0])
    assert rows[1]["generation_seconds"] == 0.0  # iteration 2 of 2 reuses the completions
    assert rows[0]["kl"] == pytest.approx(0.0, abs=1e-6)  # the policy is still the reference


@pytest.mark.slow
def test_mean_reward_rises_on_the_embedded_task(tmp_path):
    from twinseq.jax_backend.recipes import train

    # configs/grpo.yaml's settings: the format reward of near-uniform random tokens (~0.5) is learned in ~10 steps
    # (measured, 16 steps: seeds 1 and 2 reach 1.0 by steps 10 and 8; seed 0 takes off later, ~0.7 at step 16:
    # when the collapse onto lowercase words starts is a property of the samples, not of the backend)
    rewards = _rewards(train(_cfg(tmp_path, max_steps=12, learning_rate=3e-2, per_device_train_batch_size=16,
                                  num_generations=8, max_completion_length=4, seed=1)))
    first, last = np.mean(rewards[:3]), np.mean(rewards[-3:])
    assert last > first + 0.2, (first, last, rewards)
