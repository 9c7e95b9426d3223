"""torch_backend/losses.py: the four loss paths compute the numpy reference's number.

Relative error below is ``max|a - b| / max|b|`` over the whole tensor (an elementwise rtol
would be meaningless for gradient entries that are ~0).
"""

import importlib.util
import logging
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from twinseq.common.objectives import nll as ref
from twinseq.common.config import LOSS_TYPES
from twinseq.torch_backend.losses import causal_lm_loss

IGN = -100
CPU_LOSSES = ("nll", "chunked_nll", "fused_linear")
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True, scope="module")
def _two_threads():
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(old)


def rel_err(a, b):
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-300))


def make_case(B=2, T=37, H=16, V=50, seed=0, dtype=torch.float32, bias=False, ignore=()):
    """Random hidden/lm_head/labels. ``ignore``: (row, start, stop) label ranges set to -100."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, H, generator=g, dtype=torch.float64)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64) * H ** -0.5 * 2
    b = torch.randn(V, generator=g, dtype=torch.float64) if bias else None
    labels = torch.randint(0, V, (B, T), generator=g)
    labels[:, 0] = IGN
    for row, start, stop in ignore:
        labels[row, start:stop] = IGN
    cast = (lambda t: None if t is None else t.to(dtype))
    return cast(hidden), cast(weight), cast(b), labels


def loss_and_grads(loss_type, hidden, weight, labels, num_items, bias=None, chunk_size=8, **kw):
    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    b = None if bias is None else bias.clone().requires_grad_()
    loss = causal_lm_loss(h, w, labels, num_items, loss_type, chunk_size=chunk_size, lm_head_bias=b, **kw)
    loss.backward()
    return loss.detach(), h.grad, w.grad, (None if b is None else b.grad)


def count(labels):
    return int((labels[:, 1:] != IGN).sum())


CASES = {
    # chunk_size 8 over 37 or 74 rows: the chunks never divide N
    "uneven_chunks": dict(),
    "ignored_chunk_in_middle": dict(B=1, T=48, ignore=[(0, 16, 33)]),
    "n_below_chunk": dict(B=1, T=5),
    "with_bias": dict(bias=True),
    "padding_rows": dict(B=3, ignore=[(1, 20, 37), (2, 30, 37)]),
}


@pytest.mark.parametrize("loss_type", ["chunked_nll", "fused_linear"])
@pytest.mark.parametrize("case", list(CASES))
def test_chunked_and_fused_match_nll_fp32(loss_type, case):
    hidden, weight, bias, labels = make_case(**CASES[case])
    chunk = 256 if case == "n_below_chunk" else 8
    n = count(labels) + 5  # the step holds other micro-batches too
    want = loss_and_grads("nll", hidden, weight, labels, n, bias)
    got = loss_and_grads(loss_type, hidden, weight, labels, n, bias, chunk_size=chunk)
    for g, w in zip(got, want):
        if w is not None:
            assert rel_err(g, w) <= 1e-5
    hidden64, weight64, bias64, _ = make_case(**CASES[case], dtype=torch.float64)
    exact = loss_and_grads("nll", hidden64, weight64, labels, n, bias64)
    for g, w in zip(got, exact):  # and against the fp64 truth
        if w is not None:
            assert rel_err(g, w) <= 1e-5


@pytest.mark.parametrize("loss_type", CPU_LOSSES)
def test_fp64_paths_agree_to_rounding(loss_type):
    hidden, weight, bias, labels = make_case(dtype=torch.float64, bias=True, ignore=[(0, 3, 20)])
    want = loss_and_grads("nll", hidden, weight, labels, count(labels), bias)
    got = loss_and_grads(loss_type, hidden, weight, labels, count(labels), bias, chunk_size=7)
    for g, w in zip(got, want):
        assert rel_err(g, w) <= 1e-13


@pytest.mark.parametrize("loss_type", CPU_LOSSES)
def test_all_ignored_microbatch_gives_zero_loss_and_zero_grads(loss_type):
    hidden, weight, bias, labels = make_case(bias=True, ignore=[(0, 0, 37), (1, 0, 37)])
    loss, gh, gw, gb = loss_and_grads(loss_type, hidden, weight, labels, num_items=12, bias=bias)
    assert loss.item() == 0.0
    for g in (gh, gw, gb):
        assert g is not None and torch.isfinite(g).all() and (g == 0).all()


@pytest.mark.parametrize("loss_type", CPU_LOSSES)
def test_zero_items_for_the_whole_step_returns_zero_and_warns(loss_type, caplog):
    hidden, weight, _, labels = make_case(B=1, T=6)
    labels[:] = IGN
    with caplog.at_level(logging.WARNING, logger="twinseq.torch_backend.losses"):
        loss, gh, gw, _ = loss_and_grads(loss_type, hidden, weight, labels, num_items=0)
    assert loss.item() == 0.0 and (gh == 0).all() and (gw == 0).all()
    assert "num_items_in_batch=0" in caplog.text


@pytest.mark.parametrize("loss_type", CPU_LOSSES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_matches_numpy_reference(loss_type, dtype):
    hidden, weight, bias, labels = make_case(B=3, T=21, bias=True, ignore=[(1, 5, 21)], dtype=dtype)
    n = count(labels) + 3
    loss, metrics = causal_lm_loss(hidden, weight, labels, n, loss_type, chunk_size=4, return_metrics=True,
                                   lm_head_bias=bias)
    logits = (hidden.double() @ weight.double().T + bias.double()).numpy()
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    assert loss.item() == pytest.approx(ref.nll_loss(logits, labels.numpy(), n), rel=tol)
    want = ref.metrics(logits, labels.numpy())
    assert metrics["num_tokens"] == want["num_tokens"] == count(labels)
    assert metrics["mean_token_accuracy"] == pytest.approx(want["mean_token_accuracy"], abs=1e-12)
    assert metrics["entropy"] == pytest.approx(want["entropy"], rel=tol)
    assert metrics["entropy_sum"] == pytest.approx(want["entropy"] * want["num_tokens"], rel=tol)


@pytest.mark.parametrize("loss_type", CPU_LOSSES)
def test_metrics_of_all_ignored_batch_are_zero(loss_type):
    hidden, weight, _, labels = make_case(ignore=[(0, 0, 37), (1, 0, 37)])
    _, m = causal_lm_loss(hidden, weight, labels, 3, loss_type, return_metrics=True)
    assert (m["mean_token_accuracy"], m["entropy"], m["num_tokens"]) == (0.0, 0.0, 0)


def _accumulated_grads(loss_type, hidden, weight, labels, micro_batch, per_micro_batch_mean=False):
    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    total, step_loss = count(labels), 0.0
    for start in range(0, labels.shape[0], micro_batch):
        part = slice(start, start + micro_batch)
        n = count(labels[part]) if per_micro_batch_mean else total
        loss = causal_lm_loss(h[part], w, labels[part], n, loss_type, chunk_size=8)
        if per_micro_batch_mean:  # the peers' bug: a mean of means
            loss = loss / (labels.shape[0] // micro_batch)
        loss.backward()
        step_loss += loss.item()
    return step_loss, h.grad, w.grad


@pytest.mark.parametrize("loss_type", CPU_LOSSES)
def test_gradient_accumulation_is_split_invariant(loss_type):
    """ANCHORS failure 8: 1x8, 8x1 and 4x2 micro-batches give the same step, with uneven
    label counts per sequence."""
    hidden, weight, _, labels = make_case(B=8, T=24, dtype=torch.float64)
    for row, keep in enumerate([23, 2, 15, 7, 20, 1, 11, 5]):
        labels[row, keep + 1:] = IGN
    whole = _accumulated_grads(loss_type, hidden, weight, labels, 8)
    for micro in (1, 2):
        split = _accumulated_grads(loss_type, hidden, weight, labels, micro)
        assert split[0] == pytest.approx(whole[0], rel=1e-6)
        assert rel_err(split[1], whole[1]) <= 1e-6 and rel_err(split[2], whole[2]) <= 1e-6
    wrong = _accumulated_grads(loss_type, hidden, weight, labels, 1, per_micro_batch_mean=True)
    assert abs(wrong[0] - whole[0]) / whole[0] > 1e-2  # the invariant is not vacuous


class _MaxNumel(TorchDispatchMode):
    """Records the largest tensor any aten op creates (forward and backward)."""

    def __init__(self):
        super().__init__()
        self.max_numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else [out]):
            if isinstance(t, torch.Tensor):
                self.max_numel = max(self.max_numel, t.numel())
        return out


def _largest_created_and_saved(loss_type, N, H, V, chunk):
    hidden, weight, _, labels = make_case(B=1, T=N, H=H, V=V, ignore=[(0, N // 3, N // 2)])
    h, w = hidden.requires_grad_(), weight.requires_grad_()
    saved = []

    def pack(t):
        saved.append(t.numel())
        return t

    with _MaxNumel() as mode, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        causal_lm_loss(h, w, labels, count(labels), loss_type, chunk_size=chunk).backward()
    return mode.max_numel, max(saved, default=0)


@pytest.mark.parametrize("loss_type", ["fused_linear", "chunked_nll"])
def test_no_full_logits_in_forward_or_backward(loss_type):
    N, H, V, chunk = 512, 8, 1000, 32
    created, saved = _largest_created_and_saved(loss_type, N, H, V, chunk)
    assert created <= max(chunk * V, V * H) < N * V
    assert saved < N * V
    # control: the plain path does build [N, V] tensors, so the probe can see them
    created_nll, saved_nll = _largest_created_and_saved("nll", N, H, V, chunk)
    assert created_nll >= N * V and saved_nll >= N * V


def _load_memory_helper():
    spec = importlib.util.spec_from_file_location("_memory", REPO / "benchmarks" / "_memory.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
def test_fused_peak_rss_is_far_below_full_logits():
    """Fresh subprocesses, peak RSS above the baseline (benchmarks/_memory.py): logits are
    4096 x 16384 fp32 = 256 MiB; the fused loss should need ~ one chunk + the [V, H] grad."""
    mem = _load_memory_helper()
    script = REPO / "benchmarks" / "loss_memory.py"
    shape = dict(tokens=4096, hidden=32, vocab=16384, dtype="float32", device="cpu", threads=2)
    peaks = {lt: mem.measure_in_subprocess(script, "setup", "run", {**shape, "loss_type": lt},
                                           num_threads=2, timeout=300)["peak_above_baseline_bytes"]
             for lt in ("nll", "fused_linear")}
    logits_bytes = 4096 * 16384 * 4
    assert peaks["nll"] >= 2 * logits_bytes  # the probe sees the full logits and their gradient
    assert peaks["fused_linear"] <= logits_bytes / 4
    assert peaks["fused_linear"] * 8 <= peaks["nll"]


def test_fused_backward_scales_by_grad_output_and_runs_once():
    hidden, weight, _, labels = make_case()
    _, gh, gw, _ = loss_and_grads("fused_linear", hidden, weight, labels, count(labels))
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = causal_lm_loss(h, w, labels, count(labels), "fused_linear", chunk_size=8)
    (loss * -2.5).backward(retain_graph=True)
    assert rel_err(h.grad, -2.5 * gh) <= 1e-6 and rel_err(w.grad, -2.5 * gw) <= 1e-6
    with pytest.raises(RuntimeError, match="once"):
        loss.backward()


def test_fused_frozen_lm_head_gives_hidden_grad_only():
    hidden, weight, _, labels = make_case()
    _, want_h, _, _ = loss_and_grads("nll", hidden, weight, labels, count(labels))
    h = hidden.clone().requires_grad_()
    causal_lm_loss(h, weight, labels, count(labels), "fused_linear", chunk_size=8).backward()
    assert weight.grad is None and rel_err(h.grad, want_h) <= 1e-5


def test_fused_under_no_grad_gives_the_same_loss():
    hidden, weight, _, labels = make_case()
    want = causal_lm_loss(hidden, weight, labels, count(labels), "nll")
    with torch.no_grad():
        got = causal_lm_loss(hidden.requires_grad_(), weight, labels, count(labels), "fused_linear")
    assert got.item() == pytest.approx(want.item(), rel=1e-6) and not got.requires_grad


@pytest.mark.parametrize("loss_type", ["nll", "fused_linear", "chunked_nll"])
def test_bf16_is_close_to_fp32_on_the_same_rounded_inputs(loss_type):
    """bf16 matmuls, fp32 softmax/accumulation: within a few bf16 ulps (2^-8 = 3.9e-3)."""
    hidden, weight, _, labels = make_case(B=2, T=64, H=32, V=96, dtype=torch.bfloat16)
    got = loss_and_grads(loss_type, hidden, weight, labels, count(labels), chunk_size=16)
    want = loss_and_grads("nll", hidden.double(), weight.double(), labels, count(labels))
    assert got[0].dtype == torch.float32 and got[1].dtype == got[2].dtype == torch.bfloat16
    assert rel_err(got[0], want[0]) <= 4e-3
    assert rel_err(got[1], want[1]) <= 2e-2 and rel_err(got[2], want[2]) <= 2e-2


def test_unknown_loss_type_lists_allowed_values():
    hidden, weight, _, labels = make_case()
    with pytest.raises(ValueError) as err:
        causal_lm_loss(hidden, weight, labels, 10, "cut_ce")
    assert all(name in str(err.value) for name in LOSS_TYPES)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU error; CUDA is present")
def test_liger_without_cuda_names_the_extra():
    hidden, weight, _, labels = make_case()
    with pytest.raises(ValueError, match=r"pip install -e '\.\[gpu\]'"):
        causal_lm_loss(hidden, weight, labels, count(labels), "liger")


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(num_items_in_batch=3), ValueError, "smaller than"),
    (dict(num_items_in_batch=-1), ValueError, "non-negative"),
    (dict(chunk_size=0), ValueError, "chunk_size"),
    (dict(labels_BT="float"), TypeError, "integer"),
    (dict(labels_BT="out_of_vocab"), ValueError, "outside the vocabulary"),
    (dict(lm_head_weight_VH="transposed"), ValueError, r"\[V, H\]"),
])
def test_bad_inputs_raise_with_the_field(kwargs, exc, match):
    hidden, weight, _, labels = make_case()
    args = dict(hidden_BTH=hidden, lm_head_weight_VH=weight, labels_BT=labels,
                num_items_in_batch=count(labels), loss_type="fused_linear")
    replacements = {"float": labels.float(), "out_of_vocab": labels.masked_fill(labels == labels[0, 5], 50),
                    "transposed": weight.T}
    args.update({k: replacements.get(v, v) if isinstance(v, str) else v for k, v in kwargs.items()})
    with pytest.raises(exc, match=match):
        causal_lm_loss(**args)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
needs_liger = pytest.mark.skipif(importlib.util.find_spec("liger_kernel") is None,
                                 reason="needs liger-kernel: pip install -e '.[gpu]'")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("loss_type", ["fused_linear", "chunked_nll", pytest.param("liger", marks=needs_liger)])
def test_cuda_paths_match_nll(loss_type, monkeypatch):
    hidden, weight, _, labels = make_case(B=2, T=300, H=64, V=512, ignore=[(0, 50, 120)])
    hidden, weight, labels = hidden.cuda(), weight.cuda(), labels.cuda()
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)  # parity needs true fp32 matmuls
    want = loss_and_grads("nll", hidden, weight, labels, count(labels))
    got = loss_and_grads(loss_type, hidden, weight, labels, count(labels), chunk_size=64)
    for g, w in zip(got[:3], want[:3]):
        assert rel_err(g, w) <= 1e-5
