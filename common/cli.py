"""The ``twinseq`` command line.

- ``twinseq train --backend torch|jax --task sft|dpo|grpo|rloo [--config FILE] [--flags ...]``: flags
  are generated from ``TrainConfig`` by tyro; a YAML ``--config`` sets defaults that flags
  override.
- ``twinseq lengths [DATASET]``: the sequence-length profiler that helps choose max_length.
- ``twinseq data``: build (or show) the embedded offline datasets and tokenizer.
- ``twinseq memory [--config FILE] [train flags] [--devices N] [--device cpu|cuda] [--budget 24GiB]``:
  the planned memory of that run per component (``common.run.memory_plan``), the process baseline (a
  python with the backend imported, ``common.run.process_baseline``) and the grand total a user measures,
  and with ``--budget`` the cheapest set of knobs that fits, as the flags to add.
- ``twinseq generate --model FOLDER --prompt TEXT [--backend torch|jax] [--max-new-tokens N] [--temperature T]``
  and ``twinseq chat --model FOLDER`` (one reply per stdin line): completions from a model or adapter folder
  (``common.run.generate``).

Errors. Every error caused by the user's input is one of twinseq's own exceptions
(``common.errors``); the CLI prints it as one line, ``twinseq <command>: error: ...``, and exits
with status 2. A traceback means a bug, or that ``--debug`` (or ``TWINSEQ_DEBUG=1``) was given.
A run stopped by SIGTERM or Ctrl-C saves a checkpoint first and exits with 143 or 130.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import difflib
import logging
import os
import sys
import warnings
from typing import Iterator, Optional, Sequence

from twinseq.common.api import TRAINERS
from twinseq.common.config import TrainConfig, aliases_of, deferred_checks, flag_names
from twinseq.common.data import corpus
from twinseq.common.data.lengths import main as lengths_main
from twinseq.common.data.tokenizer import load_tokenizer
from twinseq.common.errors import ConfigError, TrainingInterrupted, TwinseqError
from twinseq.common.run.generate import chat_main, generate_main
from twinseq.common.run.memory_plan import advise, format_bytes, parse_bytes, plan_memory
from twinseq.common.run.process_baseline import grand_total_lines, process_baseline

USAGE = """usage: twinseq {train,generate,chat,lengths,data,memory} [--debug] ...

  train     train a model (twinseq train --help)
  memory    plan a run's memory per component; --budget 24GiB: what to turn on to fit
  generate  complete prompts with a trained model or adapter folder (twinseq generate --help)
  chat      chat with it: one reply per line read from stdin (twinseq chat --help)
  lengths   profile sequence lengths and choose max_length (twinseq lengths --help)
  data      build the embedded offline datasets and tokenizer (twinseq data --help)

  --debug   show the traceback of an error (also TWINSEQ_DEBUG=1)
