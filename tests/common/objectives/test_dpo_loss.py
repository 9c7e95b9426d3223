"""The numpy DPO loss family against hand-derived values, finite differences and its config rules.

Notation: c = chosen log-ratio, r = rejected log-ratio, Δ = c - r, x = βΔ, a = βc, b = βr,
ε = label_smoothing, sp(z) = log(1 + e^z) (softplus), so -log σ(z) = sp(-z).
"""

import logging
import math
import subprocess
import sys

import numpy as np
import pytest

from twinseq.common.objectives.dpo import (DPO_LOSS_TYPES, LABEL_SMOOTHING_LOSS_TYPES, TRL_LOSS_TYPES_NOT_IMPLEMENTED,
                                DPOLossConfig, dpo_loss,
                                log_sigmoid, reward_metrics, sigmoid, validate_dpo_config)

REF_C, REF_R = -3.0, -5.0   # reference log-probs; exact in binary so c and r survive the subtraction
LOG2 = math.log(2.0)
BIG = 1e4


def _sp(z):
    """softplus written directly from its definition (valid for the moderate z it is used on)."""
    return math.log(1.0 + math.exp(z))


def _sig(z):
    return 1.0 / (1.0 + math.exp(-z))


def _run(loss_type, c, r, beta=0.5, eps=0.0, n_c=None, n_r=None, weights=None):
    c, r = np.broadcast_arrays(np.atleast_1d(np.asarray(c, dtype=np.float64)), np.asarray(r, dtype=np.float64))
    return dpo_loss(REF_C + c, REF_R + r, np.full_like(c, REF_C), np.full_like(r, REF_R), loss_type=loss_type,
                    beta=beta, label_smoothing=eps, loss_weights=weights,
                    chosen_num_tokens=None if n_c is None else np.broadcast_to(n_c, c.shape),
                    rejected_num_tokens=None if n_r is None else np.broadcast_to(n_r, r.shape))


