"""``report_to="wandb"`` with the real ``wandb`` package (extra ``twinseq[wandb]``), offline: no account, no network.

Invariants:
- a run with ``--report-to wandb`` and ``WANDB_MODE=offline`` writes one offline run under ``WANDB_DIR`` whose
  history, read back with wandb's own record reader, holds each step's ``train/loss`` equal to ``metrics.jsonl``'s,
  at the same step; its config is the run's config, its name ``--run-name``, its project ``WANDB_PROJECT``;
- an evaluation line's ``eval_loss`` is ``eval/loss`` (Hugging Face's names); a metric that is not a number is
  skipped with a warning;
- without the package, ``report_to="wandb"`` is a ``MissingDependencyError`` naming the extra, before
  ``metrics.jsonl`` is touched.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from twinseq.common.run.report import RunLogger, read_metrics

STEP = {"num_tokens": 64, "tokens_per_second": 1000.0, "peak_memory_bytes": 2**20}


@pytest.fixture
def offline(tmp_path, monkeypatch) -> Path:
    """wandb offline, every file of it under ``tmp_path/wandb_home`` (no write to the user's ~/.config/wandb)."""
    home = tmp_path / "wandb_home"
    for name in ("WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(home))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_PROJECT", "twinseq-tests")
    monkeypatch.setenv("WANDB_ERROR_REPORTING", "false")
    monkeypatch.setenv("WANDB_CONSOLE", "off")  # wandb must not wrap pytest's captured streams
    return home


def read_offline_run(wandb_dir: Path) -> dict:
    """The one offline run under ``wandb_dir/wandb``, read with wandb's own reader of its ``.wandb`` file:
    ``{"project", "name", "config", "history": [row, ...]}`` (a row: its metrics and ``_step``)."""
    from wandb.proto import wandb_internal_pb2 as pb
    from wandb.sdk.internal.datastore import DataStore

    (path,) = (wandb_dir / "wandb").glob("offline-run-*/run-*.wandb")
    store = DataStore()
    store.open_for_scan(str(path))
    run: dict = {"config": {}, "history": []}
    while (data := store.scan_data()) is not None:
        record = pb.Record()
        record.ParseFromString(data)
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run["project"], run["name"] = record.run.project, record.run.display_name
            updates = record.run.config.update
        elif kind == "config":
            updates = record.config.update
        elif kind == "history":
            items = record.history.item
            run["history"].append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in items})
            continue
        else:
            continue
        run["config"].update({u.key: json.loads(u.value_json) for u in updates if u.key != "_wandb"})
    return run


@pytest.mark.slow  # fast-tier budget: runs in make test-all and CI
def test_the_sink_logs_steps_config_and_name(offline, tmp_path, caplog):
    pytest.importorskip("wandb")
    log = RunLogger(tmp_path / "out", max_steps=3, disable_tqdm=True, report_to=["wandb"])
    log.log_config({"run_name": "tiny-run", "optim": {"learning_rate": 1e-3}, "output_dir": Path("out")})
    log.log_step({"step": 1, "loss": 2.5, **STEP, "note": "text"})
    log.log_step({"step": 2, "loss": 2.0, **STEP})
    log.log_eval({"step": 2, "epoch": 1.0, "eval_loss": 2.25})
    log.close()
    import wandb

    wandb.teardown()
    run = read_offline_run(offline)
    assert run["project"] == "twinseq-tests"
    assert run["name"] == "tiny-run"
    assert run["config"]["optim"] == {"learning_rate": 1e-3} and run["config"]["output_dir"] == "out"
    losses = [(r["_step"], r["train/loss"]) for r in run["history"] if "train/loss" in r]
    assert losses == [(1, 2.5), (2, 2.0)]
    assert [(r["_step"], r["eval/loss"]) for r in run["history"] if "eval/loss" in r] == [(2, 2.25)]
    assert all("train/note" not in r for r in run["history"])
    assert "'note' is a str" in caplog.text
    assert [r["loss"] for r in read_metrics(tmp_path / "out")] == [2.5, 2.0]


@pytest.mark.slow  # the fast tier is at its 10-minute budget; make test-all runs it
def test_a_tiny_training_run_reports_its_losses_to_an_offline_wandb_run(offline, tmp_path):
    pytest.importorskip("wandb")
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "twinseq.common.cli", "train", "--backend", "jax", "--max-steps", "3",
         "--max-length", "64", "--per-device-train-batch-size", "2", "--output-dir", str(out), "--disable-tqdm",
         "--no-save-final-checkpoint", "--report-to", "wandb", "--run-name", "tiny"],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = read_offline_run(offline)
    expected = [(r["step"], r["loss"]) for r in read_metrics(out)]
    assert len(expected) == 3
    assert [(r["_step"], r["train/loss"]) for r in run["history"] if "train/loss" in r] == expected
    assert run["name"] == "tiny" and run["project"] == "twinseq-tests"
    assert run["config"]["max_steps"] == 3 and run["config"]["report_to"] == ["wandb"]
    assert run["config"]["data"]["max_length"] == 64


def test_a_missing_wandb_names_the_extra(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    code = textwrap.dedent(f"""
        import sys
        sys.modules["wandb"] = None  # an import of it raises ImportError
        from twinseq.common.errors import MissingDependencyError
        from twinseq.common.run.report import RunLogger
        try:
            RunLogger({str(tmp_path)!r}, max_steps=1, disable_tqdm=True, report_to="wandb")
        except MissingDependencyError as err:
            print(err)
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "WANDB_MODE": "offline"})
    assert proc.returncode == 0, proc.stderr
    assert "report_to='wandb'" in proc.stdout and "pip install -e '.[wandb]'" in proc.stdout
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1}\n'


def test_the_run_goes_under_output_dir_without_wandb_dir(offline, tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.delenv("WANDB_DIR")
    log = RunLogger(tmp_path / "out", max_steps=1, disable_tqdm=True, report_to="wandb")
    log.log_step({"step": 1, "loss": 1.5, **STEP})
    log.close()
    import wandb

    wandb.teardown()
    assert [(r["_step"], r["train/loss"]) for r in read_offline_run(tmp_path / "out")["history"]] == [(1, 1.5)]
