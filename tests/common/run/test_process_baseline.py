"""The process baseline under ``twinseq memory``'s table: the baseline line, the grand total, what it is comparable
with, and the per-machine cache (``$TWINSEQ_CACHE/process_baseline``).

Fast: the probe (a fresh python importing a backend, seconds) is replaced by a counter here; the real probe, and the
grand total against a real run's peak RSS, are ``tests/test_memory_grand_total.py`` (slow).
"""

from __future__ import annotations

import json
import re
import sys

import pytest

from twinseq.common.cli import main
from twinseq.common.config import TrainConfig
from twinseq.common.run import process_baseline as pb
from twinseq.common.run.memory_plan import format_bytes, plan_memory

MIB = 2**20
ARGV = ["memory", "--model-config", "tiny", "--max-length", "512", "--packing", "--per-device-train-batch-size", "8",
        "--use-peft"]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TWINSEQ_CACHE", str(tmp_path))
    return tmp_path


@pytest.fixture
def probes(monkeypatch):
    """Each probe the CLI would run, recorded; it 'measures' 600 MiB."""
    calls = []

    def fake(backend, peft, python, timeout):
        calls.append((backend, peft, python))
        return {"rss_bytes": 600 * MIB, "how": "VmRSS"}

    monkeypatch.setattr(pb, "_measure", fake)
    return calls


def _lines(out: str) -> dict[str, str]:
    return {name: next(ln for ln in out.splitlines() if ln.startswith(name))
            for name in ("total ", "process baseline", "grand total", "comparable with:")}


def test_cli_prints_the_baseline_the_grand_total_and_what_it_compares_with(cache, probes, capsys):
    assert main(ARGV) == 0
    out = capsys.readouterr().out
    lines = _lines(out)
    plan = plan_memory(TrainConfig.from_flat(model_config="tiny", max_length=512, packing=True,
                                             per_device_train_batch_size=8, use_peft=True))
    baseline = lines["process baseline"]
    assert "600.00 MiB  measured now: python with twinseq's torch trainer + peft/bitsandbytes imported" in baseline
    assert format_bytes(plan.total + 600 * MIB) in lines["grand total"]
    assert f"plan total {format_bytes(plan.total)} + process baseline 600.00 MiB" in lines["grand total"]
    assert "the peak RSS of the whole `twinseq train` process" in lines["comparable with:"]
    # the per-component rows come first, unchanged: the table is plan.table() verbatim
    assert out.startswith(plan.table() + "\n")
    assert probes == [("torch", True, sys.executable)]


def test_the_second_run_reads_the_cache(cache, probes, capsys):
    assert main(ARGV) == 0
    first = _lines(capsys.readouterr().out)
    assert main(ARGV) == 0
    second = _lines(capsys.readouterr().out)
    assert len(probes) == 1, "the second twinseq memory measured again instead of reading the cache"
    assert "measured now:" in first["process baseline"]
    assert "  cached: python with twinseq's torch trainer" in second["process baseline"]
    assert first["grand total"] == second["grand total"]
    (path,) = (cache / "process_baseline").glob("torch-peft-*.json")
    record = json.loads(path.read_text())
    assert record["rss_bytes"] == 600 * MIB and record["key"]["backend"] == "torch"
    assert str(path) in second["process baseline"]


def test_the_cache_is_keyed_by_backend_peft_python_and_versions(cache, monkeypatch):
    paths = {pb.baseline_cache_path("torch"), pb.baseline_cache_path("torch", peft=True),
             pb.baseline_cache_path("jax"), pb.baseline_cache_path("torch", python="/other/python")}
    assert len(paths) == 4
    before = pb.baseline_cache_path("torch")
    monkeypatch.setattr(pb, "_version", lambda dist: "99.0")
    assert pb.baseline_cache_path("torch") != before


def test_a_baseline_that_cannot_be_measured_is_estimated_and_says_why(cache, tmp_path):
    missing = pb.process_baseline("torch", peft=True, python=str(tmp_path / "no-such-python"))
    assert missing.source == "estimated" and "not measured" in missing.detail
    assert missing.bytes == pb.ESTIMATED_BASELINE_BYTES["torch"] + pb.ESTIMATED_PEFT_BYTES["torch"]
    failing = tmp_path / "failing-python"
    failing.write_text("#!/bin/sh\necho 'ModuleNotFoundError: No module named torch' >&2\nexit 1\n")
    failing.chmod(0o755)
    got = pb.process_baseline("jax", python=str(failing))
    assert got.source == "estimated" and "No module named torch" in got.detail
    assert got.bytes == pb.ESTIMATED_BASELINE_BYTES["jax"]
    assert not (cache / "process_baseline").exists() or not any((cache / "process_baseline").iterdir())


def test_a_corrupt_cache_is_measured_again(cache, probes):
    path = pb.baseline_cache_path("torch")
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    assert pb.process_baseline("torch").source == "measured now" and len(probes) == 1
    assert pb.process_baseline("torch").source == "cached" and len(probes) == 1


def test_on_cuda_the_baseline_is_the_cuda_context(cache, probes, capsys):
    assert main([*ARGV, "--device", "cuda", "--dtype", "bfloat16"]) == 0
    lines = _lines(capsys.readouterr().out)
    assert re.search(r"process baseline +512\.00 MiB +estimated: the CUDA context", lines["process baseline"])
    assert "no GPU was available to measure it" in lines["process baseline"]
    assert "torch.cuda.max_memory_allocated() plus the CUDA context" in lines["comparable with:"]
    assert probes == [] and not (cache / "process_baseline").exists()
