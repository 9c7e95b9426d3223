"""Activation offloading: same gradients, nothing left behind, non-contiguous tensors, Liger region.

On CPU the offloader refuses; ``allow_cpu_for_testing`` runs the same bookkeeping with a
plain host copy, which is what the CPU tests exercise. CUDA tests are marked ``gpu``.
"""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

from twinseq.common.data.batching import collate
from twinseq.common.config import ModelConfig
from twinseq.common.models.init import init_weights
from twinseq.torch_backend.model import build_model, compute_loss
from twinseq.torch_backend.memory import ActivationOffloader, offload_activations


@pytest.fixture(scope="module")
def cfg():
    return ModelConfig.preset("tiny")


@pytest.fixture(scope="module")
def weights(cfg):
    return init_weights(cfg, seed=0)


@pytest.fixture(scope="module")
def batches(cfg):
    rng = np.random.default_rng(0)
    out = []
    for step in range(3):
        docs = [{"input_ids": rng.integers(3, cfg.vocab_size, n).tolist()} for n in rng.integers(5, 40, 4)]
        out.append(collate(docs, padding_free=True))
    return out


def grads_of(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def train_steps(model, batches, offloader=None, loss_type="nll"):
    """Forward + loss + backward per batch, inside the offloader like the trainer does."""
    per_step, live_after = [], []
    for batch in batches:
        model.zero_grad(set_to_none=True)
        if offloader is None:
            compute_loss(model, batch, loss_type).backward()
        else:
            with offloader:
                compute_loss(model, batch, loss_type).backward()
            live_after.append(offloader.live_stashed)
        per_step.append(grads_of(model))
    return per_step, live_after


def test_refuses_on_cpu(cfg, weights):
    model = build_model(cfg, weights)
    with pytest.raises(ValueError, match="activations already live in host memory"):
        offload_activations(model, loss_type="nll")


def test_same_gradients_and_no_leak_across_steps(cfg, weights, batches):
    model = build_model(cfg, weights, attn_implementation="varlen")
    ref, _ = train_steps(model, batches)
    offloader = ActivationOffloader(model, allow_cpu_for_testing=True)
    got, live_after = train_steps(model, batches, offloader)
    assert offloader.stats.num_offloaded > 0, "the test must actually offload something"
    assert live_after == [0] * len(batches), "stashed tensors must not outlive their backward (TRL #5700)"
    for step_ref, step_got in zip(ref, got):
        for name in step_ref:
            torch.testing.assert_close(step_got[name], step_ref[name], rtol=0, atol=0)


def test_graph_dropped_without_backward_releases_the_stash(cfg, weights, batches):
    model = build_model(cfg, weights)
    offloader = ActivationOffloader(model, allow_cpu_for_testing=True)
    with offloader:
        loss = compute_loss(model, batches[0])
    assert offloader.live_stashed > 0
    del loss
    gc.collect()
    assert offloader.live_stashed == 0


def test_parameters_and_tiny_tensors_stay(cfg, weights, batches):
    model = build_model(cfg, weights)
    offloader = ActivationOffloader(model, allow_cpu_for_testing=True, min_offload_bytes=1 << 30)
    with offloader:
        compute_loss(model, batches[0]).backward()
    assert offloader.stats.num_offloaded == 0 and offloader.stats.num_kept > 0
    offloader = ActivationOffloader(model, allow_cpu_for_testing=True)
    param_shapes = {tuple(p.shape) for p in model.parameters()} | {tuple(p.t().shape) for p in model.parameters()}
    with offloader:
        compute_loss(model, batches[0]).backward()
    assert not set(offloader.stats.shapes) & param_shapes, "weights (and their .t() views) are never offloaded"


def test_loss_region_is_not_offloaded(cfg, weights, batches):
    """Only the decoder's tensors move; the lm_head/loss region (Liger writes in place) keeps its own."""
    model = build_model(cfg, weights)
    offloader = ActivationOffloader(model, allow_cpu_for_testing=True, loss_type="liger")
    with offloader:
        compute_loss(model, batches[0], "nll").backward()
    assert offloader.stats.num_offloaded > 0
    assert all(cfg.vocab_size not in shape for shape in offloader.stats.shapes), "logits were offloaded"
    everything = ActivationOffloader(device="cpu", allow_cpu_for_testing=True)
    with everything:
        compute_loss(model, batches[0], "nll").backward()
    assert any(cfg.vocab_size in shape for shape in everything.stats.shapes), "control: without a region they are"


def test_liger_without_region_is_refused():
    with pytest.raises(ValueError, match="modifies its input in place"):
        ActivationOffloader(device="cpu", allow_cpu_for_testing=True, loss_type="liger")


def test_paused_keeps_tensors_in_place():
    offloader = ActivationOffloader(device="cpu", allow_cpu_for_testing=True)
    x = torch.randn(64, 64, requires_grad=True)
    with offloader, offloader.paused():
        (x.exp() * 2).sum().backward()
    assert offloader.stats.num_offloaded == 0


@pytest.mark.parametrize("min_offload_bytes", [0, 1 << 30], ids=["offloaded", "kept"])
def test_in_place_change_after_save_raises(min_offload_bytes):
    """What Liger's in-place kernel would do to a saved tensor is caught, as autograd would."""
    offloader = ActivationOffloader(device="cpu", allow_cpu_for_testing=True, min_offload_bytes=min_offload_bytes)
    x = torch.randn(64, 64, requires_grad=True)
    with offloader:
        y = x * 1.0
        z = y.sin()  # saves y
        y.mul_(2.0)
        with pytest.raises(RuntimeError, match="modified in place after it was saved"):
            z.sum().backward()


def _non_contiguous_graph(x, w):
    t = x.t()                              # transpose: dense, strides kept
    e = x[:, :1].expand(-1, x.shape[1])    # expand: overlapping, stored contiguous
    s = x[:, ::2]                          # step slice: gaps, stored contiguous
    return (t.sin() * w.t()).sum() + (e * w).sum() + (s.cos() * w[:, ::2]).sum()


def test_non_contiguous_saved_tensors(cfg):
    """TRL #5694: transposed, expanded and strided views survive the round trip with right gradients."""
    torch.manual_seed(0)
    x0, w = torch.randn(48, 32), torch.randn(48, 32, requires_grad=True)
    x = x0.clone().requires_grad_()
    _non_contiguous_graph(x, w).backward()
    ref = (x.grad.clone(), w.grad.clone())
    x.grad, w.grad = None, None
    offloader = ActivationOffloader(device="cpu", allow_cpu_for_testing=True)
    with offloader:
        _non_contiguous_graph(x, w).backward()
    assert offloader.stats.num_offloaded >= 3
    torch.testing.assert_close(x.grad, ref[0], rtol=0, atol=0)
    torch.testing.assert_close(w.grad, ref[1], rtol=0, atol=0)
    assert offloader.live_stashed == 0


class _KeepsStrides(torch.autograd.Function):
    """Saves its input and, in backward, records the strides it gets back."""
    seen: list = []

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.sum()

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        _KeepsStrides.seen.append(x.stride())
        return g.expand(x.shape).clone()


def test_row_padded_view_comes_back_with_its_strides():
    """SDPA's memory-efficient kernel saves a row-padded attention bias (an [.., L, L] view of [.., L, L + pad]) and
    its backward refuses another row stride (the GPU lane's "attn_bias is not correctly aligned (strideH)"): the
    round trip keeps the strides; a sparse step slice comes back contiguous. The gradients are the plain run's."""
    offloader = ActivationOffloader(device="cpu", allow_cpu_for_testing=True)
    _KeepsStrides.seen.clear()
    views = ((2, 1, 97, 104), lambda b: b[..., :97]), ((64, 64), lambda b: b[:, ::8]), \
        ((2, 1, 97, 104), lambda b: b[..., :97].expand(2, 3, 97, 97))  # as SDPA saves it: padded, over heads
    for shape, view in views:
        base = torch.randn(shape, requires_grad=True)
        with offloader:
            _KeepsStrides.apply(view(base)).backward()
        expected = torch.zeros(shape)
        expected.requires_grad_()
        view(expected).sum().backward()
        assert torch.equal(base.grad, expected.grad)
    assert offloader.stats.num_offloaded == 3
    assert _KeepsStrides.seen[0] == (97 * 104, 97 * 104, 104, 1)  # the padded rows: mirrored
    assert _KeepsStrides.seen[1] == (8, 1)  # 8x the elements it holds: stored contiguous
    assert _KeepsStrides.seen[2] == (97 * 104, 0, 104, 1)  # one copy, expanded over the heads again
    assert offloader.live_stashed == 0


# --------------------------------------------------------------------------------------
# CUDA
# --------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("loss_type", ["nll", "liger"])
def test_cuda_offload_same_gradients_no_leak(cfg, weights, batches, loss_type):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if loss_type == "liger":
        pytest.importorskip("liger_kernel", reason="liger-kernel not installed (pip install -e '.[gpu]')")
    model = build_model(cfg, weights, attn_implementation="sdpa", device="cuda")
    ref, _ = train_steps(model, batches, loss_type=loss_type)
    offloader = ActivationOffloader(model, loss_type=loss_type)
    got, live_after = train_steps(model, batches, offloader, loss_type=loss_type)
    assert offloader.stats.num_offloaded > 0 and live_after == [0] * len(batches)
    for step_ref, step_got in zip(ref, got):
        for name in step_ref:
            torch.testing.assert_close(step_got[name], step_ref[name], rtol=1e-5, atol=1e-7)
