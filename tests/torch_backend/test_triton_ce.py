"""torch_backend/triton_ce.py: twinseq's Triton linear cross-entropy against float64 autograd and the torch paths.

On CPU the kernels run under Triton's interpreter (``TRITON_INTERPRET=1``, numpy): the same kernel
sources the GPU compiles, launched tile by tile, so the tiling, the online logsumexp, the masks at
the edges, the vocabulary slices and the atomics are all exercised. The interpreter mishandles
bfloat16, so low precision is tested in float16 here and in bfloat16 by the ``gpu`` test.

Bounds are the committed float32 rows of parity_tests/TOLERANCES.md: the loss relative 1e-6 (per-token
log-probs: their largest difference relative to the largest log-prob), gradients per tensor relative
1e-5, entropy relative 1e-5; token accuracy exactly. ``rel_err`` is ``max|a - b| / max|b|``.
"""

import logging

import numpy as np
import pytest
import torch

pytest.importorskip("triton", reason="needs the triton package (in the dev extra): the kernel runs under its "
                                     "CPU interpreter")

from twinseq.common.run.capabilities import Runtime, check_runtime  # noqa: E402
from twinseq.common.config import ModelConfig, TrainConfig  # noqa: E402
from twinseq.common.errors import ConfigError  # noqa: E402
from twinseq.common.objectives.grpo import collate_completions  # noqa: E402
from twinseq.common.models.init import init_weights  # noqa: E402
from twinseq.common.run.memory_plan import plan_memory  # noqa: E402
from twinseq.torch_backend import grpo as tgrpo  # noqa: E402
from twinseq.torch_backend import triton_ce  # noqa: E402
from twinseq.torch_backend.logprobs import TargetRows, token_logps  # noqa: E402
from twinseq.torch_backend.losses import causal_lm_loss  # noqa: E402
from twinseq.torch_backend.model import build_model  # noqa: E402

IGN = -100


@pytest.fixture
def interpret(monkeypatch):
    """Run the kernels under Triton's interpreter for this test (read at every call, not at import)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def rel_err(a, b):
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-300))


def make_rows(n=37, V=101, D=40, seed=0, ignore=(3, 17), scale=2.0):
    """Hidden rows, an lm_head with logits of a few units (so a cap of 2 bends them), targets with -100s."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, D, generator=g, dtype=torch.float64)
    w = torch.randn(V, D, generator=g, dtype=torch.float64) * D ** -0.5 * scale
    t = torch.randint(0, V, (n,), generator=g)
    t[list(ignore)] = IGN
    return h, w, t


def reference(h64, w64, t, cap, g_logp, g_ent):
    """float64 autograd of the naive equivalent: (logp, entropy, hit, dh, dw)."""
    h64, w64 = h64.detach().clone().requires_grad_(), w64.detach().clone().requires_grad_()
    z = h64 @ w64.T
    if cap is not None:
        z = torch.tanh(z / cap) * cap
    logp_all = torch.log_softmax(z, -1)
    valid = t != IGN
    logp = torch.where(valid, logp_all.gather(1, t.clamp(min=0)[:, None])[:, 0], 0.0)
    ent = -(logp_all.exp() * logp_all).sum(-1)
    (logp * g_logp + torch.where(valid, ent, 0.0) * g_ent).sum().backward()
    hit = (z.argmax(-1) == t) & valid
    return logp.detach(), ent.detach(), hit, h64.grad, w64.grad


def run_kernel(h, w, t, cap, g_logp, g_ent, **kw):
    h, w = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    logp, ent, hit = triton_ce.linear_logps(h, w, t, logit_softcap=cap, with_entropy=True, **kw)
    (logp * g_logp.to(logp.dtype) + ent * g_ent.to(ent.dtype)).sum().backward()
    return logp.detach(), ent.detach(), hit, h.grad, w.grad


SHAPES = {"ragged_edges": dict(n=37, V=101, D=40), "whole_tiles": dict(n=32, V=64, D=32, ignore=(5,)),
          "one_row": dict(n=1, V=50, D=24, ignore=())}


