"""No run loses work: kills, signals and hostile checkpoints, on real training subprocesses.

- Fault injection: a training run is SIGKILLed at random points (at least five times, one of them
  inside a checkpoint save) and restarted each time with ``--resume-from-checkpoint latest``;
  the final weights and every logged loss equal an uninterrupted run's, bit for bit (one
  process, torch and jax), and within the tolerance table for FSDP2 on 2 gloo ranks.
- SIGTERM at a step boundary leaves a checkpoint of that step; the resumed run matches.
- A checkpoint whose file is a pickle that would run code on load is refused, and the code
  does not run.

Every run is a subprocess with a pinned environment (one XLA host device, one torch thread per
rank for FSDP), so that the uninterrupted and the resumed runs compute the same floats.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from twinseq.common.run.report import read_metrics

ENV = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
       "TOKENIZERS_PARALLELISM": "false", "CUDA_VISIBLE_DEVICES": "", "PYTHONUNBUFFERED": "1"}
STEPS = 10
REL = 1e-5  # parity_tests/tolerances.py "adamw_rel": FSDP2 sums gradients in another order


def _args(backend: str, out: Path, *extra: str) -> list[str]:
    return ["train", "--backend", backend, "--output-dir", str(out), "--max-steps", str(STEPS), "--model-config",
            "tiny", "--max-length", "64", "--dataset-split", "train[:200]", "--per-device-train-batch-size", "2",
            "--gradient-accumulation-steps", "2", "--packing", "--padding-free", "--loss-type", "fused_linear",
            "--learning-rate", "3e-3", "--save-steps", "1", "--save-total-limit", "2", "--disable-tqdm", *extra]


def _cmd(backend: str, out: Path, *extra: str, ranks: int = 1) -> list[str]:
    args = _args(backend, out, *extra)
    if ranks == 1:
        return [sys.executable, "-m", "twinseq.common.cli", *args]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
            "-m", "twinseq.common.cli", *args, "--context-parallel-size", "2", "--pad-to-multiple-of", "4"]


def _env(ranks: int) -> dict:
    return {**os.environ, **ENV, **({"OMP_NUM_THREADS": "1"} if ranks > 1 else {})}


def _run(cmd: list[str], ranks: int = 1) -> subprocess.CompletedProcess:
    out = subprocess.run(cmd, env=_env(ranks), capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    return out


def _start(cmd: list[str], ranks: int = 1) -> subprocess.Popen:
    return subprocess.Popen(cmd, env=_env(ranks), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # its own process group: a kill reaches every rank


def _kill(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)


def _progress(out: Path) -> int:
    """The newest complete checkpoint's step (0 before the first)."""
    steps = [int(p.name.split("-")[1]) for p in out.glob("checkpoint-*") if (p / "trainer_state.json").is_file()]
    return max(steps, default=0)


