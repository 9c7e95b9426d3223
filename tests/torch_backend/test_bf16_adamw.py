"""``optimizer='adamw_bf16'``: stochastic rounding is unbiased, the update is torch's AdamW, tiny updates are not
lost, a run trains like the float32 one, resumes bitwise, and is refused where it cannot run."""


import pytest
import torch
from safetensors.torch import load_file

from twinseq.common.config import TrainConfig
from twinseq.common.errors import ConfigError
from twinseq.common.run.memory_plan import plan_memory
from twinseq.common.run.report import read_metrics
from twinseq.torch_backend import bf16_adamw
from twinseq.torch_backend.bf16_adamw import AdamWBF16, round_stochastic_
from twinseq.torch_backend.recipes import train

from _sft_data import packed_tiny_config, resume_folder, write_embedded_sft_jsonl


def _neighbours(value: float) -> tuple[float, float]:
    """The two bfloat16 numbers around float32 ``value`` (truncation and one spacing above)."""
    low = torch.tensor([value]).view(torch.int32).bitwise_and(-65536).view(torch.float32)
    high = (low.view(torch.int32) + 65536).view(torch.float32)
    return float(low), float(high)


@pytest.mark.parametrize("value", [1.0 + 2.0**-10, -3.3, 1.0001e-3, 0.1, 7.0])
def test_stochastic_rounding_lands_on_a_neighbour_and_is_unbiased(value):
    torch.manual_seed(0)
    n = 4_000_000
    x = torch.full((n,), value)
    out = torch.empty(n, dtype=torch.bfloat16)
    round_stochastic_(out, x.clone())
    low, high = sorted(_neighbours(value), key=abs)
    low, high = min(low, high), max(low, high)
    assert set(out.float().unique().tolist()) <= {low, high}
    spacing = high - low
    exact = float(torch.tensor(value))
    p_high = (exact - low) / spacing
    mean = out.double().mean().item()
    sigma = spacing * (p_high * (1 - p_high) / n) ** 0.5
    assert abs(mean - exact) <= 6 * sigma + 1e-12, (mean, exact, sigma)
    # negative control: round-to-nearest is biased by up to half a spacing for the same input
    nearest = x.to(torch.bfloat16).double().mean().item()
    if 0.05 < p_high < 0.45 or 0.55 < p_high < 0.95:
        assert abs(nearest - exact) > 6 * sigma


def test_on_float32_parameters_it_is_torch_adamw_exactly():
    torch.manual_seed(1)
    shapes = [(7, 5), (5,), (3, 4)]
    a = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]

    def groups(ps):
        return [{"params": ps[::2], "weight_decay": 0.1}, {"params": ps[1:2], "weight_decay": 0.0}]

    ours = AdamWBF16(groups(a), lr=3e-2, betas=(0.8, 0.95), eps=1e-6)
    ref = torch.optim.AdamW(groups(b), lr=3e-2, betas=(0.8, 0.95), eps=1e-6, foreach=False)
    for step in range(6):
        grads = [torch.randn(s) for s in shapes]
        for p, q, g in zip(a, b, grads):
            p.grad, q.grad = g.clone(), g.clone()
        ours.step()
        ref.step()
        for p, q in zip(a, b):
            assert torch.equal(p, q), f"step {step}: {(p - q).abs().max()}"
    for p, q in zip(a, b):
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(ours.state[p][key], ref.state[q][key])


def test_chunked_update_equals_the_whole_tensor_update(monkeypatch):
    """Chunks bound the float32 temporaries and change no number (float32 weights: no random draws)."""
    torch.manual_seed(2)
    w, g = torch.randn(1000), torch.randn(1000)
    results = []
    for chunk in (1 << 24, 96):
        monkeypatch.setattr(bf16_adamw, "CHUNK", chunk)
        p = torch.nn.Parameter(w.clone())
        opt = AdamWBF16([p], lr=1e-2, weight_decay=0.01)
        for _ in range(3):
            p.grad = g.clone()
            opt.step()
        results.append((p.detach().clone(), opt.state[p]["exp_avg_sq"].clone()))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


