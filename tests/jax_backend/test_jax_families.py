"""Every model family on the JAX backend, without torch: the cases of ``parity_tests/families.py``.

Invariants:
- every ``FAMILY_CASES`` config builds from ``init_weights`` and ``export_weights`` gives back exactly
  the arrays it was built from (names, order, bits): the NNX tree mirrors HF's names for biases,
  Qwen3's and Gemma 3's q/k norms and Gemma's four norms per layer;
- packed equals separate: a packed row of documents gives each document the per-token losses and
  (summed) gradients it gets alone, within the float32 bounds, for every family, sliding windows and
  soft-caps included. Dynamic RoPE is the one exception by design (a batch's frequencies follow its
  longest document), so there the padded and packed layouts of the same batch are compared instead;
- a sliding window bites: the 23-token document, longer than the window of 8, next to another document
  in the same row matches running them separately, while the same weights without the window give
  other logits exactly from the 9th position on (the negative control that lets the test fail);
- with Gemma 2's final logit soft-cap every loss type (and every DPO log-prob kernel) equals ``nll``,
  and the cap is really applied (the logits lie inside it; without it they differ);
- ring and all-gather context-parallel attention honour the window and the score soft-cap (forward
  and gradients equal dense attention), and a Gemma 2 step on a cp=4 mesh equals the dense step;
- Gemma 3's sliding and global layers rotate with their own bases (swapped bases are another model);
- Qwen3-MoE's and Mixtral's grouped matmul drops no token: every token routed to one expert gets that expert's
  MLP, and gradients reach the router and every expert; Mixtral weighs and sums the experts in float32, Qwen3-MoE in
  the compute dtype, as transformers' routers;
- dynamic RoPE: the traced frequencies equal ``common.models.rope``'s, and a batch's frequencies depend on that
  batch only (no state carried between calls).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from parity_tests.families import FAMILIES, FAMILY_CASES, family_batches, family_examples
from parity_tests.inputs import rel_norm
from parity_tests.tolerances import tol
from twinseq.common.data.batching import collate, pad_batch
from twinseq.common.models.init import init_weights
from twinseq.common.models.configs import parameter_shapes
from twinseq.common.models.rope import dynamic_inv_freq, rope_inv_freq

SEPARATE_WIDTH = 24  # every ``separate`` batch padded to one width: one compile for the three documents


@pytest.fixture(autouse=True)
def _highest_precision():
    with jax.default_matmul_precision("highest"):
        yield


def _model(name: str, **overrides):
    """The ``name`` case with ``init_weights(seed=0)``; ``overrides`` change the config, not the weights."""
    return _cached_model(name, tuple(sorted((k, tuple(v) if isinstance(v, list) else v)
                                            for k, v in overrides.items())))


@functools.lru_cache(maxsize=None)
def _cached_model(name: str, overrides: tuple):
    import twinseq.jax_backend as jb

    values = {k: list(v) if isinstance(v, tuple) else v for k, v in overrides}
    cfg = dataclasses.replace(FAMILY_CASES[name], **values) if values else FAMILY_CASES[name]
    return jb.build_model(cfg, init_weights(FAMILY_CASES[name], seed=0))


@functools.lru_cache(maxsize=None)
def _batches():
    batches = family_batches()
    batches["separate"] = [pad_batch(b, 1, SEPARATE_WIDTH) for b in batches["separate"]]
    return batches


def _document_rows(batch):
    """[(row, column indices)] of every document of a padded or packed batch, in document order."""
    return [(row, np.nonzero(batch.segment_ids[row] == seg)[0])
            for row in range(batch.shape[0]) for seg in range(1, int(batch.segment_ids[row].max()) + 1)]


@pytest.mark.parametrize("name", FAMILIES)
def test_every_family_builds_from_init_weights_and_exports_them_unchanged(name):
    import twinseq.jax_backend as jb

    cfg = FAMILY_CASES[name]
    weights = init_weights(cfg, seed=0)
    exported = jb.export_weights(jb.build_model(cfg, weights))
    assert list(exported) == list(parameter_shapes(cfg)) == list(weights)
    for key, value in weights.items():
        assert exported[key].dtype == np.float32 and np.array_equal(exported[key], value), key


def _grads_sum(grads_list):
    return {k: sum(g[k] for g in grads_list) for k in grads_list[0]}


def _compare_layouts(model, batch_a, batch_b_list):
    """(max per-token |Δ|, max per-tensor grad rel, loss rel): ``batch_a`` against the documents of
    ``batch_b_list`` (the sum of their losses and gradients)."""
    import twinseq.jax_backend as jb

    tokens_a = jb.token_losses(model, batch_a)
    tokens_b = [jb.token_losses(model, b) for b in batch_b_list]
    docs_b = [(i, row, cols) for i, b in enumerate(batch_b_list) for row, cols in _document_rows(b)]
    token_diff = 0.0
    for (row, cols), (i, row_b, cols_b) in zip(_document_rows(batch_a), docs_b, strict=True):
        token_diff = max(token_diff, float(np.abs(tokens_a[row, cols] - tokens_b[i][row_b, cols_b]).max()))
    loss_a, grads_a = jb.loss_and_grads(model, batch_a)
    results_b = [jb.loss_and_grads(model, b) for b in batch_b_list]
    loss_b, grads_b = sum(r[0] for r in results_b), _grads_sum([r[1] for r in results_b])
    grad_rel = max(rel_norm(grads_a[k], grads_b[k]) for k in grads_b)
    return token_diff, grad_rel, abs(loss_a - loss_b) / abs(loss_b)


# fast-tier budget: the rope-scaling and bias variants of llama run in make test-all and CI
SLOW_PACKED = ("llama-dynamic-rope", "llama-linear-rope", "llama-biases")


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_PACKED else n for n in FAMILIES])
def test_packed_equals_separate(name):
    """Per-token losses and summed gradients of the packed row equal the documents run alone.

    ``llama-dynamic-rope``: a lone short document keeps the unstretched frequencies while the same
    document packed next to the 23-token one gets the batch's stretched ones (as in transformers), so
    packed is compared with the padded layout of the same batch, whose longest document is the same.
    """
    batches = _batches()
    others = [batches["padded"]] if name == "llama-dynamic-rope" else batches["separate"]
    token_diff, grad_rel, loss_rel = _compare_layouts(_model(name), batches["packed"], others)
    print(f"{name}: packed vs {'padded' if len(others) == 1 else 'separate'}: token {token_diff:.2e}, "
          f"grad rel {grad_rel:.2e}, loss rel {loss_rel:.2e}")
    assert token_diff <= tol("float32", "token_loss_abs")
    assert grad_rel <= tol("float32", "grad_rel")
    assert loss_rel <= tol("float32", "loss_rel")


def _without_window(name: str) -> dict:
    if name in ("mistral", "mixtral"):
        return {"sliding_window": None}
    if name == "gemma3":  # keep the layer types: they pick each layer's RoPE base
        return {"sliding_window": 10**6}
    return {"layer_types": ["full_attention"] * FAMILY_CASES[name].num_hidden_layers}


@pytest.mark.parametrize("name", ["mistral", "qwen2-sliding", "gemma2", "gemma3", "mixtral"])
def test_sliding_window_document_packed_with_another_matches_running_alone(name):
    import twinseq.jax_backend as jb

    cfg = FAMILY_CASES[name]
    long_doc, short_doc = family_examples()[:2]
    assert len(long_doc["input_ids"]) > cfg.sliding_window
    packed = collate([long_doc, short_doc], padding_free=True, pad_to_multiple_of=SEPARATE_WIDTH)
    alone = [pad_batch(collate([doc]), 1, SEPARATE_WIDTH) for doc in (long_doc, short_doc)]
    model = _model(name)
    got = jb.logits(model, packed)[0]
    want = np.concatenate([jb.logits(model, b)[0, :len(d["input_ids"])] for b, d in zip(alone, (long_doc, short_doc))])
    n = len(want)
    assert np.abs(got[:n] - want).max() <= tol("float32", "logits_abs")

    # Negative control: the same weights attending to the whole document. The first `window` positions
    # see the same keys either way; every later position of the long document loses keys to the window.
    full = jb.logits(_model(name, **_without_window(name)), packed)[0]
    window = cfg.sliding_window
    assert np.abs(full[:window] - got[:window]).max() <= tol("float32", "logits_abs")
    per_position = np.abs(full[window:len(long_doc["input_ids"])] - got[window:len(long_doc["input_ids"])]).max(-1)
    print(f"{name}: window vs full attention, smallest max |Δ logit| past the window: {per_position.min():.2e}")
    assert per_position.min() > 1e-3


def test_gemma3_sliding_and_global_layers_rotate_with_their_own_base():
    """Gemma 3: the sliding layer rotates with ``rope_local_base_freq`` (plain RoPE), the global layer with
    ``rope_theta`` and its scaling (linear, factor 8, as Gemma 3 4B); swapping the two bases gives another model
    (the control)."""
    import twinseq.jax_backend as jb
    from twinseq.common.models.rope import sliding_rope_inv_freq

    cfg, batch = FAMILY_CASES["gemma3"], _batches()["padded"]
    model = _model("gemma3")
    assert [layer.self_attn.sliding_window for layer in model.model.layers] == [8, None]
    for scaling in ({}, {"rope_type": "linear", "rope_factor": 8.0}):
        scaled = dataclasses.replace(cfg, **scaling)
        ropes = _model("gemma3", **scaling).model.layer_rope(jnp.asarray(batch.position_ids), jnp.float32)
        for (cos, _), inv_freq in zip(ropes, (sliding_rope_inv_freq(scaled), rope_inv_freq(scaled)), strict=True):
            want = np.cos(batch.position_ids[:, :, None].astype(np.float32) * inv_freq)
            np.testing.assert_allclose(np.asarray(cos)[:, 0, :, :len(inv_freq)], want, atol=1e-6)
    assert not np.array_equal(rope_inv_freq(cfg), sliding_rope_inv_freq(cfg))
    swapped = _model("gemma3", rope_theta=cfg.rope_local_base_freq, rope_local_base_freq=cfg.rope_theta)
    real = batch.segment_ids != 0
    assert np.abs(jb.logits(swapped, batch)[real] - jb.logits(model, batch)[real]).max() > 1e-3


def _expert_mlp(block, expert: int, x_NH: np.ndarray) -> np.ndarray:
    """Expert ``expert`` of a ``SparseMoeBlock`` on every row of ``x_NH``, in numpy float64 (HF's layout:
    ``gate_up_proj[e] = [gate; up]`` ``[2m, h]``, ``down_proj[e]`` ``[h, m]``)."""
    gate_up = np.asarray(block.experts["gate_up_proj"][...], np.float64)[expert]
    down = np.asarray(block.experts["down_proj"][...], np.float64)[expert]
    gate, up = np.split(x_NH.astype(np.float64) @ gate_up.T, 2, axis=-1)
    return ((gate / (1 + np.exp(-gate))) * up) @ down.T


@pytest.mark.parametrize("name, expert", [("qwen3_moe", 0), ("qwen3_moe", 2), ("mixtral", 1)])
def test_moe_routes_every_token_to_one_expert_and_drops_none(name, expert):
    """A router that sends every token to one expert (its row of the gate points along a direction every token
    shares, the other rows are zero): all 96 tokens land on that expert, nothing caps it (a capacity of
    ``tokens * top_k / num_experts`` would keep 48) and every token's output is that expert's MLP of the token
    (the second pick weighs ``exp(-60)``). The control: another expert's MLP is another output."""
    import twinseq.jax_backend as jb
    from twinseq.jax_backend.model import SparseMoeBlock

    cfg = FAMILY_CASES[name]
    weights = init_weights(cfg, seed=0)
    gate = np.zeros((cfg.num_experts, cfg.hidden_size), np.float32)
    gate[expert, 0] = 60.0
    weights["model.layers.1.mlp.gate.weight"] = gate
    block = jb.build_model(cfg, weights).model.layers[1].mlp
    assert isinstance(block, SparseMoeBlock) and block.top_k == 2
    rng = np.random.default_rng(0)
    x_BTH = rng.standard_normal((4, 24, cfg.hidden_size)).astype(np.float32)
    x_BTH[..., 0] = 1.0 + np.abs(x_BTH[..., 0])  # every token's router logit for ``expert``: at least 60
    _, weights_NK, experts_NK = block.route(jnp.asarray(x_BTH.reshape(-1, cfg.hidden_size)))
    assert (np.asarray(experts_NK)[:, 0] == expert).all() and np.asarray(weights_NK)[:, 0].min() >= 1 - 1e-6
    y_BTH = np.asarray(block(jnp.asarray(x_BTH)))
    x_NH = x_BTH.reshape(-1, cfg.hidden_size)
    want = _expert_mlp(block, expert, x_NH).reshape(x_BTH.shape)
    print(f"{name}, all tokens on expert {expert}: max |moe - expert MLP| {np.abs(y_BTH - want).max():.1e}")
    np.testing.assert_allclose(y_BTH, want, atol=1e-6, rtol=0)
    other = _expert_mlp(block, (expert + 1) % cfg.num_experts, x_NH).reshape(x_BTH.shape)
    assert np.abs(y_BTH - other).max() > 1e-3


