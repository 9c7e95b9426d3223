"""``optimizer='adamw_bf16_8bit'``: the torch quantiser of ``common/run/adamw_8bit.py``'s rule
(``torch_backend/adamw_8bit.py``), under ``AdamWBF16``'s bfloat16 weights.

Invariants:
- on float32 weights, from the rule's state, each of 10 steps gives the rule's weights within 1e-6 relative and its
  codes (bar a number within rounding of a code boundary, at most 0.1 %); float32 moments below 4,096 numbers; the
  negative control: float32 moments (``torch.optim.AdamW``'s update) are not within that tolerance;
- the chunked update (``CHUNK`` numbers at a time) changes no number;
- the state holds 2 bytes per number plus 8 per block (``rule.state_bytes``), and the planner counts it;
- 50 steps on the embedded data reach the float32 run's loss within 2 % (slow tier), with and without
  ``optimizer_in_backward``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from twinseq.common.config import TrainConfig
from twinseq.common.run import adamw_8bit as rule
from twinseq.common.run.memory_plan import plan_memory
from twinseq.common.run.report import read_metrics
from twinseq.torch_backend import adamw_8bit
from twinseq.torch_backend.bf16_adamw import AdamWBF16
from twinseq.torch_backend.recipes import train

from _sft_data import packed_tiny_config, write_embedded_sft_jsonl

HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)
SHAPES = {"w": (70, 131), "emb": (64, 96), "norm": (40,)}


def _run(eight_bit: bool, steps: int = 10) -> tuple[float, int, int]:
    """(the weights' largest error beyond 1e-6 relative, codes apart, codes compared) against the rule, each step
    starting from the rule's weights and state."""
    rng = np.random.default_rng(0)
    params = {k: rng.normal(size=s).astype(np.float32) for k, s in SHAPES.items()}
    states = {k: rule.init_state(p) for k, p in params.items()}
    tp = {k: torch.nn.Parameter(torch.from_numpy(v.copy())) for k, v in params.items()}
    groups = [
        {"params": [tp["w"], tp["emb"]], "weight_decay": HYPER["weight_decay"]},
        {"params": [tp["norm"]], "weight_decay": 0.0},
    ]
    opt = AdamWBF16(
        groups, lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]), eps=HYPER["eps"], eight_bit=eight_bit
    )
    worst, apart, compared = 0.0, 0, 0
    for t in range(1, steps + 1):
        grads = {k: (rng.normal(size=s) * t).astype(np.float32) for k, s in SHAPES.items()}
        for k in SHAPES:
            tp[k].grad = torch.from_numpy(grads[k].copy())
            with torch.no_grad():
                tp[k].copy_(torch.from_numpy(params[k]))
            state = opt.state[tp[k]]
            if state and "exp_avg_codes" in state:  # resync to the rule's state
                for mine, theirs in (("exp_avg", "m"), ("exp_avg_sq", "v")):
                    state[f"{mine}_codes"].copy_(torch.from_numpy(states[k][f"{theirs}_codes"]))
                    state[f"{mine}_absmax"].copy_(torch.from_numpy(states[k][f"{theirs}_absmax"]))
        opt.step()
        for k in SHAPES:
            decay = HYPER["weight_decay"] if params[k].ndim >= 2 else 0.0
            params[k], states[k] = rule.step(
                params[k], grads[k], states[k], step_number=t, **{**HYPER, "weight_decay": decay}
            )
            got = tp[k].detach().numpy()
            worst = max(worst, float(np.max(np.abs(got - params[k]) - 1e-6 * np.abs(params[k]))))
            state = opt.state[tp[k]]
            if "m_codes" in states[k] and eight_bit:
                assert "exp_avg_codes" in state, k
                for mine, theirs in (("exp_avg_codes", "m_codes"), ("exp_avg_sq_codes", "v_codes")):
                    diff = np.abs(state[mine].numpy().astype(int) - states[k][theirs].astype(int))
                    assert diff.max() <= 1
                    apart, compared = apart + int((diff > 0).sum()), compared + diff.size
            elif eight_bit:
                assert state["exp_avg"].dtype == torch.float32 and "exp_avg_codes" not in state
    return worst, apart, compared


def test_torch_8bit_adamw_follows_the_rule():
    worst, apart, compared = _run(eight_bit=True)
    assert worst <= 1e-7, worst
    assert compared > 0 and apart <= 1e-3 * compared, (apart, compared)


def test_float32_moments_are_told_apart():
    worst, _, _ = _run(eight_bit=False)
    assert worst > 1e-5, worst


def test_chunks_change_no_number(monkeypatch):
    torch.manual_seed(2)
    w, g = torch.randn(9000), torch.randn(9000)
    results = []
    for chunk in (adamw_8bit.CHUNK, 4 * adamw_8bit.BLOCK):
        monkeypatch.setattr(adamw_8bit, "CHUNK", chunk)
        p = torch.nn.Parameter(w.clone())
        opt = AdamWBF16([p], lr=1e-2, weight_decay=0.01, eight_bit=True)
        for _ in range(3):
            p.grad = g.clone()
            opt.step()
        s = opt.state[p]
        results.append([p.detach().clone(), *(s[k].clone() for k in sorted(s) if k != "step")])
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_the_state_is_two_bytes_per_number_and_the_planner_counts_it():
    p = torch.nn.Parameter(torch.zeros(300, 50, dtype=torch.bfloat16))
    small = torch.nn.Parameter(torch.zeros(64, dtype=torch.bfloat16))
    opt = AdamWBF16([p, small], lr=1e-3, eight_bit=True)
    p.grad, small.grad = torch.ones_like(p), torch.ones_like(small)
    opt.step()
    for param in (p, small):
        held = sum(t.numel() * t.element_size() for k, t in opt.state[param].items() if k != "step")
        assert held == rule.state_bytes(param.numel()), (param.shape, held)
    kw = dict(model_config="tiny", dtype="bfloat16", max_length=128)
    rows = {r.component: r.bytes for r in plan_memory(TrainConfig.from_flat(optimizer="adamw_bf16_8bit", **kw)).rows}
    bnb = {r.component: r.bytes for r in plan_memory(TrainConfig.from_flat(optimizer="adamw_bnb_8bit", **kw)).rows}
    assert rows["optimizer state (AdamW 8-bit)"] == bnb["optimizer state (AdamW 8-bit)"] > 0
    assert rows["weights (bfloat16)"] * 2 == bnb["weights (float32)"]