# (loss_type, β, ε, c, r, n_c, n_r, expected). β = 0.5 unless noted, so 1/(2β) = 1.
# Point A: c = r = 0 (Δ = 0).  Point B: c = 2, r = -2 (Δ = 4, x = 2, a = 1, b = -1).
# Points C/D: c = ±1e4, r = ∓1e4 (x = ±1e4, a = ±5e3, b = ∓5e3): the asymptotes.
HAND_TABLE = [
    # sigmoid: L = sp(-x).  A: sp(0) = log 2.  B: log(1 + e^-2).  C: e^-1e4 underflows, 0.  D: sp(1e4) = 1e4.
    ("sigmoid", 0.5, 0.0, 0, 0, None, None, LOG2),
    ("sigmoid", 0.5, 0.0, 2, -2, None, None, math.log(1 + math.exp(-2))),
    ("sigmoid", 0.5, 0.0, BIG, -BIG, None, None, 0.0),
    ("sigmoid", 0.5, 0.0, -BIG, BIG, None, None, 1e4),
    # hinge: L = max(0, 1 - x).  A: 1.  c = 1, r = 0 (x = 0.5): 0.5.  B: max(0, -1) = 0.  D: 1 + 1e4.
    ("hinge", 0.5, 0.0, 0, 0, None, None, 1.0),
    ("hinge", 0.5, 0.0, 1, 0, None, None, 0.5),
    ("hinge", 0.5, 0.0, 2, -2, None, None, 0.0),
    ("hinge", 0.5, 0.0, BIG, -BIG, None, None, 0.0),
    ("hinge", 0.5, 0.0, -BIG, BIG, None, None, 1.0 + 1e4),
    # ipo: L = (c/n_c - r/n_r - 1/(2β))².  A: (0 - 1/(2β))² = 1/(4β²): 1 at β = 0.5, 25 at β = 0.1.
    # B with n_c = 4, n_r = 2: (0.5 + 1 - 1)² = 0.25.  C (n = 1): (2e4 - 1)².  D: (-2e4 - 1)².
    ("ipo", 0.5, 0.0, 0, 0, 3, 5, 1.0),
    ("ipo", 0.1, 0.0, 0, 0, 3, 5, 25.0),
    ("ipo", 0.5, 0.0, 2, -2, 4, 2, 0.25),
    ("ipo", 0.5, 0.0, BIG, -BIG, 1, 1, 19999.0 ** 2),
    ("ipo", 0.5, 0.0, -BIG, BIG, 1, 1, 20001.0 ** 2),
    # exo_pair: L = KL((σ(x), σ(-x)) ‖ (1-ε, ε)).  A: -log 2 - ½ log(ε(1-ε)); at ε = ½ that is 0.
    # B: σ(2)(log σ(2) - log(1-ε)) + σ(-2)(log σ(-2) - log ε).  C: q -> (1, 0): -log(1-ε).  D: -log ε.
    ("exo_pair", 0.5, 1e-3, 0, 0, None, None, -LOG2 - 0.5 * math.log(1e-3 * 0.999)),
    ("exo_pair", 0.5, 0.5, 0, 0, None, None, 0.0),
    ("exo_pair", 0.5, 1e-3, 2, -2, None, None,
     _sig(2) * (math.log(_sig(2)) - math.log(0.999)) + _sig(-2) * (math.log(_sig(-2)) - math.log(1e-3))),
    ("exo_pair", 0.5, 1e-3, BIG, -BIG, None, None, -math.log(0.999)),
    ("exo_pair", 0.5, 1e-3, -BIG, BIG, None, None, -math.log(1e-3)),
    ("exo_pair", 0.5, 0.5, BIG, -BIG, None, None, LOG2),
    # nca_pair: L = sp(-a) + ½ sp(a) + ½ sp(b).  A: log 2 (1 + ½ + ½) = 2 log 2.
    # B: sp(-1) + ½ sp(1) + ½ sp(-1).  C: 0 + ½·5e3 + 0 = 2500.  D: 5e3 + 0 + ½·5e3 = 7500.
    ("nca_pair", 0.5, 0.0, 0, 0, None, None, 2 * LOG2),
    ("nca_pair", 0.5, 0.0, 2, -2, None, None, 1.5 * _sp(-1) + 0.5 * _sp(1)),
    ("nca_pair", 0.5, 0.0, BIG, -BIG, None, None, 2500.0),
    ("nca_pair", 0.5, 0.0, -BIG, BIG, None, None, 7500.0),
    # robust: L = ((1-ε) sp(-x) - ε sp(x)) / (1 - 2ε).  A: ((1-2ε) log 2)/(1-2ε) = log 2 for every ε.
    # B, ε = ¼: (¾ sp(-2) - ¼ sp(2)) / ½.  C, ε = ¼: -¼·1e4/½ = -5000 (unbounded below for ε > 0).
    # D, ε = ¼: ¾·1e4/½ = 15000.  ε = 0.49 (just under the max), B: (0.51 sp(-2) - 0.49 sp(2)) / 0.02.
    ("robust", 0.5, 0.0, 0, 0, None, None, LOG2),
    ("robust", 0.5, 0.25, 0, 0, None, None, LOG2),
    ("robust", 0.5, 0.49, 0, 0, None, None, LOG2),
    ("robust", 0.5, 0.25, 2, -2, None, None, (0.75 * _sp(-2) - 0.25 * _sp(2)) / 0.5),
    ("robust", 0.5, 0.49, 2, -2, None, None, (0.51 * _sp(-2) - 0.49 * _sp(2)) / 0.02),
    ("robust", 0.5, 0.25, BIG, -BIG, None, None, -5000.0),
    ("robust", 0.5, 0.25, -BIG, BIG, None, None, 15000.0),
    # bco_pair: L = sp(-a) + sp(b).  A: 2 log 2.  B: 2 sp(-1).  C: 0.  D: 5e3 + 5e3.
    ("bco_pair", 0.5, 0.0, 0, 0, None, None, 2 * LOG2),
    ("bco_pair", 0.5, 0.0, 2, -2, None, None, 2 * _sp(-1)),
    ("bco_pair", 0.5, 0.0, BIG, -BIG, None, None, 0.0),
    ("bco_pair", 0.5, 0.0, -BIG, BIG, None, None, 1e4),
    # sppo_hard: L = (c - 1/(2β))² + (r + 1/(2β))².  A: 2/(4β²) = 1/(2β²): 2 at β = ½, 50 at β = 0.1.
    # B: 1 + 1 = 2.  C: 2·9999².  D: 2·10001².
    ("sppo_hard", 0.5, 0.0, 0, 0, None, None, 2.0),
    ("sppo_hard", 0.1, 0.0, 0, 0, None, None, 50.0),
    ("sppo_hard", 0.5, 0.0, 2, -2, None, None, 2.0),
    ("sppo_hard", 0.5, 0.0, BIG, -BIG, None, None, 2 * 9999.0 ** 2),
    ("sppo_hard", 0.5, 0.0, -BIG, BIG, None, None, 2 * 10001.0 ** 2),
    # apo_zero: L = 1 - σ(a) + σ(b).  A: 1 - ½ + ½ = 1.  B: 2σ(-1).  C: 0.  D: 2.
    ("apo_zero", 0.5, 0.0, 0, 0, None, None, 1.0),
    ("apo_zero", 0.5, 0.0, 2, -2, None, None, 2 * _sig(-1)),
    ("apo_zero", 0.5, 0.0, BIG, -BIG, None, None, 0.0),
    ("apo_zero", 0.5, 0.0, -BIG, BIG, None, None, 2.0),
    # apo_down: L = σ(a) + 1 - σ(x).  A: ½ + ½ = 1.  B: σ(1) + 1 - σ(2).  C: 1 + 1 - 1 = 1.  D: 0 + 1 - 0 = 1.
    ("apo_down", 0.5, 0.0, 0, 0, None, None, 1.0),
    ("apo_down", 0.5, 0.0, 2, -2, None, None, _sig(1) + 1 - _sig(2)),
    ("apo_down", 0.5, 0.0, BIG, -BIG, None, None, 1.0),
    ("apo_down", 0.5, 0.0, -BIG, BIG, None, None, 1.0),
    # aot / aot_unpaired on one pair: the sorted margins are the margins, so L = (1-ε) sp(-x) + ε sp(x), sigmoid's
    # values at ε = 0; A at ε = ¼: log 2.
    ("aot", 0.5, 0.0, 0, 0, None, None, LOG2),
    ("aot", 0.5, 0.25, 0, 0, None, None, LOG2),
    ("aot", 0.5, 0.25, 2, -2, None, None, 0.75 * _sp(-2) + 0.25 * _sp(2)),
    ("aot", 0.5, 0.0, BIG, -BIG, None, None, 0.0),
    ("aot", 0.5, 0.0, -BIG, BIG, None, None, 1e4),
    ("aot_unpaired", 0.5, 0.0, 0, 0, None, None, LOG2),
    ("aot_unpaired", 0.5, 0.25, 2, -2, None, None, 0.75 * _sp(-2) + 0.25 * _sp(2)),
    ("aot_unpaired", 0.5, 0.0, BIG, -BIG, None, None, 0.0),
    ("aot_unpaired", 0.5, 0.0, -BIG, BIG, None, None, 1e4),
    # discopop (τ = 0.05): L = sp(-x)(1 - σ(x/τ)) + e^-x σ(x/τ).  A: ½ log 2 + ½.  B: x = 2.
    # C: x = 1e4: 0 + e^-1e4 = 0.  D: x = -1e4: sp(1e4) + e^(1e4 - 2e5) = 1e4.
    ("discopop", 0.5, 0.0, 0, 0, None, None, 0.5 * LOG2 + 0.5),
    ("discopop", 0.5, 0.0, 2, -2, None, None, _sp(-2) * (1 - _sig(40)) + math.exp(-2) * _sig(40)),
    ("discopop", 0.5, 0.0, BIG, -BIG, None, None, 0.0),
    ("discopop", 0.5, 0.0, -BIG, BIG, None, None, 1e4),
    # sft: the chosen completions' token-mean NLL, -πc / n_c with πc = REF_C + c (one pair).
    ("sft", 0.5, 0.0, 0, 0, 3, 5, -REF_C / 3),
    ("sft", 0.5, 0.0, 2, -2, 4, 2, -(REF_C + 2) / 4),
    ("sft", 0.5, 0.0, BIG, -BIG, 1, 1, -(REF_C + BIG)),
    ("sft", 0.5, 0.0, -BIG, BIG, 1, 1, -(REF_C - BIG)),
    # sigmoid_norm: L = sp(-β(c/n_c - r/n_r)).  A: log 2.  B, n_c = 4, n_r = 2: sp(-½(½ + 1)).  C/D (n = 1): 0, 1e4.
    ("sigmoid_norm", 0.5, 0.0, 0, 0, 3, 5, LOG2),
    ("sigmoid_norm", 0.5, 0.0, 2, -2, 4, 2, _sp(-0.75)),
    ("sigmoid_norm", 0.5, 0.0, BIG, -BIG, 1, 1, 0.0),
    ("sigmoid_norm", 0.5, 0.0, -BIG, BIG, 1, 1, 1e4),
]
BATCH_LOSS_TYPES = ("aot", "aot_unpaired", "sft")
"""Loss types whose per-pair value reads the whole micro-batch (sorted margins, a token mean)."""


