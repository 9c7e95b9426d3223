"""Benchmark twinseq's packing against TRL's ``pack_dataset`` on the ANCHORS distribution.

Input (ANCHORS.md): ``--num-sequences`` lengths
``clip(lognormal(mean=5.5, sigma=1.0), 1, 16384)`` from ``numpy.random.default_rng(0)``,
as a ``datasets.Dataset`` with one ``input_ids`` list<int32> column; ``seq_length`` 2048.

For each strategy it reports, for twinseq's plan only (lengths -> ``PackingPlan``) and
materialised (``pack_dataset``: Dataset -> packed Dataset), and for TRL's
``pack_dataset`` on the same Dataset in the same process: seconds (best of N), rows over
the lower bound ``ceil(tokens kept / seq_length)``, and tokens kept. Writes
``benchmarks/results/packing_<hardware>_<date>.{md,json,png}``.

    .venv/bin/python benchmarks/packing.py                       # the full 1M run
    .venv/bin/python benchmarks/packing.py --num-sequences 100000 --no-trl
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import logging
import os
import platform
import shlex
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from twinseq.common.packing import STRATEGIES, pack_dataset, plan_packing

RESULTS_DIR = Path(__file__).resolve().parent / "results"
FORM_NAMES = {"plan": "twinseq plan only", "materialised": "twinseq pack_dataset", "trl": "TRL pack_dataset"}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-sequences", type=int, default=1_000_000)
    p.add_argument("--seq-length", type=int, default=2048)
    p.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=STRATEGIES)
    p.add_argument("--repeats", type=int, default=5, help="best-of-N for twinseq")
    p.add_argument("--trl-repeats", type=int, default=3, help="best-of-N for TRL (about 17 s per bfd run at 1M)")
    p.add_argument("--no-trl", action="store_true", help="skip TRL even when it is importable")
    p.add_argument("--hardware", default="cpu-2core", help="tag in the result file names")
    p.add_argument("--output-dir", type=Path, default=RESULTS_DIR)
    p.add_argument("--no-write", action="store_true", help="print only")
    return p.parse_args(argv)


def anchors_lengths(num_sequences: int) -> np.ndarray:
    rng = np.random.default_rng(0)
    return np.clip(rng.lognormal(mean=5.5, sigma=1.0, size=num_sequences), 1, 16384).astype(int)


def make_dataset(lengths: np.ndarray):
    """A ``datasets.Dataset`` with ``input_ids`` list<int32>, built in Arrow (no Python lists)."""
    import datasets

    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    values = np.arange(offsets[-1], dtype=np.int32) % 32000
    column = pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))
    return datasets.Dataset(pa.table({"input_ids": column}))


def best_of(fn, repeats: int, label: str):
    """(min seconds, all seconds, last result)."""
    times, result = [], None
    for i in range(repeats):
        result = None
        gc.collect()
        t0 = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
        print(f"    {label} run {i + 1}/{repeats}: {times[-1]:.3f} s", flush=True)
    return min(times), times, result


def row_figures(num_rows: int, tokens_kept: int, tokens_in: int, seq_length: int) -> dict:
    lower = -(-tokens_kept // seq_length)
    return {"rows": int(num_rows), "lower_bound_rows": int(lower),
            "rows_over_lower_bound_pct": 100.0 * (num_rows / lower - 1.0),
            "tokens_kept": int(tokens_kept), "tokens_kept_pct": 100.0 * tokens_kept / tokens_in}


def run_strategy(strategy: str, lengths: np.ndarray, dataset, args, trl_pack) -> dict:
    S, tokens_in = args.seq_length, int(lengths.sum())
    out = {"strategy": strategy}
    print(f"[{strategy}] plan only", flush=True)
    sec, times, plan = best_of(lambda: plan_packing(lengths, S, strategy), args.repeats, "plan")
    out["plan"] = {"seconds": sec, "all_seconds": times,
                   **row_figures(plan.num_rows, plan.stats.num_tokens_kept, tokens_in, S)}
    print(f"[{strategy}] materialised pack_dataset", flush=True)
    sec, times, (packed, stats) = best_of(lambda: pack_dataset(dataset, S, strategy, return_stats=True),
                                          args.repeats, "pack_dataset")
    kept = int(pc.sum(pc.list_value_length(packed.data.table.column("input_ids"))).as_py())
    assert len(packed) == plan.num_rows and kept == stats.num_tokens_kept, "materialised output differs from plan"
    out["materialised"] = {"seconds": sec, "all_seconds": times, **row_figures(len(packed), kept, tokens_in, S)}
    del packed
    if trl_pack is not None:
        print(f"[{strategy}] TRL pack_dataset", flush=True)
        sec, times, packed = best_of(lambda: trl_pack(dataset, S, strategy), args.trl_repeats, "trl")
        kept = int(pc.sum(pc.list_value_length(packed.data.table.column("input_ids"))).as_py())
        out["trl"] = {"seconds": sec, "all_seconds": times, **row_figures(len(packed), kept, tokens_in, S)}
        out["speedup_vs_trl"] = out["trl"]["seconds"] / out["materialised"]["seconds"]
        del packed
    gc.collect()
    return out


def versions() -> dict:
    import datasets

    found = {"python": platform.python_version(), "numpy": np.__version__, "pyarrow": pa.__version__,
             "datasets": datasets.__version__}
    try:
        import trl
        found["trl"] = trl.__version__
    except ImportError:
        found["trl"] = None
    return found


def _relative(path: str) -> str:
    rel = os.path.relpath(path)
    return path if rel.startswith("..") else rel


def to_markdown(report: dict) -> str:
    cfg = report["config"]
    lines = [f"# Packing benchmark ({report['hardware']}, {report['date']})", "",
             f"Command: `{report['command']}`", "",
             "Versions: " + ", ".join(f"{k} {v}" for k, v in report["versions"].items()), "",
             f"Input: {cfg['num_sequences']:,} sequences, lengths clip(lognormal(5.5, 1.0), 1, 16384) from "
             f"default_rng(0), {cfg['num_tokens']:,} tokens; seq_length {cfg['seq_length']}. Times are the best of "
             f"{cfg['repeats']} runs (TRL: {cfg['trl_repeats']}) on a shared machine; load average before/after: "
             f"{report['load_before']} / {report['load_after']}.", "",
             "| strategy | form | seconds | rows | rows over lower bound | tokens kept | vs TRL |",
             "|---|---|---|---|---|---|---|"]
    for r in report["results"]:
        for form in ("plan", "materialised", "trl"):
            if form not in r:
                continue
            f = r[form]
            name = FORM_NAMES[form]
            ratio = f"{r['speedup_vs_trl']:.1f}x faster" if form == "materialised" and "speedup_vs_trl" in r else ""
            lines.append(f"| {r['strategy']} | {name} | {f['seconds']:.3f} | {f['rows']:,} | "
                         f"+{f['rows_over_lower_bound_pct']:.4f} % | {f['tokens_kept_pct']:.2f} % | {ratio} |")
    lines += ["", "Lower bound: ceil(tokens kept / seq_length). `bfd` truncates (tokens kept < 100 %), "
              "`bfd_split` and `wrapped` keep every token but lose one loss target per cut "
              "(`PackingStats.num_targets_lost`). Every run's seconds are in the json (`all_seconds`).",
              "", "Acceptance (ANCHORS): plan <= 0.3 s, rows <= lower bound x 1.0001, pack_dataset >= 8x faster "
              "than TRL in the same process (required for bfd and bfd_split; wrapped for information):"]
    for r in report["results"]:
        checks = [f"plan {r['plan']['seconds']:.3f} s", f"rows x{1 + r['plan']['rows_over_lower_bound_pct'] / 100:.6f}"]
        if "speedup_vs_trl" in r:
            checks.append(f"{r['speedup_vs_trl']:.1f}x TRL")
        lines.append(f"- {r['strategy']}: " + ", ".join(checks))
    return "\n".join(lines) + "\n"


def write_png(report: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = report["results"]
    forms = [f for f in ("plan", "materialised", "trl") if any(f in r for r in results)]
    x = np.arange(len(results))
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, form in enumerate(forms):
        secs = [r[form]["seconds"] if form in r else np.nan for r in results]
        ax.bar(x + (i - (len(forms) - 1) / 2) * 0.27, secs, 0.27, label=FORM_NAMES[form])
    ax.set_xticks(x, [r["strategy"] for r in results])
    ax.set_yscale("log")
    ax.set_ylabel("seconds (best of N, log scale)")
    ax.set_title(f"packing {report['config']['num_sequences']:,} sequences, seq_length "
                 f"{report['config']['seq_length']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None) -> dict:
    args = parse_args(argv)
    # pack_dataset logs bfd's truncation on every repeat; the table reports it once.
    logging.getLogger("twinseq.common.packing").setLevel(logging.ERROR)
    import datasets
    datasets.disable_progress_bars()
    trl_pack = None
    if not args.no_trl:
        try:
            from trl.data_utils import pack_dataset as trl_pack
        except ImportError:
            print("TRL is not importable: skipping the TRL baseline", flush=True)
    load_before = os.getloadavg()[0]
    lengths = anchors_lengths(args.num_sequences)
    print(f"building a Dataset of {len(lengths):,} sequences, {int(lengths.sum()):,} tokens", flush=True)
    dataset = make_dataset(lengths)
    results = [run_strategy(s, lengths, dataset, args, trl_pack) for s in args.strategies]
    date = datetime.date.today().isoformat()
    report = {"date": date, "hardware": args.hardware,
              "command": " ".join(shlex.quote(a) for a in [_relative(sys.executable), *sys.argv]),
              "versions": versions(), "platform": platform.platform(), "cpu_count": os.cpu_count(),
              "load_before": round(load_before, 2), "load_after": round(os.getloadavg()[0], 2),
              "config": {"num_sequences": args.num_sequences, "num_tokens": int(lengths.sum()),
                         "seq_length": args.seq_length, "repeats": args.repeats,
                         "trl_repeats": 0 if trl_pack is None else args.trl_repeats},
              "results": results}
    markdown = to_markdown(report)
    print(markdown, flush=True)
    if not args.no_write:
        args.output_dir.mkdir(parents=True, exist_ok=True)
        stem = args.output_dir / f"packing_{args.hardware}_{date}"
        stem.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
        stem.with_suffix(".md").write_text(markdown)
        write_png(report, stem.with_suffix(".png"))
        print(f"wrote {stem}.{{md,json,png}}", flush=True)
    return report


if __name__ == "__main__":
    main()