def _drift(monkeypatch, rounding, n: int = 20_000, steps: int = 200) -> float:
    """Mean fall of bfloat16 weights from 1.0 after ``steps`` steps whose float32 update is 1e-4 (a 39th of bfloat16's
    spacing just below 1, 2**-8): stochastic rounding keeps it on average, round-to-nearest loses every one."""
    monkeypatch.setattr(bf16_adamw, "round_stochastic_", rounding)
    torch.manual_seed(3)
    p = torch.nn.Parameter(torch.ones(n, dtype=torch.bfloat16))
    opt = AdamWBF16([p], lr=1e-4, eps=1e-12)
    for _ in range(steps):
        p.grad = torch.ones_like(p)  # Adam's normalised step is lr * 1
        opt.step()
    return 1.0 - p.double().mean().item()


def test_updates_below_the_spacing_accumulate_only_with_stochastic_rounding(monkeypatch):
    assert _drift(monkeypatch, round_stochastic_) == pytest.approx(200 * 1e-4, rel=0.05)
    # negative control: round to nearest drops every one of them
    assert _drift(monkeypatch, lambda dst, value: dst.copy_(value)) == 0.0


@pytest.fixture(scope="module")
def sft_jsonl(tmp_path_factory):
    return write_embedded_sft_jsonl(tmp_path_factory.mktemp("data"), 400)


def _cfg(data, out, **kw):
    return packed_tiny_config(data, out, **{"save_final_checkpoint": False, **kw})


@pytest.mark.slow
def test_fifty_steps_reach_the_float32_runs_loss_within_two_percent(sft_jsonl, tmp_path):
    # 64-token rows: the same model and fifty updates as 128 (every weight still rounded to bfloat16 each step) at
    # about half the tokens; the float32 loss still falls by a quarter (0.75x)
    train(_cfg(sft_jsonl, tmp_path / "fp32", max_length=64))
    train(_cfg(sft_jsonl, tmp_path / "bf16", max_length=64, optimizer="adamw_bf16"))
    a, b = read_metrics(tmp_path / "fp32"), read_metrics(tmp_path / "bf16")
    first, last_a, last_b = a[0]["loss"], [r["loss"] for r in a[-5:]], [r["loss"] for r in b[-5:]]
    mean_a, mean_b = sum(last_a) / 5, sum(last_b) / 5
    assert mean_a < 0.8 * first, "the float32 run must train for the comparison to mean anything"
    print(f"loss: first {first:.4f}; mean of the last 5 steps: float32 {mean_a:.4f}, adamw_bf16 {mean_b:.4f}")
    assert abs(mean_b - mean_a) <= 0.02 * mean_a, (mean_a, mean_b)
    weights = load_file(str(tmp_path / "bf16" / "final" / "model.safetensors"))
    assert weights, "the final folder holds the trained weights"


def test_the_run_trains_bfloat16_weights_and_resumes_bitwise(sft_jsonl, tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    kw = dict(max_steps=6, optimizer="adamw_bf16")
    train(_cfg(sft_jsonl, straight, save_steps=3, **kw))
    train(_cfg(sft_jsonl, resumed, resume_from_checkpoint=resume_folder(straight, resumed, 3), **kw))
    a = [r["loss"] for r in read_metrics(straight)]
    b = [r["loss"] for r in read_metrics(resumed)]
    assert a == b and len(a) == 6
    wa = load_file(str(straight / "final" / "model.safetensors"))
    wb = load_file(str(resumed / "final" / "model.safetensors"))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    # the trained weights are bfloat16 numbers (written as float32 or bfloat16, nothing between)
    w = next(iter(wa.values())).float()
    assert torch.equal(w, w.to(torch.bfloat16).float())


def test_the_planner_counts_eight_bytes_of_state_per_parameter():
    kw = dict(model_config="tiny", dtype="bfloat16", max_length=128)
    fp32 = {r.component: r.bytes for r in plan_memory(TrainConfig.from_flat(**kw)).rows}
    bf16 = {r.component: r.bytes for r in plan_memory(TrainConfig.from_flat(optimizer="adamw_bf16", **kw)).rows}
    assert bf16["weights (bfloat16)"] * 2 == fp32["weights (float32)"]
    assert bf16["gradients (bfloat16)"] * 2 == fp32["gradients (float32)"]
    assert bf16["optimizer state (AdamW bfloat16)"] * 2 == fp32["optimizer state (AdamW)"]
    assert "bfloat16 weight copies" in fp32 and "bfloat16 weight copies" not in bf16


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        (dict(use_peft=True), "drop --use-peft"),
        (dict(backend="jax"), "--optimizer adamw_torch"),
    ],
)
def test_where_it_cannot_run_it_is_refused(sft_jsonl, tmp_path, overrides, fragment):
    cfg = _cfg(sft_jsonl, tmp_path, optimizer="adamw_bf16", max_steps=1, **overrides)
    if cfg.backend == "jax":
        with pytest.raises(ConfigError, match="adamw_torch"):
            plan_memory(cfg)
        from twinseq.jax_backend.trainer import check_optimizer

        with pytest.raises(ConfigError) as err:
            check_optimizer(cfg)
    else:
        with pytest.raises(ConfigError) as err:
            train(cfg)
    assert fragment in str(err.value) and "adamw_bf16" in str(err.value)