def test_mixtral_weighs_experts_in_float32_and_qwen3_moe_in_the_compute_dtype():
    """bfloat16 models: Mixtral's routing weights stay float32 (transformers' ``MixtralTopKRouter`` returns the
    float32 softmax), so the weighted sum of the experts runs in float32 and only its result is rounded; Qwen3-MoE's
    are cast to bfloat16 first (``Qwen3MoeTopKRouter``). The control: rounding Mixtral's weights to bfloat16 changes
    its output."""
    import twinseq.jax_backend as jb

    x_BTH = jnp.asarray(np.random.default_rng(0).standard_normal((2, 24, 96)), jnp.bfloat16)
    blocks = {name: jb.build_model(FAMILY_CASES[name], init_weights(FAMILY_CASES[name], seed=0),
                                   dtype="bfloat16").model.layers[1].mlp for name in ("mixtral", "qwen3_moe")}
    assert blocks["mixtral"].route(x_BTH.reshape(-1, 96))[1].dtype == jnp.float32
    assert blocks["qwen3_moe"].route(x_BTH.reshape(-1, 96))[1].dtype == jnp.bfloat16
    mixtral = blocks["mixtral"]
    y = mixtral(x_BTH)
    assert y.dtype == jnp.bfloat16
    mixtral.routing_weights_f32 = False
    rounded = mixtral(x_BTH)
    mixtral.routing_weights_f32 = True
    assert float(jnp.abs(y.astype(jnp.float32) - rounded.astype(jnp.float32)).max()) > 0


