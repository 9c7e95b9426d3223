"""Run logging shared by both trainers: ``metrics.jsonl``, TensorBoard event files, a tqdm bar.

Every run writes ``<output_dir>/metrics.jsonl``, one JSON object per optimizer step with at
least ``step``, ``loss``, ``num_tokens``, ``tokens_per_second`` and ``peak_memory_bytes``.

``report_to`` (the TRL/Hugging Face field) adds sinks next to that file:

- ``"none"`` (the default): ``metrics.jsonl`` only;
- ``"tensorboard"``: TensorBoard event files in ``logging_dir``, by default
  ``<output_dir>/runs/`` (Hugging Face's ``runs/`` folder, without its date-and-host
  subfolder so that the path is deterministic). Every numeric metric of a step becomes a
  scalar ``train/<name>`` at that step, as Hugging Face's TensorBoard callback names them:
  ``tensorboard --logdir <output_dir>``.

Resumed runs and TensorBoard. The two TensorBoard readers handle a step written twice
differently:

- the Python loader (``EventAccumulator``; ``tensorboard --load_fast=false``, offline
  scripts) keeps both points, unless the file starts with ``file_version: "brain.Event:2"``
  and a ``SessionLog.START`` event at step ``s`` arrives: then it drops every point at a step
  ``>= s`` read so far;
- the Rust data server (``--load_fast``, the default where ``tensorboard-data-server`` runs)
  ignores ``SessionLog``: per tag, a point at step ``s`` drops the points at steps ``>= s``
  read so far, reading the event files of a folder in the order of their names.

twinseq does not rely on either rule. Resuming at ``resume_step = r`` cuts the event files to
the steps ``<= r`` (the cut ``metrics.jsonl`` gets; it also drops a torn last record left by a
crash), appends a ``SessionLog.START`` at step ``r + 1`` (the restart marker the Python loader
expects) and goes on in the same file, so the order of file names never matters. Every
reader, including one that ignores ``SessionLog``, then sees each step once. A fresh run
(``resume_step = 0``) deletes the event files of ``logging_dir``, as it deletes
``metrics.jsonl``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import numbers
import os
import socket
import struct
import sys
import time
from pathlib import Path
from typing import Any, Mapping, Optional, Protocol, Sequence, Union

from twinseq.common.errors import ConfigError, ConfigTypeError

REQUIRED_FIELDS = ("step", "loss", "num_tokens", "tokens_per_second", "peak_memory_bytes")
REPORT_TO_CHOICES = ("tensorboard", "none")
TENSORBOARD_DIRNAME = "runs"
CONFIG_TEXT_TAG = "config"
logger = logging.getLogger(__name__)

ReportTo = Union[str, Sequence[str], None]


def peak_rss_bytes() -> int:
    """Peak resident set size of this process (Linux ru_maxrss is in KiB)."""
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024
    return f"{n:.1f}GiB"


def parse_report_to(report_to: ReportTo) -> tuple[str, ...]:
    """TRL's ``report_to`` -> the sinks to add to ``metrics.jsonl``, without ``"none"``.

    ``"none"``, ``["none"]``, ``[]`` and ``None`` -> ``()``;
    ``"tensorboard"``, ``["tensorboard"]`` -> ``("tensorboard",)``.
    Anything else raises ``ValueError`` (``TypeError`` for a value that is not strings).
    """
    if report_to is None:
        return ()
    values = [report_to] if isinstance(report_to, str) else report_to
    if not isinstance(values, (list, tuple)) or not all(isinstance(v, str) for v in values):
        raise ConfigTypeError(
            f"report_to={report_to!r} is not valid; it must be a string or a list of strings "
            f"from {', '.join(map(repr, REPORT_TO_CHOICES))}."
        )
    for value in values:
        if value not in REPORT_TO_CHOICES:
            raise ConfigError(_unknown_report_to_message(report_to, value))
    if "none" in values and len(set(values)) > 1:
        raise ConfigError(
            f"report_to={report_to!r} is not valid; 'none' means no sink besides metrics.jsonl "
            f"and cannot be combined with another value."
        )
    return tuple(dict.fromkeys(v for v in values if v != "none"))


def _unknown_report_to_message(report_to: ReportTo, value: str) -> str:
    head = (
        f"report_to={report_to!r} is not valid: {value!r} is not supported; choose one of "
        f"{', '.join(map(repr, REPORT_TO_CHOICES))}."
    )
    if value == "all":
        return head + " twinseq does not look for installed integrations; name them: 'tensorboard' is its only one."
    return head + (
        " twinseq always writes <output_dir>/metrics.jsonl and, with 'tensorboard', TensorBoard "
        "event files; Hugging Face's other integrations (wandb, mlflow, comet_ml, trackio, ...) "
        "are not supported."
    )


class MetricSink(Protocol):
    """Where a run's per-step metrics go. ``RunLogger`` validates a step, then hands it to each sink."""

    def log_step(self, metrics: Mapping[str, Any]) -> None:
        """One optimizer step: ``metrics["step"]`` (int) and the values the trainer logged."""

    def log_text(self, tag: str, text: str) -> None:
        """Markdown text (the run config); a sink with no place for it ignores it."""

    def close(self) -> None:
        """Flush and close; the sink is unusable afterwards."""