@pytest.fixture
def interpret_kernel(monkeypatch):
    """Run ``AdamWBF16``'s Triton kernel under Triton's CPU interpreter (the conftest sets TRITON_INTERPRET=1
    on a machine without a GPU before triton is imported)."""
    pytest.importorskip("triton", reason="needs the triton package (dev extra): the kernel runs under its interpreter")
    from twinseq.torch_backend.triton_ce import kernel_mode

    if kernel_mode(torch.device("cpu")) != "interpret":
        pytest.skip("Triton's interpreter is not on in this process (TRITON_INTERPRET=1 before triton's import)")
    monkeypatch.setattr(bf16_adamw, "INTERPRET_ON_CPU", True)


def _within_one_spacing(out: torch.Tensor, ref: torch.Tensor) -> bool:
    """``out`` (bfloat16) is one of the two bfloat16 neighbours of float32 ``ref`` (one float32 ulp of slack on
    either side: the kernel's float32 arithmetic may round a product differently from torch's)."""
    below = torch.nextafter(ref, torch.full_like(ref, -float("inf")))
    above = torch.nextafter(ref, torch.full_like(ref, float("inf")))
    o = out.float()
    ok = torch.zeros_like(o, dtype=torch.bool)
    for r in (below, ref, above):
        lo = r.view(torch.int32).bitwise_and(-65536).view(torch.float32)
        hi = (lo.view(torch.int32) + 65536).view(torch.float32)
        ok |= (o == lo) | (o == hi)
    return bool(ok.all())


def _kernel_step_checks(device: str) -> None:
    torch.manual_seed(6)
    n = 5000 if device == "cpu" else 3_000_001  # on CUDA: many programs and a ragged last block
    p = torch.nn.Parameter(torch.randn(n).to(torch.bfloat16).to(device))
    p.grad = (torch.randn(n) * 1e-2).to(torch.bfloat16).to(device)
    assert bf16_adamw.uses_kernel(p, p.grad) == ("interpret" if device == "cpu" else "cuda")
    start = p.detach().float().cpu()
    opt = AdamWBF16([p], lr=3e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)
    opt.step()
    # the float32 update of torch's AdamW from the same bfloat16 inputs
    g = p.grad.float().cpu()
    m_ref = torch.zeros(n).lerp_(g, 0.2)
    v_ref = torch.zeros(n).mul_(0.95).addcmul_(g, g, value=0.05)
    denom = (v_ref.sqrt() / (1 - 0.95) ** 0.5).add_(1e-6)
    p_ref = start.mul(1 - 3e-2 * 0.1).addcdiv_(m_ref, denom, value=-3e-2 / 0.2)
    assert _within_one_spacing(p.detach().cpu(), p_ref)
    assert _within_one_spacing(opt.state[p]["exp_avg"].cpu(), m_ref)
    assert _within_one_spacing(opt.state[p]["exp_avg_sq"].cpu(), v_ref)
    # negative control: the weights before the step are not such a rounding of the update
    assert not _within_one_spacing(start.to(torch.bfloat16), p_ref)
    # and the roundings are random: some go up from the float32 update, some down
    out = p.detach().float().cpu()
    assert bool((out > p_ref).any()) and bool((out < p_ref).any())


def test_the_kernel_writes_the_float32_update_rounded_to_a_neighbour(interpret_kernel):
    _kernel_step_checks("cpu")


@pytest.mark.gpu
def test_the_cuda_kernel_writes_the_float32_update_rounded_to_a_neighbour():
    _kernel_step_checks("cuda")


def test_the_kernel_keeps_updates_below_the_spacing(interpret_kernel, monkeypatch):
    assert _drift(monkeypatch, round_stochastic_, n=8192, steps=60) == pytest.approx(60 * 1e-4, rel=0.05)
