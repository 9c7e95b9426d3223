"""The sequence-length profiler: choose ``max_length`` from the token lengths of a dataset.

``twinseq lengths DATASET`` tokenises the dataset (no truncation), prints the length
percentiles and, for each candidate ``max_length`` L, what truncating to L costs and what
padding or packing at L wastes; it recommends the smallest L that keeps >= 99 % of the
tokens and writes a histogram PNG with the candidates marked. The tokens are the run's: its tokenizer
is picked as ``twinseq train`` picks it (``--tokenizer``, else the ``--model-config``/``--model-name-or-path``
folder's own, else the embedded one), and ``--config RUN.yaml`` reads all of that from the run's YAML.

How each column is computed (``profile_lengths``), with ``kept_i = min(len_i, L)``:

- ``tokens lost``: ``1 - sum(kept) / sum(len)``.
- ``ex. cut``: share of examples longer than L.
- ``pad (batch)``: padding share when each batch of ``batch_size`` consecutive examples
  (dataset order, last batch partial) is truncated, then padded to its longest member:
  ``1 - sum(kept) / sum_b(|b| * max_{i in b} kept_i)``.
- ``pad (to L)``: padding share when every example is padded to L: ``1 - sum(kept) / (N * L)``.
- ``packed rows``: the lower bound ``ceil(sum(kept) / L)``, and the rows of the best-fit-
  decreasing packer of ``twinseq.common.data.packing`` when it is available.
- ``batch tokens``: ``batch_size * L``, the tensor size of a padded batch at L and of a
  batch of ``batch_size`` packed rows.
"""

from __future__ import annotations

import argparse
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from twinseq.common.config import TrainConfig
from twinseq.common.data.packing import plan_packing
from twinseq.common.data.prepare import load_dataset_any, run_tokenizer, tokenize_dpo, tokenize_sft
from twinseq.common.errors import ConfigError

logger = logging.getLogger(__name__)

PERCENTILES = (50, 90, 95, 99)
KEEP_TARGET = 0.99
MAX_DEFAULT_CANDIDATES = 8


@dataclass
class CandidateStats:
    max_length: int
    tokens_lost_share: float
    examples_truncated_share: float
    padding_share_batch: float
    padding_share_fixed: float
    packed_rows_lower_bound: int
    packed_rows_bfd: Optional[int]
    batch_tokens: int
    mean_padded_batch_tokens: float


@dataclass
class LengthProfile:
    count: int
    total_tokens: int
    mean: float
    max: int
    percentiles: dict[int, int]
    batch_size: int
    candidates: list[CandidateStats] = field(default_factory=list)
    recommended: Optional[int] = None


def default_candidates(lengths: np.ndarray) -> list[int]:
    """Powers of two from just below the median to just above the longest, at most 8.

    >>> default_candidates(np.array([40, 50, 3000]))
    [32, 64, 128, 256, 512, 1024, 2048, 4096]
    """
    p50 = max(int(np.percentile(lengths, 50, method="inverted_cdf")), 1)
    low = 2 ** int(math.floor(math.log2(p50)))
    high = 2 ** int(math.ceil(math.log2(max(int(lengths.max()), 1))))
    out = [low]
    while out[-1] < high and len(out) < MAX_DEFAULT_CANDIDATES:
        out.append(out[-1] * 2)
    return out