def test_moe_gradients_flow_through_the_grouped_matmul():
    """Every expert that gets tokens, the router and the dense layer get non-zero gradients; a central difference
    along the last MoE layer's expert weights (after the last router, so no token changes expert) matches the
    gradient (ragged_dot's own VJP, float32)."""
    import twinseq.jax_backend as jb

    cfg, batch = FAMILY_CASES["qwen3_moe"], _batches()["padded"]
    weights = init_weights(cfg, seed=0)
    _, grads = jb.loss_and_grads(jb.build_model(cfg, weights), batch)
    for name in ("model.layers.1.mlp.gate.weight", "model.layers.1.mlp.experts.gate_up_proj",
                 "model.layers.1.mlp.experts.down_proj", "model.layers.0.mlp.gate_proj.weight"):
        assert np.abs(grads[name]).max() > 0, name
    assert all(np.abs(grads["model.layers.1.mlp.experts.down_proj"][e]).max() > 0 for e in range(cfg.num_experts))
    name, eps = "model.layers.2.mlp.experts.down_proj", 1e-2
    direction = np.random.default_rng(1).standard_normal(weights[name].shape).astype(np.float32)
    losses = []
    for sign in (1, -1):
        moved = {**weights, name: weights[name] + sign * eps * direction}
        losses.append(jb.loss_and_grads(jb.build_model(cfg, moved), batch)[0])
    numeric, analytic = (losses[0] - losses[1]) / (2 * eps), float((grads[name] * direction).sum())
    assert abs(numeric - analytic) <= 2e-2 * abs(analytic), (numeric, analytic)


