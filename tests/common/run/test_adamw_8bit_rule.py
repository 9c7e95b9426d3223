"""The 8-bit AdamW rule in numpy (``common/run/adamw_8bit.py``) against bitsandbytes' ``AdamW8bit`` on CPU.

Invariants:
- the dynamic maps are bitsandbytes' ``qmap1`` (signed) and ``qmap2`` (unsigned), within 2 float32 ulp;
- quantisation picks the nearest code (checked by brute force over the 256; a code moved by one is not: the
  negative control);
- from the same 8-bit state and gradient, one step of the rule moves the weight as bitsandbytes does, within 1e-6
  relative (the update reads the float32 moments before they are re-quantised), on quantised and small tensors;
  bitsandbytes' CPU search can store the neighbouring code where the rule stores the nearest one (at most one code
  apart, on a small share of the numbers); its search is coarse near zero: below 2e-4 of a block's absmax it can
  store a code several steps from the nearest, and never one of the seven codes nearest zero (the rule keeps the
  nearest);
- the state's bytes are 2 per number plus 8 per block of 256, float32 moments below 4,096 numbers.
"""

from __future__ import annotations

import numpy as np
import pytest

from twinseq.common.run import adamw_8bit as rule

HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)


def _bnb():
    return pytest.importorskip("bitsandbytes")


def _bnb_adamw(w: np.ndarray):
    """A torch parameter holding ``w`` and bitsandbytes' ``AdamW8bit`` over it, with ``HYPER``."""
    import torch

    bnb = _bnb()
    p = torch.nn.Parameter(torch.tensor(w))
    opt = bnb.optim.AdamW8bit([p], lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]), eps=HYPER["eps"],
                              weight_decay=HYPER["weight_decay"])
    return p, opt


def test_the_dynamic_maps_are_bitsandbytes_maps():
    _bnb()
    import bitsandbytes.functional as F

    for signed in (True, False):
        mine, theirs = rule.dynamic_map(signed), F.create_dynamic_map(signed=signed).numpy()
        np.testing.assert_allclose(mine, theirs, rtol=2**-22, atol=1e-12)  # 2 float32 ulp
        assert np.all(np.diff(mine) > 0) and mine[-1] == 1.0 and (mine[0] == -rule.dynamic_map(True)[-2]) == signed


@pytest.mark.parametrize("size", [1, 255, 256, 257, 4096, 5000])
def test_quantize_picks_the_nearest_code(size):
    rng = np.random.default_rng(size)
    for signed in (True, False):
        code_map = rule.dynamic_map(signed)
        x = rng.normal(size=size).astype(np.float32) * np.exp(rng.uniform(-12, 3, size)).astype(np.float32)
        x = x if signed else np.abs(x)
        x[: min(3, size)] = 0.0
        codes, absmax = rule.quantize(x, code_map)
        assert codes.dtype == np.uint8 and codes.shape == x.shape and absmax.shape == (rule.n_blocks(size),)
        scale = np.repeat(absmax, rule.BLOCK)[:size]
        normed = np.where(scale > 0, x / np.where(scale > 0, scale, 1), 0)
        best = np.abs(normed[:, None] - code_map[None, :]).min(axis=1)  # the nearest code's distance, by brute force
        assert np.all(np.abs(normed - code_map[codes]) <= best + 1e-7)
        back = rule.dequantize(codes, absmax, code_map)
        assert np.all(np.abs(back - x) <= (best + 1e-7) * scale + 1e-12)
        moved = np.clip(codes.astype(int) + 1, 0, 255).astype(np.uint8)  # negative control: one code off
        assert size < 8 or np.any(np.abs(normed - code_map[moved]) > best + 1e-7)


@pytest.mark.parametrize("shape", [(70, 131), (40,)])
def test_one_step_moves_the_weight_as_bitsandbytes_does(shape):
    _bnb()
    import torch

    rng = np.random.default_rng(0)
    w = rng.normal(size=shape).astype(np.float32)
    p, opt = _bnb_adamw(w)
    quantized = rule.is_quantized(int(np.prod(shape)))
    far = 0
    for t in range(1, 9):
        g = (rng.normal(size=shape) * t).astype(np.float32)
        before = p.detach().numpy().copy()
        s = opt.state[p]
        if t == 1:
            state = rule.init_state(before)
        elif quantized:  # the rule starts from bitsandbytes' own 8-bit state
            state = {
                "m_codes": s["state1"].numpy().copy(),
                "m_absmax": s["absmax1"].numpy().copy(),
                "v_codes": s["state2"].numpy().copy(),
                "v_absmax": s["absmax2"].numpy().copy(),
            }
        else:
            state = {"m": s["state1"].numpy().copy(), "v": s["state2"].numpy().copy()}
        p.grad = torch.tensor(g)
        opt.step()
        new, state = rule.step(before, g, state, step_number=t, **HYPER)
        np.testing.assert_allclose(p.detach().numpy(), new, rtol=1e-6, atol=1e-7)
        assert np.abs(new - before).max() > 1e-3  # the step moved the weight: the comparison is not of no-ops
        if quantized:
            for mine, theirs, signed in ((state["m_codes"], s["state1"], True), (state["v_codes"], s["state2"], False)):
                # bitsandbytes' CPU search is coarse near zero (below 2e-4 of the block's absmax it can land several
                # codes from the nearest, and never below the 8th code from zero); above, at most one code away
                normed = np.abs(rule.dynamic_map(signed)[mine])
                diff = np.abs(mine.astype(int) - theirs.numpy().astype(int))[normed >= 2e-4]
                assert diff.max() <= 1
                far = max(far, int((diff > 0).sum()))
        else:
            # m sums terms of the gradient's size: a float32 rounding of those terms is the absolute bound
            np.testing.assert_allclose(state["m"], s["state1"].numpy(), rtol=1e-6, atol=1e-6 * np.abs(g).max())
    assert far <= 0.05 * np.prod(shape)


def test_a_wrong_update_is_caught():
    """Negative control for the bitsandbytes comparison: the rule without weight decay differs beyond 1e-6."""
    _bnb()
    import torch

    rng = np.random.default_rng(1)
    w, g = rng.normal(size=(64, 80)).astype(np.float32), rng.normal(size=(64, 80)).astype(np.float32)
    p, opt = _bnb_adamw(w)
    p.grad = torch.tensor(g)
    opt.step()
    wrong, _ = rule.step(w, g, rule.init_state(w), step_number=1, **{**HYPER, "weight_decay": 0.0})
    assert not np.allclose(p.detach().numpy(), wrong, rtol=1e-6, atol=1e-7)


def test_state_bytes():
    assert rule.state_bytes(4095) == 8 * 4095
    assert rule.state_bytes(4096) == 2 * 4096 + 8 * 16
    assert rule.state_bytes(4097) == 2 * 4097 + 8 * 17
    for size in (10, 4096, 70 * 131):
        state = rule.init_state(np.zeros(size, np.float32))
        assert sum(a.nbytes for a in state.values()) == rule.state_bytes(size)