def test_hand_table_covers_every_loss_type():
    assert {row[0] for row in HAND_TABLE} == set(DPO_LOSS_TYPES)
    for t in DPO_LOSS_TYPES:
        cs = {row[3] for row in HAND_TABLE if row[0] == t}
        assert {0, BIG, -BIG} <= cs, f"{t}: Δ = 0 and both asymptotes must be in the table"


@pytest.mark.parametrize("loss_type,beta,eps,c,r,n_c,n_r,expected", HAND_TABLE)
def test_matches_hand_derived_value(loss_type, beta, eps, c, r, n_c, n_r, expected):
    with np.errstate(over="raise", invalid="raise", divide="raise"):
        out = _run(loss_type, c, r, beta, eps, n_c, n_r)
    assert np.isfinite(out.losses).all()
    np.testing.assert_allclose(out.losses, [expected], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(out.chosen_rewards, [beta * c], rtol=0, atol=0)
    np.testing.assert_allclose(out.rejected_rewards, [beta * r], rtol=0, atol=0)


@pytest.mark.parametrize("loss_type", DPO_LOSS_TYPES)
def test_finite_without_float_warnings_far_out(loss_type):
    eps = 1e-3 if loss_type == "exo_pair" else 0.0
    c = np.array([1e6, -1e6, 1e6, -1e6, 0.0])
    r = np.array([-1e6, 1e6, 1e6, -1e6, 1e6])
    with np.errstate(over="raise", invalid="raise", divide="raise"):
        out = _run(loss_type, c, r, beta=2.0, eps=eps, n_c=7, n_r=3)
    assert np.isfinite(out.losses).all()


@pytest.mark.parametrize("loss_type,expected", [
    ("sigmoid", math.exp(-40.0)),          # sp(-40) = log1p(e^-40) ≈ e^-40
    ("bco_pair", 2 * math.exp(-20.0)),     # a = 20, b = -20: 2 sp(-20) ≈ 2 e^-20
    ("apo_zero", 2 * math.exp(-20.0)),     # 1 - σ(20) + σ(-20) = 2σ(-20) ≈ 2 e^-20 (1 - σ(20) loses 7 digits)
])
def test_tiny_losses_keep_relative_precision(loss_type, expected):
    # β = ½, c = 40, r = -40: x = 40, a = 20, b = -20. Second-order terms are below 1e-8 relative.
    np.testing.assert_allclose(_run(loss_type, 40.0, -40.0).losses, [expected], rtol=1e-8, atol=0)


def test_log_sigmoid_is_exact_in_both_tails():
    z = np.array([-1e4, -800.0, -30.0, 0.0, 30.0, 800.0, 1e4])
    with np.errstate(over="raise", invalid="raise", divide="raise"):
        ls = log_sigmoid(z)
    # Left tail: log σ(z) = z - log(1 + e^z) -> z.  Right tail: -log(1 + e^-z) -> -e^-z.
    np.testing.assert_allclose(ls[:2], z[:2], rtol=1e-15)
    np.testing.assert_allclose(ls[2], -30.0 - math.log1p(math.exp(-30.0)), rtol=1e-15)
    assert ls[3] == -LOG2 and ls[-1] == 0.0
    np.testing.assert_allclose(ls[4], -math.exp(-30.0), rtol=1e-12)
    np.testing.assert_allclose(sigmoid(z) + sigmoid(-z), 1.0, rtol=1e-15)


# ---------------------------------------------------------------------------------------
# Label smoothing
# ---------------------------------------------------------------------------------------


def test_robust_at_zero_smoothing_is_sigmoid():
    c, r = np.linspace(-20, 20, 9), np.linspace(5, -5, 9)
    np.testing.assert_array_equal(_run("robust", c, r, eps=0.0).losses, _run("sigmoid", c, r).losses)


@pytest.mark.parametrize("eps", [1e-3, 0.1, 0.4999])
def test_exo_pair_is_zero_at_its_optimum(eps):
    # KL(q ‖ p) = 0 iff q = p, i.e. σ(x*) = 1 - ε, x* = log((1-ε)/ε); the loss is ≥ 0 elsewhere.
    beta = 0.5
    x_star = math.log((1 - eps) / eps)
    out = _run("exo_pair", x_star / beta, 0.0, beta=beta, eps=eps)
    np.testing.assert_allclose(out.losses, 0.0, atol=1e-12)
    others = _run("exo_pair", np.linspace(-30, 30, 13), 0.0, beta=beta, eps=eps).losses
    assert (others >= -1e-15).all()


@pytest.mark.parametrize("loss_type", [t for t in DPO_LOSS_TYPES if t not in LABEL_SMOOTHING_LOSS_TYPES])
def test_other_losses_ignore_label_smoothing(loss_type, caplog):
    c, r = np.array([1.5, -2.0]), np.array([-0.5, 3.0])
    with caplog.at_level(logging.WARNING, logger="twinseq.common.objectives.dpo"):
        smoothed = _run(loss_type, c, r, eps=0.5, n_c=2, n_r=3).losses
    np.testing.assert_array_equal(smoothed, _run(loss_type, c, r, eps=0.0, n_c=2, n_r=3).losses)
    assert "has no effect" in caplog.text


# ---------------------------------------------------------------------------------------
# Gradients: central differences against hand-derived derivatives dL/dc, dL/dr
# ---------------------------------------------------------------------------------------


def _dsig(z):
    return sigmoid(z) * sigmoid(-z)


def _hand_grads(loss_type, c, r, beta, eps, n_c, n_r):
    x, a, b = beta * (c - r), beta * c, beta * r
    if loss_type == "sigmoid":                       # d sp(-x)/dx = -σ(-x)
        g = -sigmoid(-x)
        return beta * g, -beta * g
    if loss_type == "hinge":                         # -1 left of the kink x = 1, 0 right of it
        g = -(x < 1).astype(float)
        return beta * g, -beta * g
    if loss_type == "ipo":                           # d u²/dc = 2u/n_c, d u²/dr = -2u/n_r
        u = c / n_c - r / n_r - 1 / (2 * beta)
        return 2 * u / n_c, -2 * u / n_r
    if loss_type == "exo_pair":                      # dKL/dx = σ'(x) (x - log((1-ε)/ε))
        g = _dsig(x) * (x - math.log((1 - eps) / eps))
        return beta * g, -beta * g
    if loss_type == "nca_pair":                      # dL/da = -σ(-a) + ½σ(a), dL/db = ½σ(b)
        return beta * (-sigmoid(-a) + 0.5 * sigmoid(a)), beta * 0.5 * sigmoid(b)
    if loss_type == "robust":                        # dL/dx = (-(1-ε)σ(-x) - εσ(x)) / (1-2ε)
        g = (-(1 - eps) * sigmoid(-x) - eps * sigmoid(x)) / (1 - 2 * eps)
        return beta * g, -beta * g
    if loss_type == "bco_pair":                      # d sp(-a)/da = -σ(-a), d sp(b)/db = σ(b)
        return -beta * sigmoid(-a), beta * sigmoid(b)
    if loss_type == "sppo_hard":
        return 2 * (c - 0.5 / beta), 2 * (r + 0.5 / beta)
    if loss_type == "apo_zero":                      # L = σ(-a) + σ(b)
        return -beta * _dsig(a), beta * _dsig(b)
    if loss_type == "apo_down":                      # L = σ(a) + σ(-x)
        return beta * _dsig(a) - beta * _dsig(x), beta * _dsig(x)
    if loss_type == "discopop":                      # L = sp(-x)(1 - m) + e^-x m, m = σ(x/τ), τ = 0.05
        m, dm = sigmoid(x / 0.05), _dsig(x / 0.05) / 0.05
        g = -sigmoid(-x) * (1 - m) - np.log1p(np.exp(-x)) * dm - np.exp(-x) * m + np.exp(-x) * dm
        return beta * g, -beta * g
    if loss_type == "sigmoid_norm":                  # L = sp(-β(c/n_c - r/n_r))
        g = -sigmoid(-beta * (c / n_c - r / n_r))
        return beta * g / n_c, -beta * g / n_r
    raise AssertionError(loss_type)


@pytest.mark.parametrize("beta", [0.1, 0.5, 2.0])
@pytest.mark.parametrize("loss_type", [t for t in DPO_LOSS_TYPES if t not in BATCH_LOSS_TYPES])
def test_finite_difference_gradients(loss_type, beta):
    rng = np.random.default_rng([DPO_LOSS_TYPES.index(loss_type), int(beta * 10)])
    n = 16
    pc, pr = rng.uniform(-40, -1, n), rng.uniform(-40, -1, n)
    rc, rr = pc + rng.uniform(-4, 4, n), pr + rng.uniform(-4, 4, n)
    n_c, n_r = rng.integers(1, 9, n).astype(float), rng.integers(1, 9, n).astype(float)
    eps = {"exo_pair": 0.05, "robust": 0.2}.get(loss_type, 0.0)
    c, r = pc - rc, pr - rr
    if loss_type == "hinge":   # keep away from the kink, where the derivative jumps
        keep = np.abs(beta * (c - r) - 1) > 1e-3
        pc, pr, rc, rr, n_c, n_r, c, r = (v[keep] for v in (pc, pr, rc, rr, n_c, n_r, c, r))

    def losses(*args):
        return dpo_loss(*args, loss_type=loss_type, beta=beta, label_smoothing=eps,
                        chosen_num_tokens=n_c, rejected_num_tokens=n_r).losses

    h = 1e-5
    args = [pc, pr, rc, rr]
    fd = []
    for k in range(4):   # every example moves at once: losses are per-example, so this is the diagonal
        up, down = list(args), list(args)
        up[k], down[k] = args[k] + h, args[k] - h
        fd.append((losses(*up) - losses(*down)) / (2 * h))
    d_c, d_r = _hand_grads(loss_type, c, r, beta, eps, n_c, n_r)
    # The reference log-probs enter only through c = πc - refc and r = πr - refr.
    for got, want in zip(fd, (d_c, d_r, -d_c, -d_r)):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-8)