def test_document_causal_mask_with_a_window_follows_positions_not_columns():
    from twinseq.jax_backend.attention import document_causal_mask

    batch = collate(family_examples(), padding_free=True, pad_to_multiple_of=16)
    seg, pos = batch.segment_ids[0], batch.position_ids[0]
    got = np.asarray(document_causal_mask(jnp.asarray(batch.segment_ids), jnp.asarray(batch.position_ids), 8))[0, 0]
    i, j = np.meshgrid(np.arange(len(seg)), np.arange(len(seg)), indexing="ij")
    want = (seg[i] == seg[j]) & (seg[i] != 0) & (pos[j] <= pos[i]) & (pos[i] - pos[j] < 8)
    np.testing.assert_array_equal(got, want)
    assert got.sum(-1).max() == 8  # a query past the window sees exactly 8 keys


# --------------------------------------------------------------------------------------
# Final logit soft-cap: every loss type and every log-prob kernel
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("loss_type", ["chunked_nll", "fused_linear"])
def test_every_loss_type_with_softcap_agrees_with_nll(loss_type):
    import twinseq.jax_backend as jb

    model, batch = _model("gemma2"), _batches()["packed"]
    loss_nll, grads_nll, metrics_nll = jb.loss_grads_and_metrics(model, batch, "nll")
    loss, grads, metrics = jb.loss_grads_and_metrics(model, batch, loss_type, chunk_size=16)
    assert abs(loss - loss_nll) <= tol("float32", "loss_rel") * abs(loss_nll)
    worst = max(rel_norm(grads[k], grads_nll[k]) for k in grads_nll)
    print(f"gemma2 {loss_type} vs nll: loss rel {abs(loss - loss_nll) / loss_nll:.2e}, grad rel {worst:.2e}")
    assert worst <= tol("float32", "grad_rel")
    assert metrics["num_correct_tokens"] == metrics_nll["num_correct_tokens"]
    assert abs(metrics["entropy"] - metrics_nll["entropy"]) <= tol("float32", "entropy_rel") * metrics_nll["entropy"]


