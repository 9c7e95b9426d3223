"""The trainers end to end through the CLI, on both backends: the same command, the same checks.

- DPO logs TRL's reward metrics, with the policy equal to the reference at step 1;
- a DPO run resumed from its step-2 checkpoint continues bitwise (CPU, float32), and its live
  reference is the initial model, not the checkpoint;
- DPO learns the embedded preferences.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from twinseq.common.cli import main as cli_main
from twinseq.common.run.report import REQUIRED_FIELDS, read_metrics

BACKENDS = ["torch", "jax"]
REWARD_FIELDS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
                 "logps/rejected", "num_pairs")


def _dpo_args(backend: str, out, *extra) -> list[str]:
    return ["train", "--task", "dpo", "--backend", backend, "--output-dir", str(out), "--max-steps", "3",
            "--max-length", "64", "--dataset-split", "train[:24]", "--per-device-train-batch-size", "2",
            "--gradient-accumulation-steps", "2", "--disable-tqdm", "--seed", "1", *extra]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("extra", [
    ("--loss-type", "fused_linear"),
    pytest.param(("--padding-free", "--precompute-ref-log-probs", "--loss-type", "chunked_nll", "--dpo-loss-type",
                  "sigmoid", "bco_pair", "--loss-weights", "1.0", "0.5"), marks=pytest.mark.slow),
])
def test_dpo_cli_trains_and_logs_reward_metrics(backend, tmp_path, extra):
    assert cli_main(_dpo_args(backend, tmp_path, *extra)) == 0
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:
        assert all(k in r for k in REQUIRED_FIELDS + REWARD_FIELDS)
        assert r["num_pairs"] == 4 and r["num_tokens"] > r["num_label_tokens"] > 0 and r["peak_memory_bytes"] > 0
        assert 0.0 <= r["rewards/accuracies"] <= 1.0
        assert r["rewards/margins"] == pytest.approx(r["rewards/chosen"] - r["rewards/rejected"], abs=1e-9)
    # step 1: the policy is the reference, so every reward is 0 up to rounding and no pair is won
    assert abs(records[0]["rewards/margins"]) <= 1e-5
    assert (tmp_path / "final" / "model.safetensors").is_file()


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_dpo_resume_keeps_the_initial_reference(backend, tmp_path):
    """4 steps straight == 2 steps + resume from checkpoint-2 (CPU, float32, bitwise): the live
    reference of the resumed run is the initial model, not the checkpoint."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    args = ("--max-steps", "4", "--save-steps", "2", "--dataset-split", "train[:16]")
    assert cli_main(_dpo_args(backend, straight, *args)) == 0
    resumed.mkdir()
    shutil.copytree(straight / "checkpoint-2", resumed / "checkpoint-2")
    assert cli_main(_dpo_args(backend, resumed, *args, "--resume-from-checkpoint", "latest")) == 0
    a, b = read_metrics(straight)[2:], read_metrics(resumed)
    assert [r["step"] for r in b] == [3, 4]
    assert [(r["loss"], r["rewards/margins"]) for r in a] == [(r["loss"], r["rewards/margins"]) for r in b]


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_dpo_learns_the_embedded_preferences(backend, tmp_path):
    """tiny model, embedded preference data (400 pairs), batch 8, lr 1e-3, beta 0.1: the mean
    ``rewards/accuracies`` of the last 10 of 30 steps exceeds 0.7 (TRL's metric on the training pairs).
    Caveat: the rejected answer is a word shuffle of the chosen docstring, which is easy to tell apart."""
    args = ["train", "--task", "dpo", "--backend", backend, "--output-dir", str(tmp_path), "--max-steps", "30",
            "--max-length", "128", "--dataset-split", "train[:400]", "--per-device-train-batch-size", "8",
            "--learning-rate", "1e-3", "--beta", "0.1", "--loss-type", "fused_linear", "--disable-tqdm"]
    assert cli_main(args) == 0
    accuracies = [r["rewards/accuracies"] for r in read_metrics(tmp_path)]
    assert np.mean(accuracies[-10:]) > 0.7, accuracies
    assert accuracies[0] == 0.0  # at step 1 the policy is the reference: ties, and a tie is not a win


def _diverging_args(backend: str, out, *extra) -> list[str]:
    """A learning rate so large that the first update blows the weights up: the next loss is not finite."""
    return ["train", "--backend", backend, "--output-dir", str(out), "--max-steps", "6", "--max-length", "64",
            "--dataset-split", "train[:64]", "--per-device-train-batch-size", "2", "--gradient-accumulation-steps",
            "2", "--learning-rate", "1e30", "--lr-scheduler-type", "constant", "--max-grad-norm", "None",
            "--save-steps", "1", "--disable-tqdm", *extra]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_non_finite_step_stops_the_run_before_its_update(backend, tmp_path, capsys):
    assert cli_main(_diverging_args(backend, tmp_path)) == 2
    err = capsys.readouterr().err
    line = next(line for line in err.splitlines() if line.startswith("twinseq train: error: "))
    step = int(line.split("step ")[1].split(":")[0])
    assert step >= 2 and ("the loss of micro-batch 0 is" in line or "the gradient norm is" in line), line
    assert f"checkpoint-{step - 1}" in line and "--skip-nonfinite-steps" in line
    assert (tmp_path / f"checkpoint-{step - 1}").is_dir() and not (tmp_path / f"checkpoint-{step}").exists()
    assert [r["step"] for r in read_metrics(tmp_path)] == list(range(1, step))
    assert not (tmp_path / "final").exists()


@pytest.mark.parametrize("backend", BACKENDS)
def test_skip_nonfinite_steps_counts_and_logs_them(backend, tmp_path, capsys):
    assert cli_main(_diverging_args(backend, tmp_path, "--skip-nonfinite-steps")) == 0
    records = read_metrics(tmp_path)
    skipped = sum(r["num_skipped_steps"] for r in records)
    assert [r["step"] for r in records] == list(range(1, 7)) and skipped >= 1
    assert records[0]["num_skipped_steps"] == 0 and records[-1]["num_skipped_steps"] == 1
    assert f"skipped {skipped} optimizer step(s)" in capsys.readouterr().out
