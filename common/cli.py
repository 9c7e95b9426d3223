"""The ``twinseq`` command line.

- ``twinseq train --backend torch|jax --task sft|dpo [--config FILE] [--flags ...]``: flags
  are generated from ``TrainConfig`` by tyro; a YAML ``--config`` sets defaults that flags
  override.
- ``twinseq lengths [DATASET]``: the sequence-length profiler that helps choose max_length.
- ``twinseq data``: build (or show) the embedded offline datasets and tokenizer.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Optional, Sequence

from twinseq.common.config import TrainConfig

USAGE = """usage: twinseq {train,lengths,data} ...

  train     train a model (twinseq train --help)
  lengths   profile sequence lengths and choose max_length (twinseq lengths --help)
  data      build the embedded offline datasets and tokenizer (twinseq data --help)
"""


def parse_train_args(argv: Sequence[str]) -> TrainConfig:
    """``--config FILE`` supplies defaults; every other flag comes from the dataclasses via tyro.

    The config tree is nested by concern, but its field names are unique, so the flags stay flat
    with TRL's names (``--max-length``, not ``--data.max-length``); ``--help`` groups them by section.
    """
    import tyro

    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", default=None)
    known, rest = pre.parse_known_args(list(argv))
    default = TrainConfig.from_yaml(known.config) if known.config else TrainConfig()
    return tyro.cli(TrainConfig, args=rest, default=default, prog="twinseq train",
                    config=(tyro.conf.OmitArgPrefixes,),
                    description="Train a model. YAML: --config FILE (flags override it).")


def _setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)


def train_main(argv: Sequence[str]) -> int:
    cfg = parse_train_args(argv)
    from twinseq.common.backend import load_backend

    backend = load_backend(cfg.backend)
    metrics_path = backend.train(cfg)
    if os.environ.get("RANK", "0") == "0":  # torchrun/accelerate: one line, from rank 0
        print(f"metrics: {metrics_path}")
    return 0


def data_main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="twinseq data", description="Build the embedded offline data.")
    parser.add_argument("--show", type=int, default=2, help="print this many examples of each dataset")
    args = parser.parse_args(list(argv))
    from twinseq.common import corpus
    from twinseq.common.tokenizer import load_tokenizer

    tok = load_tokenizer("embedded")
    for name in ("embedded-sft", "embedded-preference"):
        ds = corpus.load_embedded(name)
        print(f"{name}: {len(ds)} examples, columns {ds.column_names}")
        for row in ds.select(range(min(args.show, len(ds)))):
            print("  ", {k: (v[:80] + "...") if isinstance(v, str) and len(v) > 80 else v for k, v in row.items()})
    print(f"tokenizer: vocab {tok.vocab_size}, pad={tok.pad_token_id} bos={tok.bos_token_id} eos={tok.eos_token_id}")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    _setup_logging()
    command, rest = argv[0], argv[1:]
    try:
        if command == "train":
            return train_main(rest)
        if command == "lengths":
            from twinseq.common.lengths import main as lengths_main

            return lengths_main(rest)
        if command == "data":
            return data_main(rest)
    except (ValueError, ImportError) as err:
        print(f"twinseq {command}: error: {err}", file=sys.stderr)
        return 2
    print(f"twinseq: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