# ---------------------------------------------------------------------------------------
# Combinations and metrics
# ---------------------------------------------------------------------------------------


def test_weighted_combination_is_trl_reduction():
    c, r = np.array([0.3, -1.2, 4.0]), np.array([-0.7, 0.4, 1.0])
    types, weights = ["sigmoid", "bco_pair", "sppo_hard"], [0.8, 0.2, 1.0]
    out = _run(types, c, r, weights=weights)
    parts = [_run(t, c, r).losses for t in types]
    # TRL: loss = Σ_k w_k mean_n L_k[n].
    trl_loss = sum(w * p.mean() for w, p in zip(weights, parts))
    np.testing.assert_allclose(out.loss, trl_loss, rtol=1e-14)
    np.testing.assert_allclose(out.losses, sum(w * p for w, p in zip(weights, parts)), rtol=1e-14)
    for t, p in zip(types, parts):
        np.testing.assert_array_equal(out.losses_by_type[t], p)
    # Default weights are all 1; a repeated type counts once per entry.
    np.testing.assert_allclose(_run(["sigmoid", "hinge"], c, r).losses, parts[0] + _run("hinge", c, r).losses)
    np.testing.assert_allclose(_run(["sigmoid", "sigmoid"], c, r, weights=[1.0, 2.0]).losses, 3 * parts[0])


