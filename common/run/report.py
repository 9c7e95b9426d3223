"""Run logging shared by both trainers: ``metrics.jsonl``, TensorBoard event files, Weights & Biases, a tqdm bar.

Every run writes ``<output_dir>/metrics.jsonl``, one JSON object per optimizer step with at
least ``step``, ``loss``, ``num_tokens``, ``tokens_per_second`` and ``peak_memory_bytes``.

``report_to`` (the TRL/Hugging Face field) adds sinks next to that file:

- ``"none"`` (the default): ``metrics.jsonl`` only;
- ``"tensorboard"``: TensorBoard event files in ``logging_dir``, by default
  ``<output_dir>/runs/`` (Hugging Face's ``runs/`` folder, without its date-and-host
  subfolder so that the path is deterministic). Every numeric metric of a step becomes a
  scalar ``train/<name>`` at that step, as Hugging Face's TensorBoard callback names them:
  ``tensorboard --logdir <output_dir>``.
- ``"wandb"``: a Weights & Biases run (extra ``twinseq[wandb]``, imported only when asked), with the run
  config, each step's numeric metrics as ``train/<name>`` at that step and the summary at the end. Its project
  is ``WANDB_PROJECT`` (default ``twinseq``), its name ``run_name`` (None: ``WANDB_NAME``, or wandb's own), its
  folder ``WANDB_DIR`` (default ``<output_dir>``, so the run lands in ``<output_dir>/wandb/``).
  ``WANDB_MODE=offline`` needs no account and no network: ``wandb sync <output_dir>/wandb/offline-run-*``
  uploads it later. A resumed run is a new wandb run from step ``resume_step + 1``, unless wandb's own
  ``WANDB_RUN_ID`` and ``WANDB_RESUME`` say otherwise.

Evaluation (``common.run.evaluation``) writes its metrics as lines of their own, as Hugging Face logs them: ``step``,
``epoch`` and the ``eval_*`` values (``RunLogger.log_eval``); TensorBoard shows ``eval_loss`` as ``eval/loss``
(Hugging Face's ``rewrite_logs``). ``read_metrics`` returns the training lines unless asked for the others, and
``metrics.png`` draws each ``eval_<key>`` on the panel of ``<key>``.

The console. The bar shows, next to the step count, the values of the step it counts (``bar_postfix``: the
epoch, the loss, GRPO's reward and KL, DPO's reward accuracy and margin, a MoE model's ``router_max_load``, tokens/s,
peak memory; a MoE step's per-expert loads ``router_load/L{i}`` are lists in ``metrics.jsonl`` only); while it is up,
every console log line is written above it (``ConsoleAboveBar``). At the end ``finish_run`` prints one summary line
that fits the task (``summarize_run``) and writes ``metrics.png``.

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

import numpy as np

from twinseq.common.errors import ConfigError, ConfigTypeError, MissingDependencyError

REQUIRED_FIELDS = ("step", "loss", "num_tokens", "tokens_per_second", "peak_memory_bytes")
REPORT_TO_CHOICES = ("tensorboard", "wandb", "none")
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
        return head + " twinseq does not look for installed integrations; name the ones you want."
    return head + (
        " twinseq always writes <output_dir>/metrics.jsonl, with 'tensorboard' TensorBoard event files, with "
        "'wandb' a Weights & Biases run; Hugging Face's other integrations (mlflow, comet_ml, trackio, ...) "
        "are not supported."
    )


class MetricSink(Protocol):
    """Where a run's per-step metrics go. ``RunLogger`` validates a step, then hands it to each sink."""

    def log_step(self, metrics: Mapping[str, Any]) -> None:
        """One optimizer step: ``metrics["step"]`` (int) and the values the trainer logged."""

    def log_text(self, tag: str, text: str) -> None:
        """Markdown text (the run config); a sink with no place for it ignores it."""

    def log_config(self, values: Mapping[str, Any]) -> None:
        """The run config as a nested mapping of JSON values, for a sink that stores it as data (wandb's config);
        a sink with no place for it ignores it."""

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
        self._file.write(json.dumps(dict(metrics), sort_keys=False, default=_json_value) + "\n")
        self._file.flush()

    def log_text(self, tag: str, text: str) -> None:
        pass  # every line is one step's record; readers of metrics.jsonl expect nothing else

    def log_config(self, values: Mapping[str, Any]) -> None:
        pass  # the same: the config is in each checkpoint's trainer_state.json

    def close(self) -> None:
        self._file.close()