def test_final_softcap_is_applied_and_changes_the_model():
    import twinseq.jax_backend as jb

    cap = FAMILY_CASES["gemma2"].final_logit_softcapping
    batch = _batches()["packed"]
    capped = jb.logits(_model("gemma2"), batch)
    uncapped = jb.logits(_model("gemma2", final_logit_softcapping=None), batch)
    assert np.abs(capped - uncapped).max() > 1e-2  # the cap of 1.5 bends logits of ~0.8 by ~10 %
    np.testing.assert_allclose(capped, cap * np.tanh(uncapped / cap), rtol=0, atol=tol("float32", "logits_abs"))


def _logps_problem(seed: int = 0):
    rng = np.random.default_rng(seed)
    hidden = jnp.asarray(rng.standard_normal((2, 12, 8)), jnp.float32)
    weight = jnp.asarray(rng.standard_normal((37, 8)) * 0.6, jnp.float32)  # |logits| ~ 2, so a cap of 1.5 bends
    labels = rng.integers(0, 37, (2, 12)).astype(np.int32)
    labels[rng.random((2, 12)) < 0.3] = -100
    doc_ids = np.where(labels >= 0, rng.integers(0, 4, (2, 12)), -1).astype(np.int32)
    return hidden, weight, jnp.asarray(labels), jnp.asarray(np.roll(doc_ids, -1, axis=1))


@pytest.mark.parametrize("loss_type", ["chunked_nll", "fused_linear"])
def test_every_logprob_kernel_with_softcap_agrees_with_nll(loss_type):
    from twinseq.jax_backend.logprobs import sequence_logps

    hidden, weight, labels, doc_ids = _logps_problem()

    def run(kernel, cap):
        def f(h, w):
            logps = sequence_logps(h, w, labels, doc_ids, 4, kernel, chunk_size=5, logit_softcap=cap)
            return (logps * jnp.arange(1.0, 5.0)).sum(), logps
        (_, logps), grads = jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))(hidden, weight)
        return np.asarray(logps), [np.asarray(g) for g in grads]

    want, want_grads = run("nll", 1.5)
    got, got_grads = run(loss_type, 1.5)
    np.testing.assert_allclose(got, want, rtol=tol("float32", "loss_rel"), atol=0)
    for g, w in zip(got_grads, want_grads):
        assert rel_norm(g, w) <= tol("float32", "grad_rel")
    uncapped, _ = run(loss_type, None)
    assert np.abs(uncapped - want).max() > 1e-2  # the cap matters here, so the comparison can fail