@pytest.mark.parametrize("cap", [None, 2.0])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_fp32_kernel_matches_fp64_autograd(interpret, shape, cap):
    h64, w64, t = make_rows(**SHAPES[shape])
    g = torch.Generator().manual_seed(1)
    g_logp, g_ent = torch.randn(len(t), generator=g, dtype=torch.float64), torch.randn(len(t), generator=g,
                                                                                        dtype=torch.float64)
    want = reference(h64, w64, t, cap, g_logp, g_ent)
    logp, ent, hit, dh, dw = run_kernel(h64.float(), w64.float(), t, cap, g_logp, g_ent)
    valid = t != IGN
    assert rel_err(logp, want[0]) <= 1e-6
    assert (logp[~valid] == 0).all() and (dh[~valid] == 0).all()  # an ignored row neither scores nor learns
    assert rel_err(ent[valid], want[1][valid]) <= 1e-5
    assert torch.equal(hit.bool(), want[2])
    assert rel_err(dh, want[3]) <= 1e-5
    assert rel_err(dw, want[4]) <= 1e-5


def test_vocabulary_slices_add_up_to_the_whole_head(interpret, monkeypatch):
    h64, w64, t = make_rows(n=20, V=150, D=16)
    ones = torch.ones(len(t), dtype=torch.float64)
    whole = run_kernel(h64.float(), w64.float(), t, None, ones, ones)
    monkeypatch.setattr(triton_ce, "TRITON_DW_SLICE_BYTES", 32 * 16 * 4)  # 32 rows: 5 slices, the last 22 rows
    assert triton_ce._dw_chunk_rows(150, 16, 32) == 32
    sliced = run_kernel(h64.float(), w64.float(), t, None, ones, ones)
    for a, b in zip(sliced, whole):  # same tiles, same order of atomics within a tile row: bitwise
        assert torch.equal(a, b)


def test_fp16_kernel_is_within_half_precision_of_fp64(interpret, monkeypatch):
    """Low precision: inputs float16, logits and softmax float32, ``dz`` rounded to float16 before the two
    gradient matmuls (as bfloat16 on the GPU). The gradient bound is 10 units of float16 roundoff (10 x 2^-11),
    the per-tensor count of the bf16 gradient row; the lm_head gradient is accumulated in float32 slices."""
    h64, w64, t = make_rows(n=40, V=120, D=32)
    monkeypatch.setattr(triton_ce, "TRITON_DW_SLICE_BYTES", 64 * 32 * 4)
    h16, w16 = h64.half(), w64.half()
    ones = torch.ones(len(t), dtype=torch.float64)
    want = reference(h16.double(), w16.double(), t, None, ones, ones)
    logp, ent, hit, dh, dw = run_kernel(h16, w16, t, None, ones, ones)
    assert dh.dtype == torch.float16 and dw.dtype == torch.float16
    assert rel_err(logp, want[0]) <= 1e-5  # float32 logits of exactly representable inputs
    assert rel_err(dh, want[3]) <= 10 * 2 ** -11
    assert rel_err(dw, want[4]) <= 10 * 2 ** -11


def test_input_dtype_accumulation_is_float32_in_float32_and_within_half_precision_in_float16(interpret):
    """``accumulate="input"`` (cut cross-entropy's memory): gradients added straight into tensors of the inputs'
    dtype. In float32 that is the float32 path, bit for bit; in float16 every tile added rounds once more, still
    within the fp16 bound of the float32-buffer path (10 units of roundoff), and no float32 gradient exists."""
    h64, w64, t = make_rows(n=40, V=120, D=32)
    ones = torch.ones(len(t), dtype=torch.float64)
    exact32 = run_kernel(h64.float(), w64.float(), t, None, ones, ones)
    input32 = run_kernel(h64.float(), w64.float(), t, None, ones, ones, accumulate="input")
    for a, b in zip(input32, exact32):
        assert torch.equal(a, b)
    h16, w16 = h64.half(), w64.half()
    want = reference(h16.double(), w16.double(), t, None, ones, ones)
    logp, _, _, dh, dw = run_kernel(h16, w16, t, None, ones, ones, accumulate="input")
    assert dh.dtype == torch.float16 and dw.dtype == torch.float16
    assert rel_err(logp, want[0]) <= 1e-5
    assert rel_err(dh, want[3]) <= 10 * 2 ** -11
    assert rel_err(dw, want[4]) <= 10 * 2 ** -11
    with pytest.raises(ConfigError, match="accumulate='bf16'"):
        triton_ce.linear_logps(h16, w16, t, accumulate="bf16")


