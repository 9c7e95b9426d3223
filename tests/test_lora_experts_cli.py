"""``twinseq train --use-peft --lora-target-parameters experts.gate_up_proj experts.down_proj`` on a Qwen3-MoE folder,
both backends: LoRA on the experts trains (the loss falls, the experts' ``lora_B`` leaves zero), the final adapter
folder is PEFT's with the expert tensors in it, and the two backends' losses agree step by step (the CLI row of
parity_tests/TOLERANCES.md, 1e-4 relative)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from twinseq.common.cli import main as cli_main
from twinseq.common.models.configs import ModelConfig
from twinseq.common.models.hf_folder import write_hf_checkpoint
from twinseq.common.models.init import init_weights
from twinseq.common.models.peft import ADAPTER_CONFIG_FILE, read_adapters
from twinseq.common.run.report import read_metrics

EXPERTS = ["experts.gate_up_proj", "experts.down_proj"]
# the same 4 packed documents every step, so that 8 LoRA steps visibly lower the loss
COMMON = (
    "train --task sft --max-steps 8 --max-length 96 --per-device-train-batch-size 4 --disable-tqdm --seed 1 "
    "--logging-steps 1 --dataset-split train[:4] --learning-rate 3e-2 --packing --use-peft --lora-r 8 --lora-alpha 16"
).split()


@pytest.fixture(scope="module")
def moe_folder(tmp_path_factory):
    cfg = ModelConfig.preset("tiny-qwen3-moe")
    folder = tmp_path_factory.mktemp("tiny-qwen3-moe")
    write_hf_checkpoint(cfg, init_weights(cfg, seed=5), folder)
    return folder


@pytest.fixture(scope="module")
def runs(moe_folder, tmp_path_factory):
    """Each backend's run with LoRA on q_proj, v_proj and both expert tensors: {backend: output folder}."""
    out = {}
    for backend in ("torch", "jax"):
        folder = tmp_path_factory.mktemp(f"run-{backend}")
        targets = ["--lora-target-modules", "q_proj", "v_proj", "--lora-target-parameters", *EXPERTS]
        args = [*COMMON, "--backend", backend, "--model-config", str(moe_folder), "--output-dir", str(folder)]
        assert cli_main([*args, "--lora-dropout", "0", *targets]) == 0
        out[backend] = folder
    return out


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["torch", "jax"])
def test_lora_on_experts_trains_from_the_cli(backend, runs):
    out = runs[backend]
    losses = [r["loss"] for r in read_metrics(out)]
    assert len(losses) == 8 and all(np.isfinite(losses))
    assert np.mean(losses[-2:]) < losses[0] - 0.5, losses
    config = json.loads((out / "final" / ADAPTER_CONFIG_FILE).read_text())
    assert sorted(config["target_parameters"]) == sorted(EXPERTS)
    peft, adapters = read_adapters(out / "final", ModelConfig.preset("tiny-qwen3-moe"))
    expert_keys = [k for k in adapters if ".experts." in k]
    assert peft.lora_target_parameters == EXPERTS and len(expert_keys) == 8  # 2 layers x 2 tensors x (A, B)
    assert all(np.abs(adapters[k]).max() > 0 for k in expert_keys if "lora_B" in k)  # lora_B started at zero


@pytest.mark.slow
def test_torch_and_jax_expert_lora_runs_agree(runs):
    torch_losses, jax_losses = ([r["loss"] for r in read_metrics(runs[b])] for b in ("torch", "jax"))
    rel = np.abs(np.subtract(torch_losses, jax_losses)) / np.abs(torch_losses)
    assert rel.max() < 1e-4, (torch_losses, jax_losses)
    assert abs(torch_losses[-1] - torch_losses[0]) > 1e-2  # negative control: the compared losses move


def test_lora_on_experts_with_dropout_is_refused_naming_the_fix(moe_folder, tmp_path, capsys):
    """PEFT's ParamWrapper has no dropout: the default ``lora_dropout=0.05`` is refused before anything trains."""
    args = [*COMMON, "--backend", "torch", "--model-config", str(moe_folder), "--output-dir", str(tmp_path / "run")]
    assert cli_main([*args, "--lora-target-parameters", *EXPERTS]) == 2
    err = capsys.readouterr().err
    assert "lora_dropout=0.05" in err and "--lora-dropout 0" in err, err
    assert not (tmp_path / "run" / "final").exists()


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["torch", "jax"])
def test_qlora_on_experts_trains_from_the_cli_in_a_fresh_process(backend, moe_folder, tmp_path):
    """``--load-in-4bit`` with LoRA on the experts: the log counts the NF4 expert tensors, the loss falls, and the
    adapter folder is PEFT's with trained expert ``lora_B``s; run as a user runs it, in a fresh process."""
    import subprocess
    import sys

    cfg = ModelConfig.preset("tiny-qwen3-moe")
    targets = ["--lora-target-modules", "q_proj", "v_proj", "--lora-target-parameters", *EXPERTS]
    argv = [*COMMON, "--backend", backend, "--lora-dropout", "0", "--load-in-4bit", *targets,
            "--model-config", str(moe_folder), "--output-dir", str(tmp_path / "run")]  # fmt: skip
    out = subprocess.run(
        [sys.executable, "-m", "twinseq.common.cli", *argv], capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-4000:]
    assert f"{2 * cfg.num_hidden_layers} expert tensors quantised to NF4" in out.stderr, out.stderr[-2000:]
    losses = [r["loss"] for r in read_metrics(tmp_path / "run")]
    assert len(losses) == 8 and np.mean(losses[-2:]) < losses[0] - 0.5, losses
    final = tmp_path / "run" / "final"
    assert json.loads((final / ADAPTER_CONFIG_FILE).read_text())["target_parameters"] == EXPERTS
    _, adapters = read_adapters(final, cfg)
    expert_b = [k for k in adapters if ".experts." in k and "lora_B" in k]
    assert len(expert_b) == 4 and all(np.abs(adapters[k]).max() > 0 for k in expert_b)