"""


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _parse_error(event) -> ConfigError:
    """One line for a flag tyro rejected (a value that does not parse, an unknown flag, ...)."""
    from tyro import _errors as tyro_errors

    argument = getattr(event, "argument", None)
    name = getattr(getattr(argument, "field", None), "intern_name", None) if argument is not None else None
    if isinstance(event, tyro_errors.InvalidChoice):
        return ConfigError(
            f"{name}={event.value!r} is not valid; choose one of {', '.join(map(repr, event.choices))} "
            f"({_flag(str(name))})."
        )
    if isinstance(event, tyro_errors.InstantiationFailure) and name:
        return ConfigError(
            f"{_flag(name)}: {event.message}; pass a value of the field's type (`twinseq train --help` lists it)."
        )
    if isinstance(event, tyro_errors.BadValue) and name:
        got = "" if event.offending_value is None else f" (got {event.offending_value!r})"
        return ConfigError(f"{_flag(name)} is missing its value{got}; pass {_flag(name)} VALUE.")
    if isinstance(event, tyro_errors.UnrecognizedArgs):
        unknown = [t for t in event.tokens if t.startswith("--")] or event.tokens
        hints = []
        for token in unknown:
            close = difflib.get_close_matches(token, flag_names(), n=1)
            hints.append(f"{token} (did you mean {close[0]}?)" if close else token)
        return ConfigError(
            f"unrecognized argument(s) {', '.join(hints)}; `twinseq train --help` lists the flags "
            f"(a boolean is set with --flag or --no-flag, never --flag no)."
        )
    return ConfigError(f"the arguments could not be parsed ({type(event).__name__}); see `twinseq train --help`.")


@contextlib.contextmanager
def _one_line_parse_errors() -> Iterator[None]:
    """Route tyro's rejections through twinseq's error path (one line, exit 2) instead of its box."""
    try:
        from tyro import _errors as tyro_errors
    except ImportError:  # the hook is tyro's own (internal) API; without it tyro prints its box
        yield
        return

    def hook(event) -> None:
        raise _parse_error(event)

    with tyro_errors.on_parse_error(hook):
        yield


def parse_train_args(argv: Sequence[str]) -> TrainConfig:
    """``--config FILE`` supplies defaults; every other flag comes from the dataclasses via tyro.

    The config tree is nested by concern, but its field names are unique, so the flags stay flat
    with TRL's names (``--max-length``, not ``--data.max-length``); ``--help`` groups them by section.
    tyro builds the tree unchecked, then ``validate`` checks it in one place, so a bad value reaches
    the user as the same one-line error whatever its source (YAML, flag or Python).
    """
    import tyro

    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", default=None)
    known, rest = pre.parse_known_args(list(argv))
    default = TrainConfig.from_yaml(known.config) if known.config else TrainConfig()
    for name in default.task_defaults():  # resolved again for the task the flags give (--task dpo: DPO's rate)
        setattr(default.optim, name, None)
    with deferred_checks(), _one_line_parse_errors():
        cfg = tyro.cli(
            TrainConfig,
            args=rest,
            default=default,
            prog="twinseq train",
            config=(tyro.conf.OmitArgPrefixes,),
            description="Train a model. YAML: --config FILE (flags override it).",
            registry=_alias_flags(),
        )
    return cfg.validate()


def _alias_flags():
    """A tyro registry that gives each field of ``common.config.FIELD_ALIASES`` its other spellings as flags
    (``--model-name-or-path`` beside ``--model-config``), listed by ``--help``."""
    from typing import Annotated

    import tyro
    from tyro.constructors import ConstructorRegistry

    registry, busy = ConstructorRegistry(), []

    @registry.struct_rule
    def with_aliases(info):
        names = {f.name for f in dataclasses.fields(info.type)} if dataclasses.is_dataclass(info.type) else set()
        if busy or not any(aliases_of(n) for n in names):
            return None
        busy.append(info)
        try:  # the default rule's spec of this dataclass, then the alias flags on its fields
            spec = ConstructorRegistry.get_struct_spec(info)
        finally:
            busy.pop()
        if not isinstance(spec, tyro.constructors.StructConstructorSpec):
            return spec
        fields = tuple(
            dataclasses.replace(f, type=Annotated[f.type, tyro.conf.arg(aliases=tuple(map(_flag, aliases_of(f.name))))])
            if aliases_of(f.name)
            else f
            for f in spec.fields
        )
        return dataclasses.replace(spec, fields=fields)

    return registry


# Deprecation notices that a dependency raises about its own or another dependency's API: nothing a user of
# twinseq can act on (transformers' FutureWarning when PEFT reads ``is_gradient_checkpointing``, for one).
DEPENDENCY_NOTICES = (FutureWarning, DeprecationWarning, PendingDeprecationWarning)


def _without_trailing_newline(record: logging.LogRecord) -> bool:
    """``warnings.formatwarning`` ends its text with a newline and the handler adds one: no blank line after it."""
    if isinstance(record.args, tuple):
        record.args = tuple(a.rstrip("\n") if isinstance(a, str) else a for a in record.args)
    return True


def _setup_logging(debug: bool = False) -> None:
    """The console's log lines: twinseq's from INFO up on the main process (``RANK`` 0, or no launcher), from
    WARNING up on the other ranks (their lines say ``[rank N]``); every dependency's from WARNING up.

    Python warnings go through logging too, so that one raised while the progress bar is up is written above
    it (``common.run.report.RunLogger``); dependencies' deprecation notices are dropped. ``debug``: INFO from
    every library and every rank, and every warning.
    """
    rank = os.environ.get("RANK", "0")
    where = f" [rank {rank}]" if rank != "0" else ""
    logging.basicConfig(format=f"%(levelname)s{where} %(name)s: %(message)s", stream=sys.stderr)
    logging.getLogger().setLevel(logging.INFO if debug else logging.WARNING)
    logging.getLogger("twinseq").setLevel(logging.INFO if debug or rank == "0" else logging.WARNING)
    logging.captureWarnings(True)
    logging.getLogger("py.warnings").addFilter(_without_trailing_newline)
    if not debug:
        for category in DEPENDENCY_NOTICES:
            warnings.filterwarnings("ignore", category=category, module=r"(?!twinseq\b)")


def train_main(argv: Sequence[str]) -> int:
    cfg = parse_train_args(argv)
    trainer = TRAINERS[cfg.task](args=cfg)  # the Python API's classes: one path, the same pre-run checks
    trainer.train()
    metrics_path = trainer.metrics_path
    if os.environ.get("RANK", "0") == "0":  # torchrun/accelerate: one line, from rank 0
        print(f"metrics: {metrics_path}")
    return 0


def data_main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="twinseq data", description="Build the embedded offline data.")
    parser.add_argument("--show", type=int, default=2, help="print this many examples of each dataset")
    args = parser.parse_args(list(argv))

    tok = load_tokenizer("embedded")
    for name in ("embedded-sft", "embedded-preference"):
        ds = corpus.load_embedded(name)
        print(f"{name}: {len(ds)} examples, columns {ds.column_names}")
        for row in ds.select(range(min(args.show, len(ds)))):
            print("  ", {k: (v[:80] + "...") if isinstance(v, str) and len(v) > 80 else v for k, v in row.items()})
    print(f"tokenizer: vocab {tok.vocab_size}, pad={tok.pad_token_id} bos={tok.bos_token_id} eos={tok.eos_token_id}")
    return 0


def one_line(err: BaseException) -> str:
    """The message of ``err`` on one line (a multi-line report is joined with ' | ')."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return " | ".join(lines) or type(err).__name__