def _json_value(value: Any) -> Any:
    """A numpy metric as JSON: an array (a MoE step's ``router_load/L{i}``, one load per expert) as a list, a numpy
    scalar as a number."""
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"a metric of type {type(value).__name__} ({value!r}) has no JSON form; log a number or a list.")


def _warn_skipped(skipped: set[str], sink: str, name: str, value: Any) -> None:
    """Warn once per metric family that ``sink`` skips a metric that is not a number (``router_load/L0``,
    ``router_load/L1``, ...: one warning for ``router_load``)."""
    family = name.split("/")[0]
    if family in skipped:
        return
    skipped.add(family)
    others = f" (and the other {family}/... metrics)" if "/" in name else ""
    logger.warning(
        "%s: metric %r%s is a %s, not a number; it is only in metrics.jsonl.", sink, name, others, type(value).__name__
    )


class TensorBoardSink:
    """TensorBoard event files in ``logging_dir``: each numeric metric as scalar ``<tag_prefix><name>``.

    Written with tensorboard's own record writer and protos (neither torch nor tensorflow),
    imported when the sink is built, never when this module is. One event file per folder;
    resuming cuts it to the steps ``<= resume_step`` and appends (see the module docstring).
    TensorBoard stores a scalar as float32 (as Hugging Face's callback does too): an integer
    above 2**24 such as ``peak_memory_bytes`` is rounded there, and stays exact in
    ``metrics.jsonl``. A metric that is not a number is skipped, with one warning per name (per family:
    ``router_load/L0``, ``router_load/L1``, ... warn once).

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
                values.append(self._summary_pb2.Summary.Value(tag=self._tag(name), simple_value=float(value)))
            else:
                _warn_skipped(self._skipped, "TensorBoard", name, value)
        summary = self._summary_pb2.Summary(value=values)
        self._write(self._event_pb2.Event(wall_time=time.time(), step=step, summary=summary))
        self._writer.flush()
        self._last_step = step

    def _tag(self, name: str) -> str:
        """``eval_loss`` -> ``eval/loss`` (Hugging Face's ``rewrite_logs``); another name -> ``<tag_prefix><name>``."""
        return "eval/" + name.removeprefix("eval_") if name.startswith("eval_") else self.tag_prefix + name

    def log_text(self, tag: str, text: str) -> None:
        """Markdown for TensorBoard's Text tab, at the step the next optimizer step will have.

        That step belongs to this session, so a later resume from an earlier checkpoint cuts it
        together with the session's scalars.
        """
        from tensorboard.plugins.text.summary_v2 import text_pb

        self._write(self._event_pb2.Event(wall_time=time.time(), step=self._last_step + 1, summary=text_pb(tag, text)))
        self._writer.flush()

    def log_config(self, values: Mapping[str, Any]) -> None:
        pass  # shown as text: log_text

    def close(self) -> None:
        if not self._writer.closed:
            self._writer.close()


class WandbSink:
    """A Weights & Biases run: the config, each step's numeric metrics as ``<tag_prefix><name>`` at its step
    (``eval_loss`` as ``eval/loss``, as Hugging Face's callback names them), ``finish`` at the end.

    ``wandb`` is imported when the sink is built, never when this module is, and the run starts then, so a missing
    package or a refused login fails before the first step. ``project`` None: ``WANDB_PROJECT``, else ``twinseq``;
    ``directory`` None: ``WANDB_DIR``, else ``output_dir``. The config and ``run_name`` come with ``log_config``.
    A metric that is not a number is skipped, with one warning per name (or family, ``router_load/...``).

    Example: ``WandbSink("out").log_step({"step": 1, "loss": 2.5})`` logs ``{"train/loss": 2.5}`` at step 1.
    """

    def __init__(
        self,
        output_dir: str | os.PathLike,
        *,
        project: Optional[str] = None,
        directory: Optional[str | os.PathLike] = None,
        tag_prefix: str = "train/",
    ) -> None:
        try:
            import wandb
        except ImportError as err:
            raise MissingDependencyError(
                "report_to='wandb' needs the wandb package; install it with `pip install -e '.[wandb]'` "
                "(or '.[all]'), or drop 'wandb' from report_to."
            ) from err
        self.tag_prefix = tag_prefix
        self._skipped: set[str] = set()
        where = directory if directory is not None else os.environ.get("WANDB_DIR") or output_dir
        Path(where).mkdir(parents=True, exist_ok=True)
        try:
            self._run = wandb.init(project=project or os.environ.get("WANDB_PROJECT") or "twinseq", dir=str(where))
        except wandb.Error as err:
            raise ConfigError(
                f"report_to='wandb': wandb could not start a run ({' '.join(str(err).split())[:300]}); log in with "
                "`wandb login`, or set WANDB_MODE=offline to write the run locally and `wandb sync` it later."
            ) from None

    @property
    def run_dir(self) -> Path:
        """The folder of this run's files (``.../wandb/offline-run-<time>-<id>`` offline)."""
        return Path(self._run.dir).parent

    def _key(self, name: str) -> str:
        return "eval/" + name.removeprefix("eval_") if name.startswith("eval_") else self.tag_prefix + name

    def log_step(self, metrics: Mapping[str, Any]) -> None:
        values = {}
        for name, value in metrics.items():
            if name == "step":
                continue
            if isinstance(value, numbers.Real):
                values[self._key(name)] = value
            else:
                _warn_skipped(self._skipped, "wandb", name, value)
        self._run.log(values, step=int(metrics["step"]))

    def log_text(self, tag: str, text: str) -> None:
        pass  # the config goes in as data: log_config

    def log_config(self, values: Mapping[str, Any]) -> None:
        self._run.config.update(dict(values), allow_val_change=True)
        if values.get("run_name"):
            self._run.name = str(values["run_name"])

    def close(self) -> None:
        self._run.finish()


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


def config_values(config: Any) -> dict[str, Any]:
    """A config dataclass (nested ones too) or a mapping -> a nested dict of JSON values (a path becomes its
    string).

    ``Config(optim=Optim(lr=0.001), output_dir=Path("out"))`` -> ``{"optim": {"lr": 0.001}, "output_dir": "out"}``.
    """
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        config = dataclasses.asdict(config)
    if not isinstance(config, Mapping):
        raise ConfigTypeError(f"config={type(config).__name__} is not valid; pass a dataclass instance or a mapping.")
    return json.loads(json.dumps(dict(config), default=str))


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
    wanted = parse_report_to(report_to)
    if "tensorboard" in wanted:
        where = Path(logging_dir) if logging_dir is not None else Path(output_dir) / TENSORBOARD_DIRNAME
        sinks.append(TensorBoardSink(where, resume_step))
    if "wandb" in wanted:
        sinks.append(WandbSink(output_dir))
    return sinks


class RunLogger:
    """Validate per-step metrics, hand them to the sinks and show them on a progress bar.

    ``metrics.jsonl`` is always written; ``report_to`` adds sinks (``"tensorboard"``: event
    files in ``logging_dir``, default ``<output_dir>/runs/``; ``"wandb"``: a Weights & Biases run).
    ``resume_step`` keeps the steps ``<= resume_step`` of every sink and drops later ones, so a
    resumed run continues without duplicated steps.

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
        self._console = ConsoleAboveBar(type(self._bar)) if not disable_tqdm else None

    def log_step(self, metrics: dict[str, Any]) -> None:
        """One logged step (or window of ``logging_steps`` steps): to every sink, then onto the bar, which moves to
        ``metrics["step"]`` showing that step's values (``bar_postfix``)."""
        missing = [k for k in REQUIRED_FIELDS if k not in metrics]
        assert not missing, f"metrics for step {metrics.get('step')} lack {missing}"
        loss = float(metrics["loss"])
        if not math.isfinite(loss):
            logger.warning("step %s: loss is %s", metrics["step"], loss)
        for sink in self.sinks:
            sink.log_step(metrics)
        # the postfix first: update() draws the bar, and it must draw this step's values, not the last step's
        self._bar.set_postfix(bar_postfix(metrics), refresh=False)
        self._bar.update(max(0, int(metrics["step"]) - self._bar.n))

    def log_eval(self, metrics: dict[str, Any]) -> None:
        """One evaluation: ``step`` (and ``epoch``) with the ``eval_*`` metrics, to every sink as a line of its own,
        and one line on the console."""
        assert "step" in metrics and any(k.startswith("eval_") for k in metrics), metrics
        for sink in self.sinks:
            sink.log_step(metrics)
        shown = ", ".join(
            f"{k}={v:.4g}" for k, v in metrics.items() if k.startswith("eval_") and isinstance(v, numbers.Real)
        )
        self.write(f"eval at step {metrics['step']}: {shown}")

    def log_config(self, config: Any) -> None:
        """The run config (a dataclass or a mapping) as a Markdown table, tag ``config``, for sinks that show text,
        and as a mapping for sinks that store it (wandb)."""
        text, values = config_markdown(config), config_values(config)
        for sink in self.sinks:
            sink.log_text(CONFIG_TEXT_TAG, text)
            sink.log_config(values)

    def write(self, message: str) -> None:
        """A line for the console, above the progress bar (not recorded by the sinks)."""
        self._bar.write(message, file=sys.stderr)

    def close(self) -> None:
        self._bar.close()
        if self._console is not None:
            self._console.restore()
        for sink in self.sinks:
            sink.close()


# The bar's fields after the step count, in this order, for those a step's metrics hold: (metric, label, format).
# The epoch first (the runner logs it: 1.50 is halfway through the second pass). GRPO's loss is about 0 on-policy
# by construction, so its reward and KL come next; DPO adds the share of pairs whose chosen reward wins and the mean
# margin.
BAR_FIELDS: tuple[tuple[str, str, str], ...] = (
    ("epoch", "epoch", "{:.2f}"),
    ("reward", "reward", "{:.4f}"),
    ("kl", "kl", "{:.3g}"),  # 1e-7 after a step at GRPO's default learning rate: a fixed point would show 0
    ("loss", "loss", "{:.4f}"),
    ("rewards/accuracies", "acc", "{:.3f}"),
    ("rewards/margins", "margin", "{:.4f}"),
    ("aux_loss", "aux", "{:.4f}"),  # a MoE model's load-balancing loss (output_router_logits), unweighted
    ("router_max_load", "router_max", "{:.3f}"),  # a MoE model's: near 1/k, one expert takes every token
    ("tokens_per_second", "tok/s", "{:.0f}"),
)


def bar_postfix(metrics: Mapping[str, Any]) -> dict[str, str]:
    """A step's metrics -> the progress bar's ``name=value`` fields, in ``BAR_FIELDS`` order, then the peak memory.

    ``{"loss": 2.5, "tokens_per_second": 1e4, "peak_memory_bytes": 2**30, ...}`` ->
    ``{"loss": "2.5000", "tok/s": "10000", "peak": "1.0GiB"}``; a logged ``epoch`` comes first, a GRPO step adds
    ``reward`` (and ``kl``) before the loss, a DPO step ``acc`` and ``margin`` after it.
    """
    out = {label: _number(metrics[key], fmt) for key, label, fmt in BAR_FIELDS if key in metrics}
    out["peak"] = _human_bytes(metrics["peak_memory_bytes"])
    return out


def _number(value: Any, fmt: str) -> str:
    """``fmt.format(value)``, without the sign of a value that rounds to zero (GRPO's loss: ``-0.0000``)."""
    text = fmt.format(value)
    return text[1:] if text.startswith("-") and not text.strip("-0.") else text


class _AboveBarStream:
    """A console stream whose writes go through ``tqdm.write``: the bars are cleared, the text written, the bars
    drawn again below it."""

    def __init__(self, stream: Any, tqdm_class: Any) -> None:
        self.stream, self._tqdm = stream, tqdm_class

    def write(self, text: str) -> int:
        self._tqdm.write(text, file=self.stream, end="")
        return len(text)

    def flush(self) -> None:
        self.stream.flush()

    def __getattr__(self, name: str) -> Any:  # isatty, encoding, ...: a formatter may ask the stream
        return getattr(self.stream, name)


class ConsoleAboveBar:
    """While a progress bar is up, the log lines of every console handler (twinseq's, a dependency's own, and
    Python warnings through ``logging.captureWarnings``) are written above the bar instead of onto it.

    Each ``StreamHandler`` writing to stdout or stderr gets an ``_AboveBarStream`` over its stream; its level,
    filters and format are kept. ``restore`` gives the handlers their streams back. A handler created later (a
    library imported while the bar is up) writes directly.
    """

    def __init__(self, tqdm_class: Any) -> None:
        consoles = {id(s) for s in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__) if s is not None}
        loggers = [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]
        self._swapped: list[tuple[logging.StreamHandler, Any]] = []
        for log in loggers:
            for handler in getattr(log, "handlers", ()):
                if (
                    isinstance(handler, logging.StreamHandler)
                    and not isinstance(getattr(type(handler), "stream", None), property)  # logging.lastResort
                    and not isinstance(handler, logging.FileHandler)
                    and id(handler.stream) in consoles
                ):
                    self._swapped.append((handler, handler.stream))
                    handler.setStream(_AboveBarStream(handler.stream, tqdm_class))

    def restore(self) -> None:
        for handler, stream in self._swapped:
            if isinstance(handler.stream, _AboveBarStream):
                handler.setStream(stream)
        self._swapped = []