class JsonlSink:
    """``<output_dir>/metrics.jsonl``: one JSON object per optimizer step, flushed at once.

    ``resume_step`` keeps the lines of steps ``<= resume_step`` and drops later ones, so a
    resumed run continues the same file without duplicated steps; ``0`` starts a new file.
    """

    def __init__(self, output_dir: str | os.PathLike, resume_step: int = 0) -> None:
        self.path = Path(output_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._truncate_after(resume_step)
        self._file = self.path.open("a")

    def _truncate_after(self, resume_step: int) -> None:
        if not self.path.exists():
            return
        if resume_step <= 0:
            self.path.unlink()
            return
        kept = [
            line
            for line in self.path.read_text().splitlines()
            if line.strip() and json.loads(line)["step"] <= resume_step
        ]
        self.path.write_text("".join(line + "\n" for line in kept))

    def log_step(self, metrics: Mapping[str, Any]) -> None:
        self._file.write(json.dumps(dict(metrics), sort_keys=False) + "\n")
        self._file.flush()

    def log_text(self, tag: str, text: str) -> None:
        pass  # every line is one step's record; readers of metrics.jsonl expect nothing else

    def close(self) -> None:
        self._file.close()


class TensorBoardSink:
    """TensorBoard event files in ``logging_dir``: each numeric metric as scalar ``<tag_prefix><name>``.

    Written with tensorboard's own record writer and protos (neither torch nor tensorflow),
    imported when the sink is built, never when this module is. One event file per folder;
    resuming cuts it to the steps ``<= resume_step`` and appends (see the module docstring).
    TensorBoard stores a scalar as float32 (as Hugging Face's callback does too): an integer
    above 2**24 such as ``peak_memory_bytes`` is rounded there, and stays exact in
    ``metrics.jsonl``. A metric that is not a number is skipped, with one warning per name.

    Example: ``TensorBoardSink("out/runs").log_step({"step": 1, "loss": 2.5, "lr": 1e-3})``
    writes ``train/loss = 2.5`` and ``train/lr = 0.001`` (as float32) at step 1.
    """

    def __init__(self, logging_dir: str | os.PathLike, resume_step: int = 0, *, tag_prefix: str = "train/") -> None:
        try:
            from tensorboard.compat.proto import event_pb2, summary_pb2
            from tensorboard.summary.writer.record_writer import RecordWriter
        except ImportError as err:
            raise ImportError(
                "report_to='tensorboard' needs the tensorboard package, a twinseq dependency: "
                "pip install 'tensorboard>=2.17.1' (or pip install -e . again)."
            ) from err

        self._event_pb2, self._summary_pb2 = event_pb2, summary_pb2
        self.logging_dir = Path(logging_dir)
        self.tag_prefix = tag_prefix
        self.logging_dir.mkdir(parents=True, exist_ok=True)
        self.path = self._prepare_event_file(resume_step)
        is_new = not self.path.exists()
        self._writer = RecordWriter(self.path.open("ab"))
        if is_new:
            self._write(event_pb2.Event(wall_time=time.time(), file_version="brain.Event:2"))
        if resume_step > 0:
            start = event_pb2.SessionLog(status=event_pb2.SessionLog.START)
            self._write(event_pb2.Event(wall_time=time.time(), step=resume_step + 1, session_log=start))
        self._writer.flush()
        self._last_step = resume_step
        self._skipped: set[str] = set()

    def _prepare_event_file(self, resume_step: int) -> Path:
        """The file to append to: the last existing one, cut to ``resume_step``, else a new name."""
        existing = sorted(p for p in self.logging_dir.iterdir() if p.is_file() and "tfevents" in p.name)
        for path in existing:
            if resume_step <= 0:
                path.unlink()
            else:
                _cut_event_file(path, resume_step, self._event_pb2.Event)
        if resume_step > 0 and existing:
            return existing[-1]
        return self.logging_dir / f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}"

    def _write(self, event: Any) -> None:
        self._writer.write(event.SerializeToString())

    def log_step(self, metrics: Mapping[str, Any]) -> None:
        step = int(metrics["step"])
        values = []
        for name, value in metrics.items():
            if name == "step":
                continue
            if isinstance(value, numbers.Real):
                values.append(self._summary_pb2.Summary.Value(tag=self.tag_prefix + name, simple_value=float(value)))
            elif name not in self._skipped:
                self._skipped.add(name)
                logger.warning(
                    "TensorBoard: metric %r is a %s, not a number; it is only in metrics.jsonl.",
                    name,
                    type(value).__name__,
                )
        summary = self._summary_pb2.Summary(value=values)
        self._write(self._event_pb2.Event(wall_time=time.time(), step=step, summary=summary))
        self._writer.flush()
        self._last_step = step

    def log_text(self, tag: str, text: str) -> None:
        """Markdown for TensorBoard's Text tab, at the step the next optimizer step will have.

        That step belongs to this session, so a later resume from an earlier checkpoint cuts it
        together with the session's scalars.
        """
        from tensorboard.plugins.text.summary_v2 import text_pb

        self._write(self._event_pb2.Event(wall_time=time.time(), step=self._last_step + 1, summary=text_pb(tag, text)))
        self._writer.flush()

    def close(self) -> None:
        if not self._writer.closed:
            self._writer.close()