@pytest.mark.parametrize("loss_type", ["nll", "fused_linear"])
def test_causal_lm_loss_softcap_is_the_naive_capped_cross_entropy(loss_type):
    from twinseq.jax_backend.losses import causal_lm_loss, shift_labels

    hidden, weight, labels, _ = _logps_problem(1)

    def naive(h, w):
        logits = 1.5 * jnp.tanh((h @ w.T) / 1.5)
        targets = shift_labels(labels)
        nll = jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, jnp.maximum(targets, 0)[..., None], -1)[..., 0]
        return jnp.where(targets >= 0, nll, 0.0).sum() / 17

    def fused(h, w):
        return causal_lm_loss(h, w, labels, 17, loss_type, chunk_size=5, logit_softcap=1.5)

    want, want_grads = jax.value_and_grad(naive, argnums=(0, 1))(hidden, weight)
    got, got_grads = jax.jit(jax.value_and_grad(fused, argnums=(0, 1)))(hidden, weight)
    assert abs(float(got) - float(want)) <= tol("float32", "loss_rel") * abs(float(want))
    for g, w in zip(got_grads, want_grads):
        assert rel_norm(np.asarray(g), np.asarray(w)) <= tol("float32", "grad_rel")


def test_a_non_positive_logit_softcap_is_refused():
    from twinseq.common.errors import ConfigError
    from twinseq.jax_backend.losses import causal_lm_loss

    hidden, weight, labels, _ = _logps_problem()
    with pytest.raises(ConfigError, match="logit_softcap=0.0 must be a positive number"):
        causal_lm_loss(hidden, weight, labels, 1, logit_softcap=0.0)


# --------------------------------------------------------------------------------------
# Dynamic RoPE: traced frequencies, and a batch's frequencies depend on that batch only
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("max_position_id", [5, 19, 20, 22, 63])
def test_traced_dynamic_frequencies_equal_common_rope(max_position_id):
    from twinseq.jax_backend.model import dynamic_rope_inv_freq

    cfg = FAMILY_CASES["llama-dynamic-rope"]
    positions = jnp.arange(max_position_id + 1, dtype=jnp.int32)[None]
    got = np.asarray(jax.jit(dynamic_rope_inv_freq, static_argnums=(1, 2, 3, 4, 5))(
        positions, tuple(rope_inv_freq(cfg)), cfg.head_dim, cfg.rope_theta, cfg.rope_factor,
        cfg.max_position_embeddings))
    want = dynamic_inv_freq(cfg, max_position_id)
    if max_position_id + 1 <= cfg.max_position_embeddings:
        np.testing.assert_array_equal(got, rope_inv_freq(cfg))  # HF keeps its initial buffer: bit for bit
        return
    # XLA's float32 pow is exp(y * log(base)): the rounding of t = y * log(base) (and of the log) moves the
    # result by |t| * 2^-24 each, plus a few ulps of exp, where numpy/torch round pow almost exactly; with
    # |t| <= log(base) ~ 9.7 that is <= (log(base) + 2) * 2^-23 relative (1.4e-6; 6.4e-7 measured, i.e. a
    # 6e-9 rad angle error at position 22, far below the logits bound).
    base = cfg.rope_theta * (cfg.rope_factor * (max_position_id + 1) / cfg.max_position_embeddings
                             - (cfg.rope_factor - 1)) ** (cfg.head_dim / (cfg.head_dim - 2))
    np.testing.assert_allclose(got, want, rtol=(np.log(base) + 2) * 2.0 ** -23, atol=0)