def test_reward_metrics_by_hand():
    # β = 0.5; c = [2, 0, -1], r = [-2, 0, 1] -> rewards (1, -1), (0, 0), (-0.5, 0.5).
    out = _run("sigmoid", [2.0, 0.0, -1.0], [-2.0, 0.0, 1.0], beta=0.5)
    m = reward_metrics(out.chosen_rewards, out.rejected_rewards)
    assert m == {"rewards/chosen": pytest.approx(0.5 / 3), "rewards/rejected": pytest.approx(-0.5 / 3),
                 "rewards/accuracies": pytest.approx(1 / 3),   # the tie is not a win
                 "rewards/margins": pytest.approx((2 + 0 - 1) / 3)}


# ---------------------------------------------------------------------------------------
# Config validation
# ---------------------------------------------------------------------------------------


def test_valid_config_normalises():
    assert validate_dpo_config("ipo", beta=1) == DPOLossConfig(("ipo",), (1.0,), 1.0, 0.0)
    cfg = validate_dpo_config(["robust", "exo_pair"], [1, 0.5], 0.1, 0.25)
    assert cfg.loss_type == ("robust", "exo_pair") and cfg.loss_weights == (1.0, 0.5)
    assert validate_dpo_config("exo_pair", label_smoothing=0.5).label_smoothing == 0.5


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(loss_type="dpo"), ValueError, r"loss_type='dpo' is not a DPO loss type; choose one of sigmoid, hinge"),
    (dict(loss_type=["sigmoid", "kto"]), ValueError, r"loss_type='kto'.*apo_down"),
    (dict(loss_type=[]), ValueError, r"loss_type=\[\] is empty"),
    (dict(loss_type=[1]), TypeError, r"loss_type entries must be strings"),
    (dict(loss_type=["sigmoid", "hinge"], loss_weights=[1.0]), ValueError,
     r"loss_weights=\[1.0\] has 1 entries but loss_type=\['sigmoid', 'hinge'\] has 2"),
    (dict(loss_type="sigmoid", loss_weights=[1.0, 2.0]), ValueError, r"loss_weights=.* has 2 entries"),
    (dict(loss_weights=[float("nan")]), ValueError, r"loss_weights\[0\]=nan must be finite"),
    (dict(beta=0.0), ValueError, r"beta=0.0 is not valid; it must be > 0"),
    (dict(beta=-0.1), ValueError, r"beta=-0.1 is not valid"),
    (dict(beta=float("inf")), ValueError, r"beta=inf must be finite"),
    (dict(beta=True), TypeError, r"beta=True must be a real number"),
    (dict(label_smoothing=-0.01), ValueError, r"label_smoothing=-0.01 is not valid.*\[0, 0.5\]"),
    (dict(label_smoothing=0.6), ValueError, r"label_smoothing=0.6 is not valid.*\[0, 0.5\]"),
    (dict(loss_type="robust", label_smoothing=0.5), ValueError,
     r"label_smoothing=0.5 is not valid with loss_type 'robust'.*\[0, 0.5\)"),
    (dict(loss_type=["sigmoid", "robust"], label_smoothing=0.5), ValueError, r"loss_type 'robust'"),
    (dict(loss_type="exo_pair", label_smoothing=0.0), ValueError,
     r"label_smoothing=0.0 is not valid with loss_type 'exo_pair'.*1e-3"),
])
def test_invalid_config_raises_clear_error(kwargs, error, match):
    with pytest.raises(error, match=match):
        validate_dpo_config(**kwargs)
    # dpo_loss applies the same rules.
    with pytest.raises(error, match=match):
        dpo_loss([-1.0], [-2.0], [-1.0], [-2.0], chosen_num_tokens=[1], rejected_num_tokens=[1], **kwargs)