def test_frozen_head_skips_its_gradient(interpret):
    h64, w64, t = make_rows()
    h = h64.float().requires_grad_()
    logp, _, _ = triton_ce.linear_logps(h, w64.float(), t)
    logp.sum().backward()
    ones = torch.ones(len(t), dtype=torch.float64)
    assert rel_err(h.grad, reference(h64, w64, t, None, ones, 0 * ones)[3]) <= 1e-5


def test_gradient_filter_skips_only_tiny_tiles(interpret):
    """Skipping target-free tiles whose every softmax probability is < eps changes a gradient entry by at most
    eps x |upstream gradient| x (sum of the skipped |W| or |h| entries); the loss is untouched. The threshold is per
    unit of upstream gradient, so a tiny SFT scale (1 / tokens) does not make every tile look skippable."""
    h64, w64, t = make_rows(n=32, V=1024, D=16, scale=40.0)  # peaked softmax: most tiles hold p ~ 0
    t = t.remainder(32)  # and no target beyond the first tile
    scale = torch.full((len(t),), 1e-3, dtype=torch.float64)
    exact = run_kernel(h64.float(), w64.float(), t, None, scale, 0 * scale)
    eps = 1e-4
    filtered = run_kernel(h64.float(), w64.float(), t, None, scale, 0 * scale, filter_eps=eps)
    assert torch.equal(filtered[0], exact[0])
    dh_bound = 1e-3 * eps * w64.abs().sum(0).max().item()
    dw_bound = 1e-3 * eps * h64.abs().sum(0).max().item()
    assert 0 < (filtered[3] - exact[3]).abs().max() <= dh_bound  # > 0: some tile really was skipped
    assert (filtered[4] - exact[4]).abs().max() <= dw_bound
    assert triton_ce.resolve_filter_eps("auto", torch.bfloat16) == 2 ** -12
    with pytest.raises(ConfigError, match="filter_eps"):
        triton_ce.linear_logps(h64.float(), w64.float(), t, filter_eps=2)


def _loss_case(seed=0, B=2, T=41, H=24, V=90):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, H, generator=g)
    weight = torch.randn(V, H, generator=g) * H ** -0.5 * 2
    labels = torch.randint(0, V, (B, T), generator=g)
    labels[:, 0] = IGN
    labels[0, 10:18] = IGN  # a prompt span
    labels[1, 30] = IGN  # a packed document's first token: nothing predicts across the boundary
    return hidden, weight, labels


def _loss_and_grads(loss_type, hidden, weight, labels, **kw):
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss, metrics = causal_lm_loss(h, w, labels, int((labels[:, 1:] != IGN).sum()) + 3, loss_type,
                                   chunk_size=16, return_metrics=True, **kw)
    loss.backward()
    return loss.detach(), h.grad, w.grad, metrics


@pytest.mark.parametrize("cap", [None, 3.0])
def test_sft_loss_equals_fused_linear(interpret, cap):
    hidden, weight, labels = _loss_case()
    want = _loss_and_grads("fused_linear", hidden, weight, labels, logit_softcap=cap)
    got = _loss_and_grads("triton", hidden, weight, labels, logit_softcap=cap)
    assert rel_err(got[0], want[0]) <= 1e-6
    assert rel_err(got[1], want[1]) <= 1e-5 and rel_err(got[2], want[2]) <= 1e-5
    assert got[3]["num_tokens"] == want[3]["num_tokens"]
    assert got[3]["num_correct_tokens"] == want[3]["num_correct_tokens"]
    assert rel_err(got[3]["entropy"], want[3]["entropy"]) <= 1e-5


def test_without_cuda_or_interpreter_it_runs_fused_linear_and_says_so(monkeypatch, caplog):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    triton_ce.log_fallback_once.cache_clear()
    hidden, weight, labels = _loss_case()
    with caplog.at_level(logging.WARNING, logger="twinseq.torch_backend.triton_ce"):
        got = _loss_and_grads("triton", hidden, weight, labels)
    want = _loss_and_grads("fused_linear", hidden, weight, labels)
    for a, b in zip(got[:3], want[:3]):
        assert torch.equal(a, b)
    assert "using fused_linear" in caplog.text and "TRITON_INTERPRET=1" in caplog.text