def _read_records(data: bytes) -> list[tuple[int, int, bytes]]:
    """TFRecord framing -> ``(start, end, payload)`` per complete record, stopping at a torn tail.

    A record is ``uint64 length | uint32 masked crc of length | payload | uint32 masked crc of
    payload`` (little-endian). A crash can leave a partial last record; it ends the list, and so
    does a length whose checksum is wrong. The payload checksum is not recomputed (pure-Python
    CRC is slow); a payload that does not parse ends the list in ``_cut_event_file``.
    """
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c

    records, offset = [], 0
    while offset + 12 <= len(data):
        header = data[offset : offset + 8]
        (length,) = struct.unpack("<Q", header)
        (header_crc,) = struct.unpack("<I", data[offset + 8 : offset + 12])
        end = offset + 12 + length + 4
        if header_crc != masked_crc32c(header) or end > len(data):
            break
        records.append((offset, end, data[offset + 12 : offset + 12 + length]))
        offset = end
    return records


def _cut_event_file(path: Path, resume_step: int, event_cls: Any) -> None:
    """Rewrite ``path`` without its events at steps ``> resume_step`` and without a torn tail."""
    from google.protobuf.message import DecodeError

    data = path.read_bytes()
    kept = []
    for start, end, payload in _read_records(data):
        try:
            event = event_cls.FromString(payload)
        except DecodeError:  # a corrupt payload ends the readable part, like a torn tail
            break
        if event.step <= resume_step:
            kept.append(data[start:end])
    new = b"".join(kept)
    if new != data:
        logger.info(
            "TensorBoard: resuming at step %d, cut %s from %d to %d bytes", resume_step, path.name, len(data), len(new)
        )
        # A name without "tfevents": TensorBoard must never read a half-written copy.
        tmp = path.with_name(f".twinseq-cut-{os.getpid()}.tmp")
        tmp.write_bytes(new)
        os.replace(tmp, path)