def test_trl_only_loss_types_are_disjoint_from_supported():
    assert not set(TRL_LOSS_TYPES_NOT_IMPLEMENTED) & set(DPO_LOSS_TYPES)


def test_invalid_inputs_raise_clear_error():
    with pytest.raises(ValueError, match=r"loss types \('ipo', 'sigmoid_norm', 'sft'\) read completion lengths .* need chosen_num_tokens"):
        dpo_loss([-1.0], [-2.0], [-1.0], [-2.0], loss_type="ipo")
    with pytest.raises(ValueError, match=r"rejected_num_tokens must be \[N=1\] counts >= 1"):
        dpo_loss([-1.0], [-2.0], [-1.0], [-2.0], loss_type="ipo", chosen_num_tokens=[2], rejected_num_tokens=[0])
    with pytest.raises(ValueError, match=r"policy_rejected_logps holds non-finite values"):
        dpo_loss([-1.0], [-np.inf], [-1.0], [-2.0])
    with pytest.raises(ValueError, match=r"same shape \[N\]"):
        dpo_loss([-1.0, -2.0], [-2.0], [-1.0], [-2.0])
    with pytest.raises(ValueError, match=r"ref_chosen_logps must be a non-empty 1-D array"):
        dpo_loss([-1.0], [-2.0], [[-1.0]], [-2.0])