def _batch_padding(kept: np.ndarray, batch_size: int) -> tuple[int, int]:
    """(padded slots, number of batches) for consecutive batches padded to their longest."""
    num_batches = -(-len(kept) // batch_size)
    padded = np.zeros(num_batches * batch_size, dtype=np.int64)
    padded[: len(kept)] = kept
    longest = padded.reshape(num_batches, batch_size).max(axis=1)
    sizes = np.full(num_batches, batch_size, dtype=np.int64)
    sizes[-1] = len(kept) - (num_batches - 1) * batch_size
    return int((longest * sizes).sum()), num_batches


def _bfd_rows(kept: np.ndarray, max_length: int) -> Optional[int]:
    """Rows of the packer's best-fit-decreasing plan."""
    return int(plan_packing(kept, max_length, "bfd").num_rows)


def _candidate(lengths: np.ndarray, max_length: int, batch_size: int, with_bfd: bool) -> CandidateStats:
    kept = np.minimum(lengths, max_length)
    total, kept_total = int(lengths.sum()), int(kept.sum())
    slots, num_batches = _batch_padding(kept, batch_size)
    return CandidateStats(
        max_length=int(max_length),
        tokens_lost_share=1.0 - kept_total / total,
        examples_truncated_share=float((lengths > max_length).mean()),
        padding_share_batch=1.0 - kept_total / slots,
        padding_share_fixed=1.0 - kept_total / (len(lengths) * max_length),
        packed_rows_lower_bound=-(-kept_total // max_length),
        packed_rows_bfd=_bfd_rows(kept, max_length) if with_bfd else None,
        batch_tokens=batch_size * int(max_length),
        mean_padded_batch_tokens=slots / num_batches,
    )


def profile_lengths(
    lengths: Sequence[int] | np.ndarray,
    candidates: Optional[Sequence[int]] = None,
    batch_size: int = 8,
    with_bfd: bool = True,
) -> LengthProfile:
    """Percentiles of ``lengths`` and the cost table of each candidate ``max_length``.

    Percentiles are order statistics (``inverted_cdf``): p90 is the smallest length that at
    least 90 % of the examples do not exceed, so it is always a length that occurs.

    >>> p = profile_lengths([1, 2, 3, 10], candidates=[4], batch_size=2, with_bfd=False)
    >>> p.percentiles[50], p.candidates[0].tokens_lost_share, p.candidates[0].padding_share_batch
    (2, 0.375, 0.1666...)
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.ndim != 1 or lengths.size == 0 or (lengths <= 0).any():
        raise ConfigError(
            f"lengths must be a non-empty 1-D array of positive token counts, got shape "
            f"{lengths.shape} with min {lengths.min() if lengths.size else None}; drop empty examples and pass "
            f"one length per example."
        )
    if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size <= 0:
        raise ConfigError(f"batch_size={batch_size!r} is not valid; pass a positive integer (per-device batch size).")
    candidates = sorted(set(int(c) for c in (candidates or default_candidates(lengths))))
    if candidates[0] <= 0:
        raise ConfigError(f"candidates={candidates} must all be positive; pass max_length values such as [128, 256].")
    profile = LengthProfile(
        count=int(lengths.size),
        total_tokens=int(lengths.sum()),
        mean=float(lengths.mean()),
        max=int(lengths.max()),
        batch_size=int(batch_size),
        percentiles={p: int(np.percentile(lengths, p, method="inverted_cdf")) for p in PERCENTILES},
    )
    profile.candidates = [_candidate(lengths, c, int(batch_size), with_bfd) for c in candidates]
    keeping = [c.max_length for c in profile.candidates if 1.0 - c.tokens_lost_share >= KEEP_TARGET]
    profile.recommended = keeping[0] if keeping else candidates[-1]
    return profile


def format_profile(profile: LengthProfile) -> str:
    """The printed report: percentiles, the candidate table, the recommendation."""
    pct = "  ".join(f"p{p}={v}" for p, v in profile.percentiles.items())
    lines = [
        f"{profile.count} sequences, {profile.total_tokens} tokens, mean {profile.mean:.1f}",
        f"{pct}  max={profile.max}",
        "",
        f"{'max_length':>10} {'tokens lost':>11} {'ex. cut':>8} {'pad (batch)':>11} {'pad (to L)':>10} "
        f"{'rows (lb)':>11} {'rows (bfd)':>10} {'batch tokens':>12}",
    ]
    for c in profile.candidates:
        bfd = "-" if c.packed_rows_bfd is None else str(c.packed_rows_bfd)
        lines.append(
            f"{c.max_length:>10} {c.tokens_lost_share:>11.2%} {c.examples_truncated_share:>8.2%} "
            f"{c.padding_share_batch:>11.2%} {c.padding_share_fixed:>10.2%} "
            f"{c.packed_rows_lower_bound:>11} {bfd:>10} {c.batch_tokens:>12}"
        )
    kept = next(1 - c.tokens_lost_share for c in profile.candidates if c.max_length == profile.recommended)
    if kept >= KEEP_TARGET:
        advice = (
            f"recommended max_length: {profile.recommended} (the smallest that keeps >= {KEEP_TARGET:.0%} "
            f"of tokens: {kept:.2%})"
        )
    else:
        advice = (
            f"no candidate keeps {KEEP_TARGET:.0%} of tokens; the largest, {profile.recommended}, keeps "
            f"{kept:.2%}: try larger candidates, or packing with packing_strategy='bfd_split'"
        )
    lines += [
        "",
        f"pad (batch): batches of {profile.batch_size} consecutive examples, truncated to L, padded to "
        f"their longest. rows (lb): packed rows, lower bound ceil(kept tokens / L); rows (bfd): rows "
        f"of the bfd packer. batch tokens: batch size x L.",
        advice,
    ]
    return "\n".join(lines)


def check_output_file(path: str | Path, flag: str = "--output") -> Path:
    """``path`` as a file that can be written: refuses, naming the flag and the value, a path that is a folder or
    whose parent folder cannot be made because a file stands in its way."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"{flag}={str(path)!r} is a folder; give a file name, e.g. {str(path / 'lengths.png')!r}.")
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                raise ConfigError(
                    f"{flag}={str(path)!r}: {str(parent)!r} is a file, so no folder can be made there; "
                    f"choose another path."
                )
            break
    return path


def plot_lengths(lengths: np.ndarray, profile: LengthProfile, path: str | Path, title: str = "") -> Path:
    """Histogram of the lengths (log x) with each candidate ``max_length`` as a vertical line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = check_output_file(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    low = max(int(np.min(lengths)), 1)
    bins = np.unique(np.geomspace(low, max(profile.max, low + 1) + 1, 60).astype(int))
    ax.hist(lengths, bins=bins, color="#4c72b0")
    ax.set_xscale("log")
    for c in profile.candidates:
        best = c.max_length == profile.recommended
        ax.axvline(c.max_length, color="#c44e52" if best else "0.4", linestyle="-" if best else "--", linewidth=1)
        ax.text(
            c.max_length,
            ax.get_ylim()[1] * 0.98,
            f" L={c.max_length}: {1 - c.tokens_lost_share:.1%} kept",
            fontsize=7,
            va="top",
            rotation=90,
        )
    ax.set_xlabel("tokens per sequence (log scale)")
    ax.set_ylabel("sequences")
    ax.set_title(title or f"{profile.count} sequences; recommended max_length {profile.recommended}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def sequence_lengths(dataset, tokenizer, progress: Optional[bool] = None) -> np.ndarray:
    """Untruncated token lengths: one per SFT example, two (prompt+chosen, prompt+rejected) per DPO pair."""
    if {"chosen", "rejected"} <= set(dataset.column_names):  # a prompt may be implicit
        rows, stats = tokenize_dpo(dataset, tokenizer, progress=progress)
        prompt = np.array([len(x) for x in rows["prompt_input_ids"]], dtype=np.int64)
        chosen = np.array([len(x) for x in rows["chosen_input_ids"]], dtype=np.int64)
        rejected = np.array([len(x) for x in rows["rejected_input_ids"]], dtype=np.int64)
        lengths = np.concatenate([prompt + chosen, prompt + rejected])
    else:
        rows, stats = tokenize_sft(dataset, tokenizer, progress=progress)
        lengths = np.array([len(x) for x in rows["input_ids"]], dtype=np.int64)
    if stats.examples_dropped:
        stats.log()
    return lengths


def _parse_candidates(text: Optional[str]) -> Optional[list[int]]:
    if not text:
        return None
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ConfigError(
            f"--candidates={text!r} is not valid; pass comma-separated integers, e.g. 128,256,512."
        ) from None
    if not values or min(values) <= 0:
        raise ConfigError(f"--candidates={text!r} is not valid; pass positive max_length values, e.g. 128,256,512.")
    return values


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="twinseq lengths", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "dataset",
        nargs="?",
        default=None,
        help="embedded name, local JSONL/Parquet/CSV file or folder (default: the run's dataset_name, embedded)",
    )
    parser.add_argument("--split", default=None, help="dataset split (default: the run's dataset_split, train)")
    parser.add_argument(
        "--config", default=None, help="a `twinseq train` YAML: its dataset, tokenizer, model and batch size"
    )
    parser.add_argument(
        "--model-config",
        "--model-name-or-path",
        dest="model_config",
        default=None,
        help="the run's model: a folder holding a tokenizer.json tokenises as the run will",
    )
    parser.add_argument(
        "--tokenizer",
        "--tokenizer-name-or-path",
        dest="tokenizer",
        default=None,
        help="'embedded' or a local tokenizer folder (default: the run's, as `twinseq train` picks it: "
        "tokenizer_name_or_path, else the model folder's own, else embedded)",
    )
    parser.add_argument(
        "--candidates",
        default=None,
        help="comma-separated max_length values (default: powers of two around the lengths)",
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="per-device batch size for the padding columns (default: the run's per_device_train_batch_size)",
    )
    parser.add_argument("--output", default=None, help="histogram PNG path (default: OUTPUT_DIR/lengths.png)")
    parser.add_argument("--output-dir", default=".", help="folder of the default PNG (default: cwd)")
    parser.add_argument("--no-plot", action="store_true", help="skip the PNG")
    return parser


def _run_config(args: argparse.Namespace) -> TrainConfig:
    """The run whose lengths are profiled: ``--config``'s YAML (or the defaults), with ``--model-config`` and
    ``--tokenizer`` over it, so the tokenizer is the one ``twinseq train`` would take (``prepare.run_tokenizer``)."""
    over = {
        k: v
        for k, v in (("model_config", args.model_config), ("tokenizer_name_or_path", args.tokenizer))
        if v is not None
    }
    return TrainConfig.from_yaml(args.config, **over) if args.config else TrainConfig.from_flat(**over)


def main(argv: Optional[list[str]] = None) -> int:
    """``twinseq lengths [DATASET] [--config RUN.yaml] [--model-config DIR] [--tokenizer T] [--candidates 128,256]
    [--batch-size B] [--output PNG]``: the lengths in the run's own tokens (its tokenizer, as ``twinseq train``
    picks it)."""
    args = _parser().parse_args(argv)
    candidates = _parse_candidates(args.candidates)
    cfg = _run_config(args)
    args.batch_size = cfg.data.per_device_train_batch_size if args.batch_size is None else args.batch_size
    if args.batch_size <= 0:
        raise ConfigError(f"--batch-size={args.batch_size} is not valid; pass a positive integer, e.g. --batch-size 8.")
    plot_path = Path(args.output) if args.output else Path(args.output_dir) / "lengths.png"
    if not args.no_plot:  # before the tokenising, which can take minutes
        check_output_file(plot_path, "--output" if args.output else "--output-dir")
    tokenizer = run_tokenizer(cfg)
    dataset_name = args.dataset or cfg.data.dataset_name
    if dataset_name == "embedded" and cfg.task == "dpo":
        dataset_name = "embedded-preference"
    split = args.split or cfg.data.dataset_split
    dataset = load_dataset_any(dataset_name, split=split)
    lengths = sequence_lengths(dataset, tokenizer)
    profile = profile_lengths(lengths, candidates, args.batch_size)
    print(f"dataset {dataset_name!r} ({split}), tokenizer {tokenizer.name_or_path!r}")
    print(format_profile(profile))
    if not args.no_plot:
        out = plot_lengths(lengths, profile, plot_path, title=f"{dataset_name}: token lengths")
        print(f"histogram: {out}")
    return 0
