"""JAX DPO: log-prob kernels, the loss family, the reference model and the trainer.

Invariants (float32; JAX runs with x64 off):
- the fused custom-VJP log-probs equal autodiff through the full ``log_softmax``: values to
  1 ulp-level (1e-6 abs at |logp| ~ 5), gradients per tensor within 1e-5;
- the three kernels give the same sequence log-probs (1e-5) and DPO gradients (1e-5);
- every loss type's gradient equals a float64 central difference of the numpy reference;
- micro-batches normalised by the step's pairs add up to the full batch;
- precomputed reference log-probs equal the live copy's; the trainer runs from the CLI, logs
  TRL's reward metrics, refuses what it cannot do, and learns the embedded preferences.
"""

from __future__ import annotations


import numpy as np
import pytest

jax = pytest.importorskip("jax")

import jax.numpy as jnp  # noqa: E402

from twinseq.common.config import ModelConfig, TrainConfig  # noqa: E402
from twinseq.common.objectives.dpo import DPO_LOSS_TYPES, dpo_loss, validate_dpo_config  # noqa: E402
from twinseq.common.data.preference_batching import collate_preference, sequence_logps_from_logits  # noqa: E402
from twinseq.common.data.preference_steps import preference_columns  # noqa: E402
from twinseq.common.models.init import init_weights  # noqa: E402
from twinseq.jax_backend import build_model, logits  # noqa: E402
from twinseq.jax_backend import dpo as jdpo  # noqa: E402
from twinseq.jax_backend import logprobs as jlp  # noqa: E402

LENGTHS = ((5, 7, 4), (3, 9, 6), (8, 2, 5), (4, 5, 10))


pytestmark = pytest.mark.usefixtures("highest_precision")


@pytest.fixture(scope="module")
def tiny():
    cfg = ModelConfig.preset("tiny")
    return cfg, build_model(cfg, init_weights(cfg, seed=0))


def _examples(vocab_size: int, lengths=LENGTHS, seed: int = 3) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"prompt_input_ids": rng.integers(3, vocab_size, p).tolist(),
             "chosen_input_ids": rng.integers(3, vocab_size, c).tolist(),
             "rejected_input_ids": rng.integers(3, vocab_size, r).tolist()} for p, c, r in lengths]


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("chunk_size", [3])  # 4 token chunks -> 4 vocabulary chunks of 10 rows: the last overlaps
def test_fused_logps_equal_autodiff_of_log_softmax(chunk_size):
    key_h, key_w, key_t, key_g = jax.random.split(jax.random.key(0), 4)
    b, t, h, v = 2, 6, 8, 37
    hidden = jax.random.normal(key_h, (b, t, h))
    weight = jax.random.normal(key_w, (v, h)) * 0.5
    labels = jax.random.randint(key_t, (b, t), 0, v).at[:, :2].set(-100)  # ignored targets too
    upstream = jax.random.normal(key_g, (b * t,))

    def naive(hd, w):
        logp = jax.nn.log_softmax(hd.reshape(-1, h) @ w.T, -1)
        targets = jnp.concatenate([labels[:, 1:], jnp.full((b, 1), -100)], 1).reshape(-1)
        picked = jnp.take_along_axis(logp, jnp.maximum(targets, 0)[:, None], -1)[:, 0]
        return jnp.where(targets != -100, picked, 0.0)

    def fused(hd, w):
        return jlp.token_logps(hd, w, labels, "fused_linear", chunk_size)

    def value_and_grads(fn):  # one compilation per function instead of op-by-op dispatch
        return jax.jit(lambda hd, w: (fn(hd, w), jax.grad(lambda a, b: fn(a, b) @ upstream, argnums=(0, 1))(hd, w)))

    (v_fused, g_fused), (v_naive, g_naive) = (value_and_grads(fn)(hidden, weight) for fn in (fused, naive))
    np.testing.assert_allclose(v_fused, v_naive, rtol=0, atol=1e-6)
    for a, ref in zip(g_fused, g_naive):
        assert _rel(a, ref) <= 1e-5