def config_markdown(config: Any) -> str:
    """A config dataclass (nested ones too) or a mapping -> a two-column Markdown table.

    ``{"optim": {"lr": 0.001}, "max_steps": 5}`` -> rows ``optim.lr | 0.001`` and ``max_steps | 5``.
    """
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        config = dataclasses.asdict(config)
    if not isinstance(config, Mapping):
        raise ConfigTypeError(f"config={type(config).__name__} is not valid; pass a dataclass instance or a mapping.")
    rows = ["| field | value |", "|---|---|"]
    for name, value in _flatten(config):
        shown = json.dumps(value, default=str).replace("|", "\\|")
        rows.append(f"| `{name}` | `{shown}` |")
    return "\n".join(rows)


def _flatten(mapping: Mapping[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    items = []
    for name, value in mapping.items():
        if isinstance(value, Mapping) and value:
            items.extend(_flatten(value, f"{prefix}{name}."))
        else:
            items.append((f"{prefix}{name}", value))
    return items


def build_sinks(
    report_to: ReportTo,
    output_dir: str | os.PathLike,
    *,
    resume_step: int = 0,
    logging_dir: Optional[str | os.PathLike] = None,
) -> list[MetricSink]:
    """The sinks ``report_to`` asks for besides ``metrics.jsonl`` (``[]`` for ``"none"``)."""
    sinks: list[MetricSink] = []
    if "tensorboard" in parse_report_to(report_to):
        where = Path(logging_dir) if logging_dir is not None else Path(output_dir) / TENSORBOARD_DIRNAME
        sinks.append(TensorBoardSink(where, resume_step))
    return sinks


class RunLogger:
    """Validate per-step metrics, hand them to the sinks and show them on a progress bar.

    ``metrics.jsonl`` is always written; ``report_to`` adds sinks (``"tensorboard"``: event
    files in ``logging_dir``, default ``<output_dir>/runs/``). ``resume_step`` keeps the steps
    ``<= resume_step`` of every sink and drops later ones, so a resumed run continues without
    duplicated steps.

    Example (writes ``out/metrics.jsonl`` and ``out/runs/events.out.tfevents.*``)::

        log = RunLogger("out", max_steps=100, report_to="tensorboard")
        log.log_step({"step": 1, "loss": 2.5, "num_tokens": 512, "tokens_per_second": 1e4,
                      "peak_memory_bytes": 2**30, "lr": 1e-3})
        log.close()
    """

    def __init__(
        self,
        output_dir: str | os.PathLike,
        max_steps: int,
        *,
        disable_tqdm: bool = False,
        desc: str = "train",
        resume_step: int = 0,
        report_to: ReportTo = "none",
        logging_dir: Optional[str | os.PathLike] = None,
    ) -> None:
        # A bad report_to or a missing package fails here, before metrics.jsonl is cut.
        extra = build_sinks(report_to, output_dir, resume_step=resume_step, logging_dir=logging_dir)
        jsonl = JsonlSink(output_dir, resume_step)
        self.path = jsonl.path
        self.sinks: list[MetricSink] = [jsonl, *extra]
        from tqdm.auto import tqdm

        self._bar = tqdm(
            total=max_steps, initial=resume_step, desc=desc, disable=disable_tqdm, dynamic_ncols=True, file=sys.stderr
        )

    def log_step(self, metrics: dict[str, Any]) -> None:
        missing = [k for k in REQUIRED_FIELDS if k not in metrics]
        assert not missing, f"metrics for step {metrics.get('step')} lack {missing}"
        loss = float(metrics["loss"])
        if not math.isfinite(loss):
            logger.warning("step %s: loss is %s", metrics["step"], loss)
        for sink in self.sinks:
            sink.log_step(metrics)
        self._bar.update(1)
        self._bar.set_postfix(
            loss=f"{loss:.4f}",
            tok_s=f"{metrics['tokens_per_second']:.0f}",
            peak=_human_bytes(metrics["peak_memory_bytes"]),
            refresh=False,
        )

    def log_config(self, config: Any) -> None:
        """The run config (a dataclass or a mapping) as a Markdown table, tag ``config``, for sinks that show text."""
        text = config_markdown(config)
        for sink in self.sinks:
            sink.log_text(CONFIG_TEXT_TAG, text)

    def write(self, message: str) -> None:
        """A line for the console, above the progress bar (not recorded by the sinks)."""
        self._bar.write(message, file=sys.stderr)

    def close(self) -> None:
        self._bar.close()
        for sink in self.sinks:
            sink.close()


def read_metrics(output_dir: str | os.PathLike) -> list[dict[str, Any]]:
    path = Path(output_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def summarize_losses(records: list[dict[str, Any]], window: int = 5) -> Optional[str]:
    """One line: first and last (windowed mean) loss and their ratio."""
    if not records:
        return None
    losses = [r["loss"] for r in records]
    w = max(1, min(window, len(losses) // 2 or 1))
    first, last = sum(losses[:w]) / w, sum(losses[-w:]) / w
    ratio = lambda a, b: f"{a / b:.3f}" if b else "n/a"  # noqa: E731  (GRPO's on-policy loss can be exactly 0)
    line = (
        f"loss: first step {losses[0]:.4f}, final step {losses[-1]:.4f} (final/first = "
        f"{ratio(losses[-1], losses[0])}); mean of first/last {w} steps {first:.4f} -> {last:.4f} "
        f"(ratio {ratio(last, first)}) over {len(losses)} steps"
    )
    if all("reward" in r for r in records):  # GRPO: the reward is what should move
        rewards = [r["reward"] for r in records]
        line += f"\nreward: mean of first/last {w} steps {sum(rewards[:w]) / w:.4f} -> {sum(rewards[-w:]) / w:.4f}"
    return line


def plot_metrics(output_dir: str | os.PathLike, *, keys: tuple[str, ...] = ("loss", "tokens_per_second")) -> Path:
    """Write ``<output_dir>/metrics.png``: one panel per key, against the optimizer step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(output_dir)
    keys = tuple(k for k in keys if records and k in records[0])
    fig, axes = plt.subplots(1, len(keys), figsize=(5 * len(keys), 3.2), squeeze=False)
    steps = [r["step"] for r in records]
    for ax, key in zip(axes[0], keys):
        ax.plot(steps, [r[key] for r in records], marker=".", lw=1)
        ax.set_xlabel("optimizer step")
        ax.set_title(key)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    path = Path(output_dir) / "metrics.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def finish_run(output_dir: str | os.PathLike, keys: tuple[str, ...] = ("loss", "tokens_per_second")) -> Optional[str]:
    """End-of-run report shared by every trainer: the loss summary line and ``metrics.png``."""
    records = read_metrics(output_dir)
    summary = summarize_losses(records)
    if summary:
        plot = plot_metrics(output_dir, keys=keys)
        print(f"{summary}\nplot: {plot}")
    return summary
