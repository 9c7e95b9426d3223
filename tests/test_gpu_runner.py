"""benchmarks/gpu/run_all.sh, the GPU lane's one command, as far as a machine without CUDA can run it.

Invariants: usage errors exit 2 with the usage on stderr; ``--help`` exits 0; the ``lane`` stage writes
env.txt, the pytest log and a summary line with the counts and the skip reasons; without CUDA it exits 3
("no CUDA: nothing ran"), or 0 under ``TWINSEQ_ALLOW_NO_CUDA=1``; a pytest failure exits 1.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu" / "run_all.sh"


def _run(*args: str, **env: str) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "PYTHON": sys.executable, "TWINSEQ_WHEELS": "0", **env}
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, env=full_env, capture_output=True, text=True,
                          timeout=300)


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def test_help_lists_the_stages():
    out = _run("--help")
    assert out.returncode == 0, out.stderr
    assert "usage: benchmarks/gpu/run_all.sh OUTDIR [STAGE...]" in out.stdout
    assert all(stage in out.stdout for stage in ("env", "lane", "bench", "all"))


@pytest.mark.parametrize("args, message", [
    ((), "usage:"),
    (("OUT", "bogus"), "unknown stage 'bogus' (choose from: env lane bench all)"),
    (("--verbose",), "unknown option --verbose"),
])
def test_usage_errors_exit_2(tmp_path, args, message):
    out = _run(*(str(tmp_path / a) if a == "OUT" else a for a in args))
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert message in out.stderr
    assert not (tmp_path / "OUT" / "env.txt").exists(), "a usage error must stop before any work"


@pytest.mark.slow
def test_lane_without_cuda_reports_every_skip_and_exits_3(tmp_path):
    if _has_cuda():
        pytest.skip("this machine has CUDA: the lane would run the tests")
    args = dict(PYTEST_ARGS="tests/jax_backend/test_jax_gpu_attention.py")
    out = _run(str(tmp_path / "out"), "lane", **args)
    assert out.returncode == 3, (out.stdout[-3000:], out.stderr[-3000:])
    assert "no CUDA: nothing ran" in out.stdout
    summary = (tmp_path / "out" / "gpu_lane_summary.txt").read_text()
    assert "GPU lane: 0 passed, 0 failed, 3 skipped, 0 errors" in summary
    assert "skipped 3: needs a CUDA GPU" in summary
    log = (tmp_path / "out" / "gpu_lane.log").read_text()
    assert "SKIPPED [" in log and "4 deselected" in log  # -rA lists the skips; the 4 CPU tests are not gpu tests
    env = (tmp_path / "out" / "env.txt").read_text()
    assert "torch: " in env and "import twinseq.common: ok" in env
    allowed = _run(str(tmp_path / "out2"), "lane", TWINSEQ_ALLOW_NO_CUDA="1", **args)
    assert allowed.returncode == 0 and "TWINSEQ_ALLOW_NO_CUDA=1, so exit 0" in allowed.stdout


@pytest.mark.slow
def test_a_pytest_failure_fails_the_lane(tmp_path):
    out = _run(str(tmp_path / "out"), "lane", PYTEST_ARGS="tests/no_such_test_file.py")
    assert out.returncode == 1, (out.stdout[-3000:], out.stderr[-3000:])
    assert "lane FAILED (pytest exit status 4)" in out.stdout