MEMORY_HELP = """usage: twinseq memory [--config FILE] [any twinseq train flag] [--devices N] [--device cpu|cuda]
                      [--budget SIZE]

Plan the memory of one training step of that run, per component (twinseq.common.run.memory_plan), without
building anything. --dtype (a train flag) sets the compute dtype; --devices N plans an FSDP run over N
devices; --device cuda plans for a GPU (activation offloading saves memory there only). --budget SIZE
(24GiB, 500MB, ...) also prints the cheapest set of knobs under which the run fits, as flags to add; it is
compared with the plan's total.

Under the table: the process baseline, the memory a python with the backend imported holds before any model
is built (twinseq.common.run.process_baseline). On CPU it is measured once per machine by a fresh python that
imports what a training run imports, and cached in $TWINSEQ_CACHE/process_baseline (default ~/.cache/twinseq);
it is estimated where that cannot run. On CUDA it is the CUDA context, an estimated constant. Then the grand total
(plan + baseline) and what it is comparable with: the peak RSS of the twinseq train process on CPU,
torch.cuda.max_memory_allocated() plus the CUDA context on a GPU.
"""


def memory_main(argv: Sequence[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(MEMORY_HELP)
        return 0
    pre = argparse.ArgumentParser(prog="twinseq memory", add_help=False, allow_abbrev=False)
    pre.add_argument("--devices", default="1")
    pre.add_argument("--device", default="cpu")
    pre.add_argument("--budget", default=None)
    known, rest = pre.parse_known_args(list(argv))
    try:
        devices = int(known.devices)
        if devices < 1:
            raise ValueError
    except ValueError:
        raise ConfigError(
            f"--devices {known.devices!r} is not a positive integer; pass the number of devices "
            f"FSDP shards over (e.g. --devices 8)."
        ) from None
    if known.device not in ("cpu", "cuda"):
        raise ConfigError(f"--device {known.device!r} is not planned; use --device cpu or --device cuda.")
    budget = parse_bytes(known.budget, "--budget") if known.budget is not None else None
    cfg = parse_train_args(rest)
    plan = plan_memory(cfg, devices=devices, device=known.device)
    print(plan.table())
    baseline = process_baseline(cfg.backend, device=known.device, peft=cfg.peft.use_peft)
    print("\n".join(grand_total_lines(plan.total, baseline, max(len(r.component) for r in plan.rows))))
    if budget is None:
        return 0
    advice = advise(cfg, budget, devices=devices, device=known.device)
    if not advice.changes:
        print(f"\nbudget {format_bytes(budget)}: fits as is ({format_bytes(plan.total)}).")
        return 0
    print(
        f"\nbudget {format_bytes(budget)}: {format_bytes(plan.total)} does not fit. Cheapest set that fits "
        f"(free knobs first, then compute for memory, then what trains): {', '.join(advice.knobs)}\n"
    )
    print(advice.plan.table())
    print(f"\nadd: {' '.join(advice.flags)}")
    return 0


COMMANDS = ("train", "lengths", "data", "memory", "generate", "chat")


def _dispatch(command: str, rest: list[str]) -> int:
    if command == "train":
        return train_main(rest)
    if command == "memory":
        return memory_main(rest)
    if command == "lengths":
        return lengths_main(rest)
    if command == "generate":
        return generate_main(rest)
    if command == "chat":
        return chat_main(rest)
    return data_main(rest)


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv or os.environ.get("TWINSEQ_DEBUG", "") not in ("", "0")
    argv = [a for a in argv if a != "--debug"]
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        close = difflib.get_close_matches(command, COMMANDS, n=1)
        print(
            f"twinseq: unknown command {command!r}{f' (did you mean {close[0]!r}?)' if close else ''}\n\n{USAGE}",
            file=sys.stderr,
        )
        return 2
    _setup_logging(debug)
    try:
        return _dispatch(command, rest)
    except TrainingInterrupted as stop:
        print(f"twinseq {command}: {one_line(stop)}", file=sys.stderr)
        return stop.exit_code
    except KeyboardInterrupt:  # before training started: nothing to save
        print(f"twinseq {command}: interrupted", file=sys.stderr)
        return 130
    except TwinseqError as err:
        if debug:
            raise
        print(f"twinseq {command}: error: {one_line(err)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