def test_a_biased_head_falls_back_with_a_log(interpret, caplog):
    triton_ce.log_fallback_once.cache_clear()
    hidden, weight, labels = _loss_case()
    bias = torch.randn(weight.shape[0])
    with caplog.at_level(logging.WARNING, logger="twinseq.torch_backend.triton_ce"):
        got = causal_lm_loss(hidden, weight, labels, 100, "triton", lm_head_bias=bias)
    assert torch.equal(got, causal_lm_loss(hidden, weight, labels, 100, "fused_linear", lm_head_bias=bias))
    assert "bias" in caplog.text


def test_dpo_token_logps_equal_fused_linear(interpret):
    hidden, weight, labels = _loss_case(seed=3)
    N = hidden.shape[0] * hidden.shape[1]
    idx = torch.arange(0, N - 1, 3)
    rows = TargetRows(idx_n=idx, targets_n=labels.reshape(-1)[idx + 1].clamp(min=0),
                      doc_n=torch.zeros_like(idx), num_docs=1)
    g = torch.randn(len(idx), generator=torch.Generator().manual_seed(4))
    out = {}
    for loss_type in ("fused_linear", "triton"):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        logps = token_logps(h, w, rows, loss_type, chunk_size=16, logit_softcap=2.5)
        (logps * g).sum().backward()
        out[loss_type] = (logps.detach(), h.grad, w.grad)
    assert rel_err(out["triton"][0], out["fused_linear"][0]) <= 1e-6
    for a, b in zip(out["triton"][1:], out["fused_linear"][1:]):
        assert rel_err(a, b) <= 1e-5


@pytest.mark.slow  # fast-tier budget: runs in make test-all and CI
def test_grpo_log_probs_and_entropy_come_from_one_pass(interpret):
    cfg = ModelConfig.preset("tiny")
    model = build_model(cfg, init_weights(cfg, seed=0))
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(3, cfg.vocab_size, size=k)) for k in (4, 7)]
    completions = [rng.integers(3, cfg.vocab_size, size=k) for k in (3, 5)]
    cb = collate_completions(prompts, completions, padding_free=True, pad_token_id=0, num_columns=6)
    with torch.no_grad():
        want = tgrpo.completion_logps(model, cb, loss_type="fused_linear", with_entropy=True, temperature=0.8)
        got = tgrpo.completion_logps(model, cb, loss_type="triton", with_entropy=True, temperature=0.8)
    assert rel_err(got[0], want[0]) <= 1e-6
    assert rel_err(got[1], want[1]) <= 1e-5


def test_jax_refuses_the_torch_kernel_and_the_planner_drops_its_logits():
    cfg = TrainConfig.from_flat(loss_type="triton")
    with pytest.raises(ConfigError, match="jax backend use --loss-type fused_linear"):
        check_runtime(cfg, Runtime(backend="jax", device_type="cpu"))
    check_runtime(cfg, Runtime(backend="torch", device_type="cpu"))  # torch on CPU: fused_linear, logged
    rows = {}
    for loss_type, device in (("fused_linear", "cuda"), ("triton", "cuda"), ("triton", "cpu")):
        plan = plan_memory(TrainConfig.from_flat(loss_type=loss_type), device=device)
        rows[loss_type, device] = next(r.bytes for r in plan.rows if r.component.startswith("logits"))
    assert rows["triton", "cuda"] < rows["fused_linear", "cuda"]
    assert rows["triton", "cpu"] == rows["fused_linear", "cuda"]


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("cap", [None, 30.0])
def test_cuda_bf16_kernel_matches_fp32_nll_and_never_holds_the_logits(cap):
    """bfloat16 on the GPU, compiled, against the float32 ``nll`` path on the same rounded inputs: the loss to float32
    summation order, the gradients within the bf16 row (10 u relative: ``dz`` is rounded to bf16 before its two
    matmuls), and a peak far below one [n, V] float32 tensor."""
    hidden, weight, labels = (x.cuda() for x in _loss_case(B=4, T=1024, H=256, V=32000))
    hb, wb = hidden.bfloat16(), weight.bfloat16()
    want = _loss_and_grads("nll", hb.float(), wb.float(), labels, logit_softcap=cap)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    got = _loss_and_grads("triton", hb, wb, labels, logit_softcap=cap)
    peak = torch.cuda.max_memory_allocated() - base
    assert rel_err(got[0], want[0]) <= 1e-5  # bf16 x bf16 products are exact in the fp32 accumulators of both
    assert rel_err(got[1].float(), want[1]) <= 10 * 2 ** -8
    assert rel_err(got[2].float(), want[2]) <= 10 * 2 ** -8
    n, V = int((labels != IGN).sum()), weight.shape[0]
    assert peak < n * V * 4 / 4, f"peak {peak / 2**20:.0f} MiB vs one fp32 [n, V] {n * V * 4 / 2**20:.0f} MiB"