# padding-free is slow here only for its compilations; the parity suite covers it for fused and nll
@pytest.mark.parametrize("padding_free", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_kernels_agree_on_logps_and_dpo_gradients(tiny, padding_free):
    cfg, model = tiny
    pb = collate_preference(_examples(cfg.vocab_size), padding_free=padding_free)
    np_c, np_r = sequence_logps_from_logits(logits(model, pb.batch), pb)
    config = validate_dpo_config(["sigmoid", "ipo"], [1.0, 0.5], beta=0.5)
    results = {}
    for kernel in jlp.LOGPS_LOSS_TYPES:
        results[kernel] = jdpo.dpo_loss_and_grads(model, pb, config, ref_chosen_logps=np_c + 0.7,
                                                  ref_rejected_logps=np_r - 0.4, loss_type=kernel, chunk_size=4)
        pairs = results[kernel][2]
        np.testing.assert_allclose(pairs["chosen_logps"], np_c, rtol=0, atol=1e-5)
        np.testing.assert_allclose(pairs["rejected_logps"], np_r, rtol=0, atol=1e-5)
    full_loss, full_grads, _ = results["nll"]
    for kernel in ("chunked_nll", "fused_linear"):
        loss, grads, _ = results[kernel]
        assert abs(loss - full_loss) <= 1e-6 * abs(full_loss)
        assert max(_rel(grads[k], full_grads[k]) for k in full_grads) <= 1e-5


@pytest.mark.parametrize(  # the five types TRL 1.16 added last (a jit each) run in make test-all
    "loss_type", [pytest.param(t, marks=pytest.mark.slow) if t in ("aot", "aot_unpaired", "discopop", "sft",
                                                                    "sigmoid_norm") else t for t in DPO_LOSS_TYPES])
def test_loss_family_gradient_matches_numpy_finite_difference(loss_type):
    """float32 autodiff of each loss vs a float64 central difference of ``common.objectives.dpo`` (rel 1e-5:
    float32 arithmetic on O(1) log-ratios)."""
    rng = np.random.default_rng(1)
    c, r = rng.normal(0, 2, 6), rng.normal(0, 2, 6)
    zeros = np.zeros(6)
    counts = rng.integers(1, 20, (2, 6)).astype(np.float64)
    kwargs = dict(loss_type=loss_type, beta=0.5, label_smoothing=0.2 if loss_type in ("robust", "exo_pair") else 0.0)
    config = validate_dpo_config(**kwargs)

    def jax_mean(cj, rj):
        losses, _, _ = jdpo.dpo_losses(cj, rj, jnp.zeros(6), jnp.zeros(6), config,
                                       chosen_num_tokens=jnp.asarray(counts[0], jnp.float32),
                                       rejected_num_tokens=jnp.asarray(counts[1], jnp.float32))
        return losses.mean()

    grads = jax.grad(jax_mean, argnums=(0, 1))(jnp.asarray(c, jnp.float32), jnp.asarray(r, jnp.float32))
    f = lambda cc, rr: dpo_loss(cc, rr, zeros, zeros, chosen_num_tokens=counts[0],  # noqa: E731
                                rejected_num_tokens=counts[1], **kwargs).loss
    eye = np.eye(6) * 1e-6
    fd_c = np.array([(f(c + e, r) - f(c - e, r)) / 2e-6 for e in eye])
    fd_r = np.array([(f(c, r + e) - f(c, r - e)) / 2e-6 for e in eye])
    for got, fd in ((grads[0], fd_c), (grads[1], fd_r)):
        if not fd.any():  # 'sft' reads the chosen completions only: no rejected gradient at all
            assert not np.asarray(got).any()
        else:
            assert _rel(got, fd) <= 1e-5


def test_micro_batches_add_up_to_the_full_batch(tiny):
    """Two micro-batches of 2 pairs, normalised by the step's 4, give one batch of 4's loss and
    gradients. Same config, kernel and full batch as the kernel test (one compilation is reused);
    the halves share one padded shape."""
    cfg, model = tiny
    examples = _examples(cfg.vocab_size)
    config = validate_dpo_config(["sigmoid", "ipo"], [1.0, 0.5], beta=0.5)
    full = collate_preference(examples)
    kw = dict(loss_type="fused_linear", chunk_size=4)
    _, _, pairs = jdpo.dpo_loss_and_grads(model, full, config, ref_chosen_logps=np.zeros(4),
                                          ref_rejected_logps=np.zeros(4), **kw)
    ref_c, ref_r = pairs["chosen_logps"] + 0.5, pairs["rejected_logps"] - 0.5
    loss, grads, _ = jdpo.dpo_loss_and_grads(model, full, config, ref_chosen_logps=ref_c, ref_rejected_logps=ref_r,
                                             **kw)
    total_loss, total = 0.0, {k: np.zeros_like(g) for k, g in grads.items()}
    for part in (slice(0, 2), slice(2, 4)):
        half = collate_preference(examples[part], pad_to_multiple_of=16)
        micro_loss, micro, _ = jdpo.dpo_loss_and_grads(model, half, config, ref_chosen_logps=ref_c[part],
                                                       ref_rejected_logps=ref_r[part], num_examples_in_step=4, **kw)
        total_loss += micro_loss
        total = {k: total[k] + micro[k] for k in total}
    assert abs(total_loss - loss) <= 1e-6 * loss
    assert max(_rel(total[k], grads[k]) for k in grads) <= 1e-5


def test_precomputed_reference_equals_the_live_copy(tiny):
    cfg, model = tiny
    examples = _examples(cfg.vocab_size, LENGTHS + ((2, 3, 3), (6, 4, 8)), seed=5)
    rows = {k: [ex[k] for ex in examples] for k in examples[0]}
    train_cfg = TrainConfig.from_flat(task="dpo", backend="jax", per_device_train_batch_size=4, padding_free=True)
    columns = preference_columns(jdpo.precompute_ref_logps(model, rows, train_cfg, pad_token_id=0, bucket=16))
    live_c, live_r = jdpo.compute_sequence_logps(model, collate_preference(examples), loss_type="nll")
    np.testing.assert_allclose(columns["ref_chosen_logps"], live_c, rtol=0, atol=2e-5)
    np.testing.assert_allclose(columns["ref_rejected_logps"], live_r, rtol=0, atol=2e-5)


@pytest.mark.parametrize("overrides,match", [
    ({"loss_type": "liger"}, "fused_linear"),
    ({"packing": True}, "packing=True does not apply to DPO"),
    ({"torch_compile": True}, "torch_compile"),
    ({"activation_offloading": True}, "activation_offloading"),
    ({"context_parallel_size": 2}, "not implemented for DPO"),
    ({"dpo_loss_type": ["exo_pair"]}, "label_smoothing=0.0 is not valid"),
])
def test_trainer_refuses_invalid_combinations(overrides, match):
    from twinseq.common.run.capabilities import Runtime, check_runtime

    with pytest.raises(ValueError, match=match):  # packing and exo_pair are refused by TrainConfig itself
        check_runtime(TrainConfig.from_flat(backend="jax", task="dpo", **overrides),
                      Runtime("jax", "cpu", jax.device_count()))
