"""Long context without quadratic memory on the torch backend: blocked attention, allgather CP, tiled MLP.

Invariants:
- The blocked kernel (online softmax over key blocks, backward recomputed block by block) equals the
  dense document-masked attention within 1e-5 (fp32) for the output and dq, dk, dv: packed documents
  with padding, GQA, sliding window, soft-capped scores, T not a multiple of the block; padding
  queries get a zero output.
- The same kernel as the ``allgather`` CP attention (local zigzag queries against the gathered keys)
  equals the dense attention of the whole row, and none of its temporaries is O(T/cp x T).
- A whole model on the blocked path (sdpa rows past ``BLOCKED_MIN_SEQ_LEN``) gives the dense path's
  loss and gradients; short batches after the switch stay bit-identical to sdpa.
- Tiled MLP: loss and gradients equal the untiled model (Llama, Qwen2, Gemma 2).
- ``fused_linear`` under bf16 autocast on CPU runs (it crashed in ``index_copy_``) and matches ``nll``.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from twinseq.common.data.batching import collate
from twinseq.common.config import ModelConfig
from twinseq.common.data.context_parallel import cp_permutation
from twinseq.common.models.init import init_weights
from twinseq.torch_backend import attention as A
from twinseq.torch_backend import blocked_attention as BA
from twinseq.torch_backend import context_parallel as cpmod
from twinseq.torch_backend.losses import causal_lm_loss
from twinseq.torch_backend.memory import apply_tiled_mlp
from twinseq.torch_backend.model import build_model, compute_loss, loss_and_grads

TOL = 1e-5


def _ids(lengths_per_row, pad_to):
    """segment/position ids [B, T] of rows holding documents of the given lengths, right-padded to ``pad_to``."""
    seg = np.zeros((len(lengths_per_row), pad_to), np.int64)
    pos = np.zeros_like(seg)
    for b, lengths in enumerate(lengths_per_row):
        t = 0
        for s, n in enumerate(lengths, start=1):
            seg[b, t:t + n], pos[b, t:t + n] = s, np.arange(n)
            t += n
    return torch.as_tensor(seg), torch.as_tensor(pos)


def _dense(q, k, v, seg, pos, scaling, window, cap):
    allowed = A.allowed_mask(seg, pos, window)[:, None]
    return A.softcapped_attention(q, k, v, allowed, scaling, cap)


@pytest.mark.parametrize("window, cap", [(None, None), (6, None), (None, 2.0), (5, 3.0)])
def test_blocked_kernel_equals_dense(window, cap):
    seg, pos = _ids([[9, 20, 6], [3, 40]], pad_to=45)  # T = 45: not a multiple of the block (8)
    B, T = seg.shape
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, n, T, 16, generator=gen) for n in (4, 2, 2))  # GQA: 2 query heads per K/V head
    grad = torch.randn(B, 4, T, 16, generator=gen) * (seg != 0)[:, None, :, None]  # padding rows: no gradient
    got, want = [], []
    for fn, sink in ((lambda *a: BA.blocked_attention(*a[:3], BA.BlockedPlan(seg, pos, seg, pos, 8), 0.3, window,
                                                      cap)), got), \
                    ((lambda *a: _dense(*a, seg, pos, 0.3, window, cap)), want):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        out = fn(*leaves)
        sink.extend([out.detach(), *torch.autograd.grad((out * grad).sum(), leaves)])
    real = (seg != 0)[:, None, :, None]
    assert float((got[0] * ~real).abs().max()) == 0.0, "padding queries must get a zero output"
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        if name == "out":
            g, w = g * real, w * real
        err = float((g - w).abs().max())
        assert err < TOL, f"{name}: {err:.2e}"
    assert float(want[0].abs().max()) > 0.1  # the comparison is not between zeros


def test_blocked_plan_skips_masked_block_pairs():
    """Causal single-document row: query block i meets key blocks 0..i only; two documents in separate
    blocks never meet; a window drops the far key blocks."""
    seg, pos = _ids([[32]], pad_to=32)
    plan = BA.BlockedPlan(seg, pos, seg, pos, 8)
    # (key block, full): a block pair below the diagonal needs no mask, the diagonal one does
    assert plan.pairs(None) == [[(0, False)], [(0, True), (1, False)], [(0, True), (1, True), (2, False)],
                                [(0, True), (1, True), (2, True), (3, False)]]
    assert plan.pairs(8) == [[(0, False)], [(0, False), (1, False)], [(1, False), (2, False)],
                             [(2, False), (3, False)]]
    assert plan.pairs(16)[3] == [(1, False), (2, True), (3, False)]
    seg2, pos2 = _ids([[16, 15]], pad_to=32)  # the last block holds a padding token: never full
    assert BA.BlockedPlan(seg2, pos2, seg2, pos2, 8).pairs(None) == [[(0, False)], [(0, True), (1, False)],
                                                                    [(2, False)], [(2, False), (3, False)]]


@pytest.mark.parametrize("cp", [2, 4])
def test_blocked_cp_queries_against_gathered_keys_equal_dense(cp):
    """Each rank's zigzag queries against the whole (reordered) row of keys == that rank's rows of the dense
    attention, documents crossing the shard boundaries, with a window and a soft-cap."""
    seg, pos = _ids([[30, 20, 11], [64]], pad_to=64)
    B, T = seg.shape
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(B, n, T, 8, generator=gen, dtype=torch.float64) for n in (4, 2, 2))
    for window, cap in ((None, None), (7, 5.0)):
        dense = _dense(q, k, v, seg, pos, 0.3, window, cap)
        perm, L = torch.as_tensor(cp_permutation(T, cp)), T // cp
        for rank in range(cp):
            mine = perm[rank * L:(rank + 1) * L]
            plan = BA.BlockedPlan(seg[:, mine], pos[:, mine], seg[:, perm], pos[:, perm], 4)
            out = BA.blocked_attention(q[:, :, mine], k[:, :, perm], v[:, :, perm], plan, 0.3, window, cap)
            real = (seg[:, mine] != 0)[:, None, :, None]
            assert float(((out - dense[:, :, mine]).abs() * real).max()) < TOL, (rank, window, cap)


class _LargestTensor(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the largest tensor any op produces (forward and backward)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_allgather_attention_temporaries_are_linear_in_the_local_length():
    """Structural memory property of the allgather CP attention: with T/cp local queries against T keys and
    blocks of b tokens, no tensor in forward or backward is as large as the [B, T/cp, T] mask the dense path
    builds; the largest is the gathered K/V or a [B, H, b, b] block pair (the dense path's is H x the mask)."""
    T, cp, block, B, H, KV, D = 256, 2, 16, 1, 4, 2, 8
    seg, pos = _ids([[100, 156]], pad_to=T)
    perm, L = torch.as_tensor(cp_permutation(T, cp)), T // cp
    mine = perm[:L]
    shard = cpmod.CPShard(seg[:, mine], seg[:, mine], pos[:, mine], seg[:, mine], 1, cp, 0)
    ctx = cpmod.CPAttentionContext(None, BA.BlockedPlan(seg[:, mine], pos[:, mine], seg[:, perm], pos[:, perm],
                                                        block))
    q = torch.randn(B, H, L, D, requires_grad=True)
    k, v = (torch.randn(B, KV, T, D, requires_grad=True) for _ in range(2))
    module = torch.nn.Module()
    module._twinseq_attention_block_size = block
    with _LargestTensor() as mode:
        out, _ = cpmod.allgather_attention_forward(module, q, k, v, None, **{cpmod.CP_KWARG: ctx})
        out.sum().backward()
    bound = max(B * KV * T * D, B * H * L * D, B * H * block * block)
    assert mode.largest <= bound, (mode.largest, bound)
    assert shard.num_tokens == L
    with _LargestTensor() as dense_mode:  # the check can fail: the dense path does exceed it
        allowed = cpmod.cp_allowed_mask(seg[:, mine], pos[:, mine], seg[:, perm], pos[:, perm], 0)
        cpmod.local_document_attention(q, k, v, allowed, None).sum().backward()
    assert dense_mode.largest >= B * L * T > bound


# --------------------------------------------------------------------------------------
# The whole model on the blocked path
# --------------------------------------------------------------------------------------


def _assert_grads_close(got, want, rel=TOL):
    for name in want:
        scale = max(float(np.abs(want[name]).max()), 1e-6)
        err = float(np.abs(got[name] - want[name]).max()) / scale
        assert err < rel, f"{name}: relative error {err:.2e}"


@pytest.mark.parametrize("preset", ["tiny", "tiny-gemma2", "tiny-gemma3"])
def test_model_on_blocked_path_equals_dense(preset, monkeypatch, caplog):
    """Llama (sdpa), Gemma 2 (eager: window on one layer, soft-capped scores) and Gemma 3 (sdpa: window on one
    layer, a RoPE base per layer type): rows of 75 tokens, blocked
    from 16 tokens on with blocks of 16, give the dense path's loss and gradients; the choice is logged."""
    cfg = ModelConfig.preset(preset)
    weights = init_weights(cfg, seed=0)
    batch = collate([{"input_ids": d} for d in _docs(cfg)], padding_free=True)
    dense_loss, dense_grads = loss_and_grads(build_model(cfg, weights), batch)
    model = build_model(cfg, weights)
    BA.set_attention_block_size(model, 16)
    monkeypatch.setattr(BA, "BLOCKED_MIN_SEQ_LEN", 16)
    BA._log_once.cache_clear()
    with caplog.at_level(logging.INFO, logger=BA.__name__):
        loss, grads = loss_and_grads(model, batch)
    assert model.config._attn_implementation == A.BLOCKED_HF_NAME
    assert any("blocked attention" in r.getMessage() for r in caplog.records)
    assert abs(loss - dense_loss) < TOL * abs(dense_loss), (loss, dense_loss)
    _assert_grads_close(grads, dense_grads)


def _docs(cfg, lengths=(20, 33, 22)):
    rng = np.random.default_rng(3)
    return [rng.integers(3, cfg.vocab_size, n).tolist() for n in lengths]


def test_short_batches_after_the_switch_are_bit_identical_to_sdpa(monkeypatch):
    cfg = ModelConfig.preset("tiny")
    weights = init_weights(cfg, seed=0)
    long_batch = collate([{"input_ids": d} for d in _docs(cfg)], padding_free=True)
    short = collate([{"input_ids": d} for d in _docs(cfg, (5, 9, 7))], padding_free=False)
    want = loss_and_grads(build_model(cfg, weights), short)
    model = build_model(cfg, weights)
    monkeypatch.setattr(BA, "BLOCKED_MIN_SEQ_LEN", 64)
    loss_and_grads(model, long_batch)  # switches the model to twinseq_blocked
    assert model.config._attn_implementation == A.BLOCKED_HF_NAME
    got = loss_and_grads(model, short)  # T < 64: the dense sdpa function, through twinseq_blocked
    assert got[0] == want[0]
    assert all(np.array_equal(got[1][n], want[1][n]) for n in want[1])


def test_blocked_rule():
    assert BA.uses_blocked_attention("sdpa", torch.device("cpu"), BA.BLOCKED_MIN_SEQ_LEN)
    assert BA.uses_blocked_attention("eager", torch.device("cpu"), 10 ** 5)
    assert not BA.uses_blocked_attention("sdpa", torch.device("cpu"), BA.BLOCKED_MIN_SEQ_LEN - 1)
    assert not BA.uses_blocked_attention("varlen", torch.device("cpu"), 10 ** 5)
    assert not BA.uses_blocked_attention("sdpa", torch.device("cuda"), 10 ** 5)


# --------------------------------------------------------------------------------------
# Tiled MLP
# --------------------------------------------------------------------------------------


def _graph_has(tensor: torch.Tensor, name: str) -> bool:
    seen, stack = set(), [tensor.grad_fn]
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        if name in type(fn).__name__:
            return True
        stack.extend(f for f, _ in fn.next_functions)
    return False


@pytest.mark.parametrize("preset", ["tiny", "tiny-qwen2", "tiny-gemma2", "tiny-gemma3"])
def test_tiled_mlp_equals_untiled(preset):
    cfg = ModelConfig.preset(preset)
    weights = init_weights(cfg, seed=0)
    batch = collate([{"input_ids": d} for d in _docs(cfg, (20, 33, 22, 9))], padding_free=False)
    want_loss, want_grads = loss_and_grads(build_model(cfg, weights), batch)
    model = build_model(cfg, weights)
    apply_tiled_mlp(model, chunk_size=7)  # 4 rows x 33 tokens = 132 tokens: 19 tiles, the last one short
    assert _graph_has(compute_loss(model, batch), "_TiledMLP")
    loss, grads = loss_and_grads(model, batch)
    assert abs(loss - want_loss) < TOL * abs(want_loss), (loss, want_loss)
    _assert_grads_close(grads, want_grads)


def test_tiled_mlp_rejects_a_bad_chunk_size():
    from twinseq.common.errors import ConfigError

    model = build_model(ModelConfig.preset("tiny"))
    with pytest.raises(ConfigError, match="tiled_mlp_chunk_size=0"):
        apply_tiled_mlp(model, chunk_size=0)


# --------------------------------------------------------------------------------------
# fused_linear under bf16 autocast on CPU
# --------------------------------------------------------------------------------------


def test_fused_linear_under_bf16_autocast_on_cpu_matches_nll():
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 24, 32, generator=gen, requires_grad=True)
    weight = (torch.randn(100, 32, generator=gen) * 0.1).requires_grad_()
    labels = torch.randint(0, 100, (2, 24), generator=gen)
    labels[0, :5] = -100
    num_items = int((labels[:, 1:] != -100).sum())
    out = {}
    for loss_type in ("fused_linear", "nll"):
        h, w = hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = causal_lm_loss(h, w, labels, num_items, loss_type, chunk_size=16)
        loss.backward()
        assert h.grad.dtype == h.dtype and w.grad.dtype == w.dtype
        out[loss_type] = (float(loss.detach()), h.grad, w.grad)
    (lf, hf, wf), (ln, hn, wn) = out["fused_linear"], out["nll"]
    assert abs(lf - ln) < 1e-2 * abs(ln)
    assert float((hf - hn).norm() / hn.norm()) < 2e-2 and float((wf - wn).norm() / wn.norm()) < 2e-2