def test_tiles_tuned_elsewhere_come_from_a_file_and_bad_keys_are_named(tmp_path, monkeypatch):
    path = tmp_path / "tiles.json"
    path.write_text('{"fwd": {"BLOCK_V": 64}, "bwd": {"num_warps": 4}}')
    monkeypatch.setenv(triton_ce.TILES_ENV, str(path))
    assert triton_ce._tiles("cuda", "fwd") == {**triton_ce.GPU_FWD, "BLOCK_V": 64}
    assert triton_ce._tiles("cuda", "bwd") == {**triton_ce.GPU_BWD, "num_warps": 4}
    assert triton_ce._tiles("interpret", "fwd") == triton_ce.INTERPRETER_FWD  # the interpreter keeps its own
    bad = tmp_path / "bad.json"
    bad.write_text('{"fwd": {"BLOCK_M": 64}}')
    monkeypatch.setenv(triton_ce.TILES_ENV, str(bad))
    with pytest.raises(ConfigError, match=r"fwd has unknown keys \['BLOCK_M'\]"):
        triton_ce._tiles("cuda", "fwd")


def test_vocabulary_splits_cover_the_head_once():
    for n, V, sms in ((14751, 248320, 132), (1, 50, 132), (5000, 128256, 8), (100000, 300, 132)):
        splits, per = triton_ce.vocab_splits(n, V, triton_ce.GPU_FWD, sms)
        assert per % triton_ce.GPU_FWD["BLOCK_V"] == 0 and (splits - 1) * per < V <= splits * per


@pytest.mark.slow  # fast-tier budget: runs in make test-all and CI
def test_the_sft_loss_takes_cces_numerics_when_asked(interpret, monkeypatch):
    """``triton_gradients='cce'`` (the loss section's knob) runs the kernel with the gradient filter and input-dtype
    accumulation: the loss is unchanged, the gradients are those of ``linear_logps(filter_eps='auto', accumulate=
    'input')``; the knob is refused with another loss type."""
    h64, w64, t = make_rows(n=32, V=1024, D=16, scale=40.0)  # peaked: most tiles are filtered
    t = t.remainder(32)  # every target in the first tile
    hidden, weight = h64.float()[None], w64.float()
    labels = torch.cat([torch.tensor([IGN]), t[:-1]])[None]  # shifted back: target i of row i is labels[i + 1]
    got, exact, seen = {}, {}, []
    real = triton_ce.linear_logps
    monkeypatch.setattr(triton_ce, "linear_logps", lambda *a, **kw: seen.append(kw) or real(*a, **kw))
    for mode, out in (("cce", got), ("exact", exact)):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        loss = causal_lm_loss(h, w, labels, 40, "triton", triton_gradients=mode)
        loss.backward()
        out.update(loss=loss.detach(), dh=h.grad, dw=w.grad)
    h, w = hidden[0].clone().requires_grad_(), weight.clone().requires_grad_()
    targets = torch.cat([labels[0, 1:], torch.tensor([IGN])])
    (-triton_ce.linear_logps(h, w, targets, filter_eps="auto", accumulate="input")[0].sum() / 40).backward()
    assert torch.equal(got["loss"], exact["loss"])
    assert torch.equal(got["dh"][0], h.grad) and torch.equal(got["dw"], w.grad)
    assert [(kw["filter_eps"], kw["accumulate"]) for kw in seen[:2]] == [("auto", "input"), (None, "float32")]
    with pytest.raises(ConfigError, match="triton_gradients='cce' is read by loss_type='triton' only"):
        TrainConfig.from_flat(triton_gradients="cce", loss_type="fused_linear")