def test_modules_import_without_torch_or_jax():
    code = ("import sys\n"
            "class Block:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name.split('.')[0] in ('torch', 'jax', 'jaxlib', 'flax', 'optax'):\n"
            "            raise ImportError('blocked: ' + name)\n"
            "sys.meta_path.insert(0, Block())\n"
            "import twinseq.common.objectives.dpo, twinseq.common.data.preference_batching\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_batch_losses_read_the_whole_micro_batch():
    """aot sorts the policy margins and the reference margins separately, aot_unpaired the chosen and rejected
    log-ratios; sft is the chosen completions' token mean over the micro-batch. Hand values on three pairs."""
    pc, pr = np.array([-3.0, -8.0, -5.0]), np.array([-6.0, -4.0, -7.0])
    rc, rr = np.array([-4.0, -6.0, -5.5]), np.array([-5.0, -5.0, -6.0])
    n_c, n_r = np.array([2.0, 4.0, 3.0]), np.array([3.0, 2.0, 2.0])
    beta = 0.5

    def run(loss_type):
        return dpo_loss(pc, pr, rc, rr, loss_type=loss_type, beta=beta, chosen_num_tokens=n_c,
                        rejected_num_tokens=n_r).losses

    # policy margins pc - pr = [3, -4, 2] -> sorted [-4, 2, 3]; reference rc - rr = [1, -1, 0.5] -> [-1, 0.5, 1]
    np.testing.assert_allclose(run("aot"), -log_sigmoid(beta * np.array([-3.0, 1.5, 2.0])), rtol=1e-15)
    # c = pc - rc = [1, -2, 0.5] -> [-2, 0.5, 1]; r = pr - rr = [-1, 1, -1] -> [-1, -1, 1]
    np.testing.assert_allclose(run("aot_unpaired"), -log_sigmoid(beta * np.array([-1.0, 1.5, 0.0])), rtol=1e-15)
    np.testing.assert_allclose(run("sft"), np.full(3, 16.0 / 9.0), rtol=1e-15)  # -(-3 - 8 - 5) / (2 + 4 + 3)
    # unsorted, the same pairs would give other values: the test sees the sort
    assert not np.allclose(run("aot"), -log_sigmoid(beta * (np.array([3.0, -4.0, 2.0]) - np.array([1.0, -1.0, 0.5]))))