def test_dynamic_rope_frequencies_depend_on_the_batch_only():
    import twinseq.jax_backend as jb

    long_doc, short_doc = family_examples()[:2]
    model = _model("llama-dynamic-rope")
    default = _model("llama-dynamic-rope", rope_type="default")
    short = pad_batch(collate([short_doc]), 1, SEPARATE_WIDTH)
    both = collate([long_doc, short_doc], padding_free=True, pad_to_multiple_of=SEPARATE_WIDTH)
    first = jb.logits(model, short)
    np.testing.assert_array_equal(first, jb.logits(default, short))  # short batch: unstretched frequencies
    packed = jb.logits(model, both)  # the long document stretches the whole batch's frequencies
    n_long, n_short = len(long_doc["input_ids"]), len(short_doc["input_ids"])
    # init_weights' small weights make the model nearly blind to RoPE: 4e-4 here, still 40x the logits bound
    assert np.abs(packed[0, n_long:n_long + n_short] - first[0, :n_short]).max() > 10 * tol("float32", "logits_abs")
    np.testing.assert_array_equal(jb.logits(model, short), first)  # nothing remembered from the long batch


# --------------------------------------------------------------------------------------
# Context parallel: ring and all-gather attention with windows and soft-caps
# --------------------------------------------------------------------------------------


CP = 4


@pytest.fixture(scope="module")
def cp_mesh():
    from twinseq.jax_backend.parallel import make_mesh

    if jax.device_count() < CP:
        pytest.skip(f"needs {CP} JAX host devices (the root conftest sets XLA_FLAGS); found {jax.device_count()}")
    return make_mesh(cp=CP, devices=jax.devices()[:CP])


@functools.partial(jax.jit, static_argnames=("attend", "window", "softcap"))
def _attention_vjp(q, k, v, dout, seg, pos, *, attend, window, softcap):
    out, vjp = jax.vjp(lambda q, k, v: attend(q, k, v, seg, pos, 0.3, sliding_window=window, softcap=softcap), q, k, v)
    return (out, *vjp(dout))


@pytest.mark.multi_device
@pytest.mark.parametrize("strategy", ["ring", "allgather"])
def test_context_parallel_attention_honours_window_and_softcap(cp_mesh, strategy):
    from twinseq.common.data.context_parallel import shard_sequence
    from twinseq.jax_backend.attention import document_attention
    from twinseq.jax_backend.parallel import ring_attention_fn

    batch = collate(family_examples(), padding_free=True, pad_to_multiple_of=2 * CP)  # 48 columns
    t = batch.shape[1]
    rng = np.random.default_rng(0)
    q, dout = (jnp.asarray(rng.standard_normal((1, 4, t, 16)), jnp.float32) for _ in range(2))
    k, v = (jnp.asarray(rng.standard_normal((1, 2, t, 16)), jnp.float32) for _ in range(2))
    order = shard_sequence(np.arange(t)[None], CP, True)[0]  # the zigzag token order of the trainer
    seg, pos = (jnp.asarray(a[:, order]) for a in (batch.segment_ids, batch.position_ids))
    q, k, v, dout = (x[:, :, order] for x in (q, k, v, dout))
    plain = np.asarray(_attention_vjp(q, k, v, dout, seg, pos, attend=document_attention, window=None,
                                      softcap=None)[0])
    for window, softcap in [(8, 0.5), (None, 0.5), (8, None)]:
        want = _attention_vjp(q, k, v, dout, seg, pos, attend=document_attention, window=window, softcap=softcap)
        got = _attention_vjp(q, k, v, dout, seg, pos, attend=ring_attention_fn(cp_mesh, strategy), window=window,
                             softcap=softcap)
        for g, w in zip(got, want):
            assert np.abs(np.asarray(g) - np.asarray(w)).max() <= 1e-5, (window, softcap)
        assert np.abs(plain - np.asarray(want[0])).max() > 1e-2, (window, softcap)  # the option changes the answer