def is_eval_record(record: Mapping[str, Any]) -> bool:
    """A ``metrics.jsonl`` line of an evaluation (``eval_*`` keys), not of a training step."""
    return any(k.startswith("eval_") for k in record)


def read_metrics(output_dir: str | os.PathLike, kind: str = "train") -> list[dict[str, Any]]:
    """The lines of ``<output_dir>/metrics.jsonl``: the training steps' (``kind='train'``), the evaluations'
    (``'eval'``) or all of them in file order (``'all'``)."""
    path = Path(output_dir) / "metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if kind == "all":
        return records
    if kind not in ("train", "eval"):
        raise ConfigError(f"kind={kind!r} is not valid; choose 'train', 'eval' or 'all'.")
    return [r for r in records if is_eval_record(r) == (kind == "eval")]


def append_jsonl(path: str | os.PathLike, rows: Sequence[Mapping[str, Any]]) -> Path:
    """Append ``rows`` to a JSONL file, one object per line (created with its folder)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        for row in rows:
            f.write(json.dumps(dict(row)) + "\n")
    return path


def cut_jsonl(path: str | os.PathLike, before_step: int) -> None:
    """Keep the lines of a JSONL file whose ``step`` is below ``before_step`` (a fresh run: none; a resumed one: those
    of the steps it does not redo)."""
    path = Path(path)
    if path.is_file():
        kept = [
            line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] < before_step
        ]
        path.write_text("".join(line + "\n" for line in kept))


def markdown_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """Rows of equal keys -> a Markdown table (``|`` escaped, newlines shown as ``\\n``).

    >>> print(markdown_table([{"prompt": "a|b", "completion": "c\\nd"}]))
    | prompt | completion |
    |---|---|
    | a\\|b | c\\nd |
    """

    def cell(value: Any) -> str:
        text = f"{value:.4g}" if isinstance(value, float) else str(value)
        return text.replace("|", "\\|").replace("\n", "\\n")

    keys = list(rows[0]) if rows else []
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(cell(r.get(k, "")) for k in keys) + " |" for r in rows]
    return "\n".join(lines)


def write_samples(output_dir: str | os.PathLike, step: int, rows: Sequence[Mapping[str, Any]]) -> Path:
    """An evaluation's generated samples: ``<output_dir>/samples/step_<step>.jsonl`` and the same rows as a Markdown
    table in ``step_<step>.md``; returns the JSONL path."""
    folder = Path(output_dir) / "samples"
    path = folder / f"step_{step}.jsonl"
    path.unlink(missing_ok=True)  # a resumed run evaluates this step again
    append_jsonl(path, rows)
    (folder / f"step_{step}.md").write_text(f"# samples at step {step}\n\n{markdown_table(rows)}\n")
    return path


SUMMARY_FORMAT = {"kl": "{:.3g}"}  # the format of a metric in ``summarize_run`` when it is not ``.4f``


def summarize_run(records: list[dict[str, Any]], window: int = 5) -> Optional[str]:
    """A run's ``metrics.jsonl`` records -> one line on what should have moved, for the task they come from.

    - GRPO (records with ``reward``): the reward at the first and final step, then the mean of the first and of
      the last ``w`` steps of the reward, the KL (with ``grpo_beta`` > 0) and the loss. A GRPO loss is about 0
      on-policy and changes sign, so no ratio of it is printed.
    - DPO (records with ``rewards/accuracies``): the loss at the first and final step, then the means of the loss,
      the reward accuracy and the reward margin (0, 0 at the first step: the policy starts as the reference).
    - SFT (anything else): the loss at the first and final step and final/first, the means and their ratio.

    ``w`` is ``window``, or half the steps for a short run. Example (SFT)::

        loss: first step 9.0981, final step 5.9190 (final/first = 0.651); mean of first/last 5 steps
        9.0412 -> 5.9533 (ratio 0.658) over 200 steps
    """
    if not records:
        return None
    w = max(1, min(window, len(records) // 2 or 1))
    n = f"over {len(records)} steps"

    def ends(key: str) -> tuple[float, float]:
        values = [float(r[key]) for r in records]
        return sum(values[:w]) / w, sum(values[-w:]) / w

    def means(names: Sequence[tuple[str, str]]) -> str:
        moves = []
        for key, label in names:
            (a, b), fmt = ends(key), SUMMARY_FORMAT.get(key, "{:.4f}")
            moves.append(f"{label} {_number(a, fmt)} -> {_number(b, fmt)}")
        return f"mean of first/last {w} steps: {', '.join(moves)}"

    def first_final(key: str) -> str:
        return f"first step {_number(records[0][key], '{:.4f}')}, final step {_number(records[-1][key], '{:.4f}')}"

    present = set.intersection(*(set(r) for r in records))
    if "reward" in present:
        names = [(k, label) for k, label in (("reward", "reward"), ("kl", "kl"), ("loss", "loss")) if k in present]
        return f"reward: {first_final('reward')}; {means(names)} {n}"
    if "rewards/accuracies" in present:
        names = [("loss", "loss"), ("rewards/accuracies", "reward accuracy")]
        names += [("rewards/margins", "reward margin")] if "rewards/margins" in present else []
        return f"loss: {first_final('loss')}; {means(names)} {n}"
    losses = [float(r["loss"]) for r in records]
    first, last = ends("loss")
    ratio = lambda a, b: f"{a / b:.3f}" if b else "n/a"  # noqa: E731
    return (
        f"loss: {first_final('loss')} (final/first = {ratio(losses[-1], losses[0])}); mean of first/last {w} "
        f"steps {first:.4f} -> {last:.4f} (ratio {ratio(last, first)}) {n}"
    )


def plot_metrics(output_dir: str | os.PathLike, *, keys: tuple[str, ...] = ("loss", "tokens_per_second")) -> Path:
    """Write ``<output_dir>/metrics.png``: one panel per key, against the optimizer step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records, evals = read_metrics(output_dir), read_metrics(output_dir, "eval")
    keys = tuple(k for k in keys if any(k in r for r in records))  # a step may lack one (KTO: a one-sided batch)
    fig, axes = plt.subplots(1, len(keys), figsize=(5 * len(keys), 3.2), squeeze=False)
    for ax, key in zip(axes[0], keys):
        has = [r for r in records if key in r]
        ax.plot([r["step"] for r in has], [r[key] for r in has], marker=".", lw=1, label="train")
        evaluated = [r for r in evals if f"eval_{key}" in r]
        if evaluated:  # the eval curve of the same quantity, on its panel
            ax.plot([r["step"] for r in evaluated], [r[f"eval_{key}"] for r in evaluated], marker="o", lw=1.5)
            ax.legend(["train", "eval"], fontsize="small")
        ax.set_xlabel("optimizer step")
        ax.set_title(key)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    path = Path(output_dir) / "metrics.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def finish_run(output_dir: str | os.PathLike, keys: tuple[str, ...] = ("loss", "tokens_per_second")) -> Optional[str]:
    """End-of-run report shared by every trainer: the summary line of the task (``summarize_run``) and
    ``metrics.png``."""
    records = read_metrics(output_dir)
    summary = summarize_run(records)
    if summary:
        evals = summarize_eval(read_metrics(output_dir, "eval"))
        summary = summary if evals is None else f"{summary}\n{evals}"
        plot = plot_metrics(output_dir, keys=keys)
        print(f"{summary}\nplot: {plot}")
    return summary


def summarize_eval(records: list[dict[str, Any]]) -> Optional[str]:
    """The evaluations of a run -> one line: the first and last value of its main metric (``eval_loss``, GRPO's
    ``eval_reward``) and the best one, or None without evaluations.

    >>> summarize_eval([{"step": 0, "eval_loss": 3.0}, {"step": 5, "eval_loss": 2.0}, {"step": 10, "eval_loss": 2.5}])
    'eval_loss: step 0 3.0000 -> step 10 2.5000; best 2.0000 at step 5 (3 evaluations)'
    """
    key = next((k for k in ("eval_loss", "eval_reward") if any(k in r for r in records)), None)
    if key is None:
        return None
    points = [(r["step"], float(r[key])) for r in records if key in r]
    best = (max if key == "eval_reward" else min)(points, key=lambda p: p[1])
    return (
        f"{key}: step {points[0][0]} {points[0][1]:.4f} -> step {points[-1][0]} {points[-1][1]:.4f}; best "
        f"{best[1]:.4f} at step {best[0]} ({len(points)} evaluations)"
    )
