"""``optimizer_in_backward=True``: each parameter steps in its gradient's hook and its gradient is freed there.

Invariants:
- on float32 weights the run is the after-backward run, number for number: the same losses, gradient norms and final
  weights (SFT and DPO), since every update reads only its own gradient and state;
- at most one gradient is alive when a hook runs, where the after-backward step holds every one of them (the
  negative control: the same count without the hooks reaches the number of parameters);
- with ``adamw_bf16_8bit`` it trains, and a run resumed from a checkpoint is bit-identical to the uninterrupted one
  (the 8-bit moments' float32 absmax comes back float32 under bfloat16 weights);
- a second gradient for a parameter in one step is refused, not applied twice.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from twinseq.common.config import TrainConfig
from twinseq.common.models.configs import ModelConfig
from twinseq.common.models.init import init_weights
from twinseq.common.run.report import read_metrics
from twinseq.torch_backend.bf16_adamw import AdamWBF16
from twinseq.torch_backend.in_backward import StepInBackward
from twinseq.torch_backend.model import build_model
from twinseq.torch_backend.recipes import train

from _sft_data import packed_tiny_config, resume_folder, write_embedded_sft_jsonl


@pytest.fixture(scope="module")
def sft_jsonl(tmp_path_factory):
    return write_embedded_sft_jsonl(tmp_path_factory.mktemp("data"), 200)


def _cfg(data, out, **kw):
    return packed_tiny_config(data, out, **{"max_steps": 5, "max_grad_norm": None, **kw})


def _weights(folder):
    return load_file(str(folder / "final" / "model.safetensors"))


def test_sft_in_backward_is_the_after_backward_run_exactly(sft_jsonl, tmp_path):
    train(_cfg(sft_jsonl, tmp_path / "after"))
    train(_cfg(sft_jsonl, tmp_path / "in", optimizer_in_backward=True))
    a, b = read_metrics(tmp_path / "after"), read_metrics(tmp_path / "in")
    assert [r["loss"] for r in a] == [r["loss"] for r in b] and len(a) == 5
    for ra, rb in zip(a, b):
        assert rb["grad_norm"] == pytest.approx(ra["grad_norm"], rel=1e-12)
    wa, wb = _weights(tmp_path / "after"), _weights(tmp_path / "in")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    # negative control: the comparison sees a different update (another learning rate)
    train(_cfg(sft_jsonl, tmp_path / "other", optimizer_in_backward=True, learning_rate=2e-3))
    assert [r["loss"] for r in read_metrics(tmp_path / "other")][1:] != [r["loss"] for r in a][1:]


@pytest.mark.slow
def test_dpo_in_backward_is_the_after_backward_run_exactly(tmp_path):
    data = "embedded"  # the embedded preference pairs
    kw = dict(task="dpo", packing=False, padding_free=True, max_length=96, learning_rate=1e-3, max_steps=4)
    train(_cfg(data, tmp_path / "after", **kw))
    train(_cfg(data, tmp_path / "in", optimizer_in_backward=True, **kw))
    a, b = read_metrics(tmp_path / "after"), read_metrics(tmp_path / "in")
    assert [r["loss"] for r in a] == [r["loss"] for r in b] and len(a) == 4
    wa, wb = _weights(tmp_path / "after"), _weights(tmp_path / "in")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_lora_in_backward_is_the_after_backward_run_exactly(sft_jsonl, tmp_path):
    """Only the adapters get hooks (the frozen base has no gradient)."""
    kw = dict(use_peft=True, learning_rate=1e-2, save_final_checkpoint=False)
    train(_cfg(sft_jsonl, tmp_path / "after", **kw))
    train(_cfg(sft_jsonl, tmp_path / "in", optimizer_in_backward=True, **kw))
    a, b = read_metrics(tmp_path / "after"), read_metrics(tmp_path / "in")
    assert [r["loss"] for r in a] == [r["loss"] for r in b] and a[-1]["loss"] < a[0]["loss"]


def _live_gradients(in_backward: bool) -> tuple[int, int]:
    """(the most parameters holding a gradient when any parameter's gradient completes, the parameter count) over
    one backward of the tiny model."""
    cfg = ModelConfig.preset("tiny")
    model = build_model(cfg, init_weights(cfg, seed=0), attn_implementation="sdpa").train()
    params = [p for p in model.parameters() if p.requires_grad]
    most = 0

    def count(_p):
        nonlocal most
        most = max(most, sum(q.grad is not None for q in params))

    for p in params:  # registered first: runs before the step's hook frees the gradient
        p.register_post_accumulate_grad_hook(count)
    optimizer = AdamWBF16(params, lr=1e-3)
    if in_backward:
        StepInBackward(model, optimizer)
    ids = torch.randint(0, cfg.vocab_size, (2, 32))
    model(input_ids=ids, labels=ids).loss.backward()
    return most, len(params)


def test_one_gradient_is_alive_at_a_time():
    most, n = _live_gradients(in_backward=True)
    assert most == 1, most
    # negative control: after-backward stepping holds them all by the end of backward
    most, n = _live_gradients(in_backward=False)
    assert most == n > 10


def test_a_second_gradient_in_one_step_is_refused():
    p = torch.nn.Parameter(torch.ones(3))
    module = torch.nn.Module()
    module.p = p
    StepInBackward(module, AdamWBF16([p], lr=1e-3))
    (p * 2).sum().backward()
    before = p.detach().clone()
    with pytest.raises(RuntimeError, match="second gradient in one optimizer step"):
        (p * 3).sum().backward()
    assert torch.equal(p.detach(), before), "the second gradient never reached the weight"


def test_bf16_8bit_in_backward_resumes_bitwise(sft_jsonl, tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    kw = dict(max_steps=6, optimizer="adamw_bf16_8bit", optimizer_in_backward=True, max_length=256)
    train(_cfg(sft_jsonl, straight, save_steps=3, **kw))
    train(_cfg(sft_jsonl, resumed, resume_from_checkpoint=resume_folder(straight, resumed, 3), **kw))
    a = [r["loss"] for r in read_metrics(straight)]
    b = [r["loss"] for r in read_metrics(resumed)]
    assert a == b and len(a) == 6 and a[-1] < a[0]
    wa, wb = _weights(straight), _weights(resumed)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_the_planner_holds_one_gradient_and_no_optimizer_step_moment():
    from twinseq.common.models.init import parameter_shapes
    from twinseq.common.run.memory_plan import plan_memory

    # few tokens: the optimizer-step moment (every gradient) is the peak after backward
    kw = dict(
        model_config="small",
        max_length=64,
        per_device_train_batch_size=1,
        loss_type="fused_linear",
        max_grad_norm=None,
        gradient_checkpointing=True,
    )
    after = plan_memory(TrainConfig.from_flat(**kw))
    inside = plan_memory(TrainConfig.from_flat(optimizer_in_backward=True, **kw))
    rows = {r.component: r.bytes for r in inside.rows}
    largest = max(int(torch.Size(s).numel()) for s in parameter_shapes(ModelConfig.preset("small")).values())
    assert rows["gradients (float32, one at a time)"] == largest * 4
    assert {r.component: r.bytes for r in after.rows}["gradients (float32)"] == after.trainable_parameters * 4
    saved = after.total - inside.total
    assert 0 < saved <= after.trainable_parameters * 4, saved  # at most every gradient
    with pytest.raises(Exception, match="--optimizer-in-backward"):
        plan_memory(TrainConfig.from_flat(optimizer_in_backward=True, backend="jax", **kw))


def test_the_installed_command_plans_and_trains_the_smallest_state(tmp_path):
    """What a user types, in fresh processes: ``twinseq memory`` shows one gradient at a time, ``twinseq train``
    trains with bfloat16 weights, 8-bit moments and the step in backward, and logs the gradient norm."""
    exe = str(Path(sys.executable).with_name("twinseq"))
    flags = ["--model-config", "tiny", "--max-length", "128", "--per-device-train-batch-size", "2", "--optimizer",
             "adamw_bf16_8bit", "--optimizer-in-backward", "--max-grad-norm", "None"]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    plan = subprocess.run([exe, "memory", *flags], capture_output=True, text=True, timeout=300, env=env)
    assert plan.returncode == 0, plan.stderr[-2000:]
    assert "gradients (bfloat16, one at a time)" in plan.stdout and "optimizer state (AdamW 8-bit)" in plan.stdout
    out = tmp_path / "run"
    done = subprocess.run(
        [exe, "train", *flags, "--max-steps", "3", "--output-dir", str(out), "--disable-tqdm", "--learning-rate",
         "1e-3"],
        capture_output=True, text=True, timeout=600, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "grad_norm" in r]
    assert len(steps) == 3 and all(r["grad_norm"] > 0 for r in steps)