@pytest.mark.slow  # fast-tier budget: runs in make test-all and CI
@pytest.mark.multi_device
@pytest.mark.parametrize("family", ["gemma2", "gpt_oss"])
def test_family_step_on_a_cp_mesh_equals_the_dense_step(cp_mesh, family):
    """Gemma 2 (sliding and global layers, attention soft-cap, final soft-cap) and gpt-oss (attention sinks,
    sliding and global layers, YaRN, biased experts) through ``grads_jit`` with the trainer's context-parallel
    inputs (``ring_attention_fn``): loss and gradients equal the single-device dense step."""
    from flax import nnx

    from twinseq.jax_backend.model import batch_inputs, grads_jit, in_hf_order, state_to_hf
    from twinseq.jax_backend.parallel import ring_attention_fn, shard_batch

    model, batch = _model(family), _batches()["packed"]
    graphdef, state = nnx.split(model)
    num_items = jnp.asarray(batch.num_items_in_batch, jnp.int32)
    (dense_loss, _), dense_grads = grads_jit(graphdef, state, batch_inputs(batch, model.config.vocab_size),
                                             num_items, loss_type="fused_linear", chunk_size=16)
    arrays = shard_batch(batch, cp_mesh)
    inputs = tuple(arrays[k] for k in ("input_ids", "position_ids", "segment_ids", "targets"))
    (ring_loss, _), ring_grads = grads_jit(graphdef, state, inputs, num_items, loss_type="fused_linear",
                                           chunk_size=16, attend=ring_attention_fn(cp_mesh),
                                           targets_are_shifted=True)
    assert abs(float(ring_loss) - float(dense_loss)) <= tol("float32", "loss_rel") * abs(float(dense_loss))
    dense_hf, ring_hf = (in_hf_order(model.config, state_to_hf(g)) for g in (dense_grads, ring_grads))
    worst = max(rel_norm(ring_hf[k], dense_hf[k]) for k in dense_hf)
    loss_rel = abs(float(ring_loss) - float(dense_loss)) / float(dense_loss)
    print(f"{family} cp={CP} ring vs dense: loss rel {loss_rel:.2e}, grad rel {worst:.2e}")
    assert worst <= tol("float32", "grad_rel")


def test_gpt_oss_refuses_expert_lora_and_expert_parallelism_with_the_fix():
    """gpt-oss's experts are input-major with biases: LoRA on them (``lora_target_parameters``) and expert
    parallelism are refused, naming the field, the value and the fix. The control: LoRA on its attention
    projections works (``test_gpt_oss_lora_on_attention_equals_its_merged_model``)."""
    from twinseq.common.errors import ConfigError
    from twinseq.common.models.peft import PeftConfig, adapter_shapes
    from twinseq.jax_backend.expert_parallel import expert_mesh, shard_experts

    cfg = FAMILY_CASES["gpt_oss"]
    experts = PeftConfig(use_peft=True, lora_dropout=0.0, lora_target_modules=["q_proj"],
                         lora_target_parameters=["experts.down_proj"])
    with pytest.raises(ConfigError, match=r"lora_target_parameters=\['experts.down_proj'\]: LoRA on the experts of "
                                          r"model_type 'gpt_oss' is not built .*drop --lora-target-parameters"):
        adapter_shapes(cfg, experts)
    with pytest.raises(ConfigError, match=r"expert_parallel_size > 1 does not shard gpt_oss's experts.*"
                                          r"set expert_parallel_size=1"):
        shard_experts(_model("gpt_oss"), expert_mesh(2))


@pytest.mark.slow  # fast-tier budget: runs in make test-all and CI
def test_gpt_oss_lora_on_attention_equals_its_merged_model():
    """LoRA on gpt-oss's attention projections (which carry biases; its experts' LoRA is refused above) builds,
    moves the logits (the control) and equals its merged model."""
    import twinseq.jax_backend as jb
    from twinseq.common.models.peft import PeftConfig, init_adapters
    from twinseq.jax_backend import peft as jpeft

    cfg = FAMILY_CASES["gpt_oss"]
    attention = PeftConfig(use_peft=True, lora_r=4, lora_alpha=8.0, lora_target_modules=["q_proj", "o_proj"])
    base = _model("gpt_oss")
    model = jpeft.add_adapters(base, cfg, attention, init_adapters(cfg, attention, seed=1, lora_b_std=0.02))
    batch = _batches()["packed"]
    adapted, merged, plain = (jb.logits(m, batch) for m in (model, jpeft.merge_adapters(model), base))
    assert np.abs(adapted - merged).max() < 1e-5 and np.abs(adapted - plain).max() > 1e-3