@pytest.fixture(scope="module")
def sft_jsonl(tmp_path_factory):
    return write_embedded_sft_jsonl(tmp_path_factory.mktemp("data"), 400)


def _cfg(data, out, **kw):
    return packed_tiny_config(data, out, **{"save_final_checkpoint": False, "max_grad_norm": None, **kw})


@pytest.mark.slow
def test_fifty_steps_reach_the_float32_runs_loss_within_two_percent(sft_jsonl, tmp_path):
    train(_cfg(sft_jsonl, tmp_path / "fp32"))
    a = read_metrics(tmp_path / "fp32")
    first, mean_a = a[0]["loss"], sum(r["loss"] for r in a[-5:]) / 5
    assert mean_a < 0.8 * first, "the float32 run must train for the comparison to mean anything"
    for name, kw in (("8bit", {}), ("8bit-in-backward", dict(optimizer_in_backward=True))):
        train(_cfg(sft_jsonl, tmp_path / name, optimizer="adamw_bf16_8bit", **kw))
        mean_b = sum(r["loss"] for r in read_metrics(tmp_path / name)[-5:]) / 5
        print(f"loss: first {first:.4f}; mean of the last 5 steps: float32 {mean_a:.4f}, {name} {mean_b:.4f}")
        assert abs(mean_b - mean_a) <= 0.02 * mean_a, (name, mean_a, mean_b)


def _kernel_against_the_torch_loop(device: str) -> None:
    """Each step from the same state: the kernel on bfloat16 weights, and the torch loop on a float32 copy of them
    (plain writes: the float32 update). The same codes (bar a boundary: one apart, at most 0.1 %), the same absmax
    within float32 rounding, and the kernel's weights a bfloat16 neighbour of the float32 update."""
    from twinseq.torch_backend import bf16_adamw

    launches = []
    kernel = bf16_adamw.kernel_step_8bit_
    torch.manual_seed(5)
    n = 70 * 131  # not a multiple of the 256-number block: the last block is short
    p = torch.nn.Parameter(torch.randn(n, device=device).to(torch.bfloat16))
    opt = AdamWBF16([p], lr=1e-2, weight_decay=0.1, eight_bit=True)
    for step in range(3):
        grad = (torch.randn(n, device=device) * (step + 1)).to(torch.bfloat16)
        p32 = torch.nn.Parameter(p.detach().float())
        ref = AdamWBF16([p32], lr=1e-2, weight_decay=0.1, eight_bit=True)
        if opt.state[p]:
            ref.state[p32] = {k: v.clone() for k, v in opt.state[p].items()}
        p32.grad, p.grad = grad.float(), grad
        ref.step()  # float32 weights: the torch loop, never the kernel
        with pytest.MonkeyPatch.context() as mp:  # the kernel runs (a loop-against-loop check could not fail)
            mp.setattr(bf16_adamw, "kernel_step_8bit_", lambda *a, **k: launches.append(1) or kernel(*a, **k))
            opt.step()
        mine, theirs = opt.state[p], ref.state[p32]
        for key in ("exp_avg_codes", "exp_avg_sq_codes"):
            diff = (mine[key].int() - theirs[key].int()).abs()
            assert int(diff.max()) <= 1 and int((diff > 0).sum()) <= 1e-3 * n, (step, key)
        for key in ("exp_avg_absmax", "exp_avg_sq_absmax"):
            assert torch.allclose(mine[key], theirs[key], rtol=1e-5, atol=0), (step, key)
        low = p32.detach().to(torch.bfloat16).float()  # the neighbours of the float32 update
        spacing = (low.view(torch.int32) + 65536).view(torch.float32) - low
        out = p.detach().float()
        assert bool(((out - p32.detach()).abs() <= spacing.abs() + 1e-12).all()), step
    assert len(launches) == 3


@pytest.fixture
def interpret_kernel_8bit(monkeypatch):
    """The kernel under Triton's CPU interpreter (as ``test_bf16_adamw.interpret_kernel``)."""
    pytest.importorskip("triton", reason="needs the triton package (dev extra): the kernel runs under its interpreter")
    from twinseq.torch_backend import bf16_adamw
    from twinseq.torch_backend.triton_ce import kernel_mode

    if kernel_mode(torch.device("cpu")) != "interpret":
        pytest.skip("Triton's interpreter is not on in this process (TRITON_INTERPRET=1 before triton's import)")
    monkeypatch.setattr(bf16_adamw, "INTERPRET_ON_CPU", True)


def test_the_8bit_kernel_follows_the_torch_loop(interpret_kernel_8bit):
    _kernel_against_the_torch_loop("cpu")


@pytest.mark.gpu
def test_the_cuda_8bit_kernel_follows_the_torch_loop():
    _kernel_against_the_torch_loop("cuda")
