"""``twinseq memory``'s grand total (plan + process baseline) against the peak RSS of the whole ``twinseq train``
process it plans, both run the way a user runs them: fresh ``python -m twinseq.common.cli`` subprocesses, no hooks.

The shape (``tiny``, LoRA, 8 packed rows x 512 tokens, the default ``nll`` loss) makes the plan about as large as
the runtime (~530 and ~590 MiB on the 2-core CPU machine), so both halves of the total are tested. The peak is the
child's own high-water mark (VmHWM at exit), so neither the test process nor another child counts.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
TOLERANCE = 0.15
MIB = 2**20
UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}
FLAGS = ["--model-config", "tiny", "--max-length", "512", "--packing", "--per-device-train-batch-size", "8",
         "--use-peft"]


# The CLI as ``python -m twinseq.common.cli`` runs it, plus one line at exit: the process's own high-water mark
# (VmHWM). Not ``ru_maxrss`` from ``wait4``: Linux carries a process's maxrss across ``exec``, so a child forked
# from a large parent (pytest, deep in a full run, holds GBs) reports the parent's size.
_RUN_CLI = (
    "import atexit, runpy, sys\n"
    "def hwm():\n"
    "    for line in open('/proc/self/status'):\n"
    "        if line.startswith('VmHWM:'):\n"
    "            print('__VMHWM__', int(line.split()[1]) * 1024, file=sys.stderr)\n"
    "atexit.register(hwm)\n"
    "sys.argv = ['twinseq', *sys.argv[1:]]\n"
    "runpy.run_module('twinseq.common.cli', run_name='__main__')\n"
)


def _cli(args: list[str], env: dict[str, str], log: Path) -> tuple[int, int, str]:
    """Run the CLI with ``args`` in a fresh python: (exit status, the process's peak RSS in bytes, its stdout)."""
    out, err = log.with_suffix(".out"), log.with_suffix(".err")
    with open(out, "w") as fo, open(err, "w") as fe:
        proc = subprocess.run([sys.executable, "-c", _RUN_CLI, *args], stdout=fo, stderr=fe, env=env)
    assert proc.returncode == 0, f"twinseq {' '.join(args)} failed:\n{err.read_text()[-3000:]}"
    peak = re.search(r"^__VMHWM__ (\d+)$", err.read_text(), re.M)
    assert peak, err.read_text()[-3000:]
    return proc.returncode, int(peak.group(1)), out.read_text()


def _bytes(text: str) -> int:
    number, unit = text.split()
    return int(float(number) * UNITS[unit])


def _grand_total(out: str) -> tuple[int, int, str]:
    """(plan total, process baseline, the baseline's source) from the grand-total line's own figures."""
    m = re.search(r"plan total ([0-9.]+ \w+) \+ process baseline ([0-9.]+ \w+)", out)
    assert m, out
    source = re.search(r"^process baseline +[0-9.]+ \w+ +(measured now|cached|estimated):", out, re.M)
    assert source, out
    return _bytes(m.group(1)), _bytes(m.group(2)), source.group(1)


@pytest.fixture
def env(tmp_path):
    env = dict(os.environ, TWINSEQ_CACHE=str(tmp_path / "cache"))
    # a user's cache holds the embedded corpus before they train: build it first, outside the measured run
    _cli(["data", "--show", "0"], env, tmp_path / "data")
    return env


def test_grand_total_is_within_15_percent_of_the_peak_rss_of_the_run(env, tmp_path):
    _, _, first = _cli(["memory", *FLAGS], env, tmp_path / "memory1")
    _, _, second = _cli(["memory", *FLAGS], env, tmp_path / "memory2")
    plan, baseline, source = _grand_total(first)
    assert source == "measured now", first
    assert _grand_total(second) == (plan, baseline, "cached"), second
    assert "comparable with: the peak RSS of the whole `twinseq train` process" in first

    train = ["train", *FLAGS, "--max-steps", "3", "--output-dir", str(tmp_path / "run"), "--disable-tqdm"]
    _, peak, _ = _cli(train, env, tmp_path / "train")
    total = plan + baseline
    error = (total - peak) / peak
    summary = (f"planned {plan / MIB:.1f} MiB + process baseline {baseline / MIB:.1f} MiB = {total / MIB:.1f} MiB; "
               f"peak RSS of twinseq train {peak / MIB:.1f} MiB ({100 * error:+.1f}%)")
    print(summary)
    assert abs(error) <= TOLERANCE, summary


def test_the_measured_runtime_is_the_runtime_of_a_real_import(tmp_path, monkeypatch):
    """The probe itself, for real: a fresh python that imported twinseq's torch trainer holds hundreds of MiB,
    and PEFT's imports add to it."""
    pytest.importorskip("torch")
    from twinseq.common.run.process_baseline import process_baseline

    monkeypatch.setenv("TWINSEQ_CACHE", str(tmp_path))
    full, lora = process_baseline("torch"), process_baseline("torch", peft=True)
    assert full.source == lora.source == "measured now"
    assert 200 * MIB < full.bytes < lora.bytes < 4096 * MIB, (full, lora)
    assert process_baseline("torch").source == "cached"
