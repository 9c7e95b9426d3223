"""``report_to="tensorboard"``: real event files, read back offline with TensorBoard's own loader."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from twinseq.common.run.report import (REPORT_TO_CHOICES, RunLogger, TensorBoardSink, parse_report_to,
                                    read_metrics)

event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")


def _step(step: int, loss: float, **extra) -> dict:
    return {"step": step, "loss": loss, "num_tokens": 512 * step, "tokens_per_second": 1000.0 + step,
            "peak_memory_bytes": 2**20 * step, **extra}


def _scalars(logdir, *, purge: bool = True) -> dict[str, list[tuple[int, float]]]:
    acc = event_accumulator.EventAccumulator(str(logdir), purge_orphaned_data=purge)
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _run(output_dir, steps, *, resume_step=0, **kwargs) -> None:
    log = RunLogger(output_dir, max_steps=10, disable_tqdm=True, resume_step=resume_step, report_to="tensorboard",
                    **kwargs)
    for metrics in steps:
        log.log_step(metrics)
    log.close()


def test_scalars_round_trip_exactly(tmp_path):
    """Every numeric metric becomes ``train/<name>`` at its step; float32 values come back bit for bit."""
    steps = [_step(1, 2.5, lr=1e-3, grad_norm=0.75, **{"rewards/accuracies": 0.5}),
             _step(2, 2.25, lr=5e-4, grad_norm=0.1, **{"rewards/accuracies": 0.625}),
             _step(3, 0.1, lr=2.0**-12, grad_norm=3.0, **{"rewards/accuracies": 1.0})]
    _run(tmp_path, steps)

    scalars = _scalars(tmp_path / "runs")
    names = ["loss", "num_tokens", "tokens_per_second", "peak_memory_bytes", "lr", "grad_norm", "rewards/accuracies"]
    assert sorted(scalars) == sorted(f"train/{n}" for n in names)
    for name in names:
        expected = [(m["step"], float(np.float32(m[name]))) for m in steps]
        assert scalars[f"train/{name}"] == expected, name
    assert scalars["train/loss"][0] == (1, 2.5)  # exactly representable: no rounding at all
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3]  # the jsonl file is still written


def test_non_numeric_metrics_are_skipped_with_one_warning(tmp_path, caplog):
    _run(tmp_path, [_step(1, 1.0, phase="warmup"), _step(2, 0.5, phase="main")])
    assert "train/phase" not in _scalars(tmp_path / "runs")
    assert sum("'phase'" in r.getMessage() for r in caplog.records) == 1
    assert [r["phase"] for r in read_metrics(tmp_path)] == ["warmup", "main"]


def test_resume_cuts_orphaned_steps_for_every_reader(tmp_path):
    """Checkpoint at 3, crash after 5, resume at 3: steps 4 and 5 appear once, with the new values."""
    _run(tmp_path, [_step(s, 10.0 - s) for s in range(1, 6)])
    _run(tmp_path, [_step(s, 100.0 + s) for s in range(4, 7)], resume_step=3)

    expected = [(1, 9.0), (2, 8.0), (3, 7.0), (4, 104.0), (5, 105.0), (6, 106.0)]
    assert _scalars(tmp_path / "runs")["train/loss"] == expected
    # Without TensorBoard's purge the view is the same: the orphans are gone from disk.
    assert _scalars(tmp_path / "runs", purge=False)["train/loss"] == expected
    assert [(r["step"], r["loss"]) for r in read_metrics(tmp_path)] == expected

    files = sorted((tmp_path / "runs").iterdir())
    assert len(files) == 1 and "tfevents" in files[0].name
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    events = list(EventFileLoader(str(files[0])).Load())
    assert events[0].file_version == "brain.Event:2"
    starts = [e.step for e in events if e.HasField("session_log")]
    assert starts == [4]


def test_resume_after_a_torn_write_keeps_the_file_readable(tmp_path):
    """A crash mid-record leaves a partial record; resuming drops it instead of appending after it."""
    _run(tmp_path, [_step(s, float(s)) for s in range(1, 4)])
    (path,) = (tmp_path / "runs").iterdir()
    data = path.read_bytes()
    path.write_bytes(data + data[-40:-10])  # a torn copy of the last record's bytes
    _run(tmp_path, [_step(4, 4.0)], resume_step=3)
    assert _scalars(tmp_path / "runs")["train/loss"] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0)]


def test_fresh_run_replaces_old_event_files(tmp_path):
    _run(tmp_path, [_step(s, 1.0) for s in range(1, 4)])
    _run(tmp_path, [_step(1, 5.0)])
    assert _scalars(tmp_path / "runs")["train/loss"] == [(1, 5.0)]
    assert len(list((tmp_path / "runs").iterdir())) == 1


def test_logging_dir_and_config_text(tmp_path):
    @dataclasses.dataclass
    class Optim:
        learning_rate: float = 1e-3

    @dataclasses.dataclass
    class Config:
        max_steps: int = 3
        optim: Optim = dataclasses.field(default_factory=Optim)
        output_dir: str = "a|b"

    log = RunLogger(tmp_path / "out", max_steps=3, disable_tqdm=True, report_to=["tensorboard"],
                    logging_dir=tmp_path / "tb")
    log.log_config(Config())
    log.log_step(_step(1, 1.0))
    log.close()
    assert not (tmp_path / "out" / "runs").exists()
    acc = event_accumulator.EventAccumulator(str(tmp_path / "tb"), size_guidance={"tensors": 0})
    acc.Reload()
    (text_event,) = acc.Tensors("config")
    text = text_event.tensor_proto.string_val[0].decode()
    assert text_event.step == 1
    assert "| `max_steps` | `3` |" in text and "| `optim.learning_rate` | `0.001` |" in text
    assert '`"a\\|b"`' in text  # a pipe would end the Markdown table cell


@pytest.mark.parametrize("report_to, expected", [
    ("none", ()), (["none"], ()), ([], ()), (None, ()),
    ("tensorboard", ("tensorboard",)), (["tensorboard", "tensorboard"], ("tensorboard",)),
])
def test_parse_report_to(report_to, expected):
    assert parse_report_to(report_to) == expected


@pytest.mark.parametrize("report_to, bad", [("comet_ml", "comet_ml"), (["tensorboard", "mlflow"], "mlflow"),
                                            ("all", "all"), ("TensorBoard", "TensorBoard")])
def test_unknown_report_to_names_field_value_and_choices(tmp_path, report_to, bad):
    (tmp_path / "metrics.jsonl").write_text(json.dumps(_step(1, 1.0)) + "\n")
    with pytest.raises(ValueError) as err:
        RunLogger(tmp_path, max_steps=3, disable_tqdm=True, report_to=report_to)
    message = str(err.value)
    assert "report_to=" in message and repr(bad) in message
    assert all(repr(choice) in message for choice in REPORT_TO_CHOICES)
    assert "not supported" in message
    assert read_metrics(tmp_path) == [_step(1, 1.0)]  # nothing was touched before the error


def test_none_combined_with_tensorboard_is_an_error():
    with pytest.raises(ValueError, match="'none'"):
        parse_report_to(["none", "tensorboard"])
    with pytest.raises(TypeError, match="report_to="):
        parse_report_to(5)


def test_report_to_none_writes_only_jsonl(tmp_path):
    log = RunLogger(tmp_path, max_steps=1, disable_tqdm=True)
    log.log_step(_step(1, 1.0))
    log.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]


def test_tensorboard_sink_runs_without_torch_or_jax(tmp_path):
    """The import stays cheap (tensorboard loads lazily) and the sink never reaches for a framework."""
    code = textwrap.dedent(f"""
        import sys
        for name in ("torch", "jax", "jaxlib", "flax", "optax", "tensorflow"):
            sys.modules[name] = None  # any import of them raises ImportError
        import twinseq.common.run.report as metrics
        assert "tensorboard" not in sys.modules, "tensorboard imported with twinseq.common.run.report"
        sink = metrics.TensorBoardSink({str(tmp_path)!r})
        sink.log_step({{"step": 1, "loss": 0.5}})
        sink.log_text("config", "hello")
        sink.close()
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
        acc = EventAccumulator({str(tmp_path)!r})
        acc.Reload()
        assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == [(1, 0.5)]
        print("OK")
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-3000:]


def test_sink_takes_numpy_scalars_and_closes_twice(tmp_path):
    sink = TensorBoardSink(tmp_path)
    sink.log_step({"step": np.int64(7), "loss": np.float32(0.1), "num_tokens": np.int32(3)})
    sink.close()
    sink.close()
    assert _scalars(tmp_path) == {"train/loss": [(7, float(np.float32(0.1)))], "train/num_tokens": [(7, 3.0)]}