def _wait(proc: subprocess.Popen, until, timeout: float = 300.0) -> bool:
    """Poll ``until()`` every millisecond while ``proc`` runs; True if it held before the process ended."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if until():
            return True
        if proc.poll() is not None:
            return False
        time.sleep(0.001)
    raise TimeoutError("the training subprocess made no progress")


def _kill_at_random_points(backend: str, out: Path, rng: random.Random, kills: int, ranks: int = 1) -> dict:
    """SIGKILL the run ``kills`` times, once inside a checkpoint save, each restart resuming ``latest``."""
    counts = {"kills": 0, "inside_save": 0}
    cmd = _cmd(backend, out, "--resume-from-checkpoint", "latest", ranks=ranks)
    while counts["kills"] < kills:
        before = _progress(out)
        proc = _start(cmd, ranks)
        in_save = counts["inside_save"] == 0 and counts["kills"] >= 1
        if in_save:  # the temporary folder of a save exists: kill mid-write
            hit = _wait(proc, lambda: any(out.glob(".tmp-checkpoint-*")) and _progress(out) > before)
        else:  # anywhere in training, once one new step is safe on disk
            hit = _wait(proc, lambda: _progress(out) >= before + 1 + rng.randrange(3))
            time.sleep(rng.uniform(0.0, 0.3))
        if proc.poll() is not None:  # finished before the kill landed: start over from scratch
            assert proc.returncode == 0, proc.stderr.read()[-3000:]
            shutil.rmtree(out)
            continue
        _kill(proc)
        counts["kills"] += 1
        counts["inside_save"] += int(in_save and hit)
    _run(cmd, ranks)
    return counts


def _final_weights(out: Path) -> dict:
    return load_file(str(out / "final" / "model.safetensors"))


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["torch", "jax"])
def test_sigkill_at_random_points_then_resume_latest_is_bitwise(backend, tmp_path):
    _run(_cmd(backend, tmp_path / "straight"))
    counts = _kill_at_random_points(backend, tmp_path / "killed", random.Random(0), kills=5)
    assert counts["kills"] >= 5 and counts["inside_save"] >= 1, counts
    want, got = _final_weights(tmp_path / "straight"), _final_weights(tmp_path / "killed")
    assert sorted(want) == sorted(got)
    assert all(np.array_equal(want[k], got[k]) for k in want), "resumed weights differ from the uninterrupted run"
    a, b = read_metrics(tmp_path / "straight"), read_metrics(tmp_path / "killed")
    assert [r["step"] for r in b] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in a] == [r["loss"] for r in b]
    assert not list((tmp_path / "killed").glob(".tmp-checkpoint-*")), "an interrupted save was left behind"
    assert len(list((tmp_path / "killed").glob("checkpoint-*"))) <= 2, "save_total_limit=2"


@pytest.mark.slow
@pytest.mark.distributed
def test_fsdp_sigkill_at_random_points_then_resume_latest(tmp_path):
    pytest.importorskip("torch")
    _run(_cmd("torch", tmp_path / "straight", ranks=2), ranks=2)
    counts = _kill_at_random_points("torch", tmp_path / "killed", random.Random(1), kills=5, ranks=2)
    assert counts["kills"] >= 5 and counts["inside_save"] >= 1, counts
    want, got = _final_weights(tmp_path / "straight"), _final_weights(tmp_path / "killed")
    worst = max(float(np.linalg.norm(got[k] - want[k]) / np.linalg.norm(want[k])) for k in want)
    assert worst <= REL, worst
    a, b = read_metrics(tmp_path / "straight"), read_metrics(tmp_path / "killed")
    assert [r["step"] for r in b] == list(range(1, STEPS + 1))
    assert max(abs(x["loss"] - y["loss"]) / abs(x["loss"]) for x, y in zip(a, b)) <= REL


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["torch", "jax"])
def test_sigterm_saves_at_the_step_boundary_and_resumes(backend, tmp_path):
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    _run(_cmd(backend, straight))
    proc = _start(_cmd(backend, stopped, "--save-steps", "100"))  # no cadence: only the signal saves
    assert _wait(proc, lambda: (stopped / "metrics.jsonl").is_file() and
                 len((stopped / "metrics.jsonl").read_text().splitlines()) >= 3)
    os.kill(proc.pid, signal.SIGTERM)
    proc.wait(timeout=120)
    stderr = proc.stderr.read()
    assert proc.returncode == 143, stderr[-3000:]
    assert "stopped by SIGTERM after step" in stderr and "Traceback" not in stderr, stderr[-3000:]
    saved = _progress(stopped)
    assert 3 <= saved < STEPS and (stopped / f"checkpoint-{saved}").is_dir()
    assert [r["step"] for r in read_metrics(stopped)] == list(range(1, saved + 1))
    _run(_cmd(backend, stopped, "--resume-from-checkpoint", "latest"))
    assert [r["loss"] for r in read_metrics(straight)] == [r["loss"] for r in read_metrics(stopped)]
    want, got = _final_weights(straight), _final_weights(stopped)
    assert all(np.array_equal(want[k], got[k]) for k in want)


class _Payload:
    """Unpickling this calls ``Path.touch(marker)``: code that runs on load."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


@pytest.mark.parametrize("backend", ["torch", "jax"])
def test_a_pickled_checkpoint_is_refused_and_its_code_never_runs(backend, tmp_path):
    from twinseq.common.cli import main

    out = tmp_path / "run"
    args = _args(backend, out)
    args[args.index("--max-steps") + 1] = "1"
    assert main(args) == 0
    checkpoint, marker = out / "checkpoint-1", tmp_path / "code-ran"
    payload = pickle.dumps(_Payload(marker))
    (checkpoint / "training_state.safetensors").write_bytes(payload)  # the state file, replaced by a pickle
    (checkpoint / "training_state.pt").write_bytes(payload)  # the format of old checkpoints, beside it
    resumed = _args(backend, out, "--resume-from-checkpoint", str(checkpoint))
    resumed[resumed.index("--max-steps") + 1] = "2"
    assert main(resumed) == 2
    assert not marker.exists(), "loading the checkpoint ran code from a pickle"
    pickle.loads(payload)  # the payload is live: unpickling it does run code
    assert marker.exists()


def test_a_pickled_model_file_is_never_loaded(tmp_path):
    """A model folder that holds only ``pytorch_model.bin`` (a pickle) is refused by both backends."""
    pytest.importorskip("torch")
    from twinseq.common.backend import load_backend
    from twinseq.common.config import ModelConfig
    from twinseq.common.errors import CheckpointError
    from twinseq.common.models.hf_folder import write_hf_checkpoint
    from twinseq.common.models.init import init_weights

    cfg = ModelConfig.preset("tiny")
    folder = write_hf_checkpoint(cfg, init_weights(cfg), tmp_path / "model")
    (folder / "model.safetensors").unlink()
    marker = tmp_path / "code-ran"
    (folder / "pytorch_model.bin").write_bytes(pickle.dumps(_Payload(marker)))
    for backend in ("torch", "jax"):
        with pytest.raises(CheckpointError, match="holds neither model.safetensors"):
            load_backend(backend).load_pretrained(folder)
    assert not marker.exists()
    assert json.loads((folder / "config.json").read_text())["model_type"] == "llama"
