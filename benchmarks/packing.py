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
import gc
import logging
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from twinseq.common.data.packing import STRATEGIES, pack_dataset, plan_packing

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _report import add_output_args, grouped_bars, markdown_table, pyplot, save_figure, start_run  # noqa: E402

FORM_NAMES = {"plan": "twinseq plan only", "materialised": "twinseq pack_dataset", "trl": "TRL pack_dataset"}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-sequences", type=int, default=1_000_000)
    p.add_argument("--seq-length", type=int, default=2048)
    p.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=STRATEGIES)
    p.add_argument("--repeats", type=int, default=5, help="best-of-N for twinseq")
    p.add_argument("--trl-repeats", type=int, default=3, help="best-of-N for TRL (about 17 s per bfd run at 1M)")
    p.add_argument("--no-trl", action="store_true", help="skip TRL even when it is importable")
    add_output_args(p)
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


def to_markdown(report: dict) -> str:
    cfg = report["config"]
    lines = [f"Input: {cfg['num_sequences']:,} sequences, lengths clip(lognormal(5.5, 1.0), 1, 16384) from "
             f"default_rng(0), {cfg['num_tokens']:,} tokens; seq_length {cfg['seq_length']}. Times are the best of "
             f"{cfg['repeats']} runs (TRL: {cfg['trl_repeats']}) on a possibly shared machine (load average in the "
             "provenance).", ""]
    lines += markdown_table(
        ["strategy", "form", "seconds", "rows", "rows over lower bound", "tokens kept", "vs TRL"],
        [[r["strategy"], FORM_NAMES[form], f"{r[form]['seconds']:.3f}", f"{r[form]['rows']:,}",
          f"+{r[form]['rows_over_lower_bound_pct']:.4f} %", f"{r[form]['tokens_kept_pct']:.2f} %",
          f"{r['speedup_vs_trl']:.1f}x faster" if form == "materialised" and "speedup_vs_trl" in r else ""]
         for r in report["results"] for form in ("plan", "materialised", "trl") if form in r])
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
    results = report["results"]
    forms = [f for f in ("plan", "materialised", "trl") if any(f in r for r in results)]
    fig, ax = pyplot().subplots(figsize=(7, 4))
    grouped_bars(ax, [r["strategy"] for r in results],
                 {FORM_NAMES[f]: [r[f]["seconds"] if f in r else np.nan for r in results] for f in forms},
                 ylabel="seconds (best of N, log scale)",
                 title=f"packing {report['config']['num_sequences']:,} sequences, seq_length "
                       f"{report['config']['seq_length']}")
    ax.set_yscale("log")
    save_figure(fig, path, dpi=100)


def main(argv=None) -> dict:
    run = start_run(parse_args, argv, __file__)
    args = run.args
    # pack_dataset logs bfd's truncation on every repeat; the table reports it once.
    logging.getLogger("twinseq.common.data.packing").setLevel(logging.ERROR)
    import datasets
    datasets.disable_progress_bars()
    trl_pack = None
    if not args.no_trl:
        try:
            from trl.data_utils import pack_dataset as trl_pack
        except ImportError:
            print("TRL is not importable: skipping the TRL baseline", flush=True)
    lengths = anchors_lengths(args.num_sequences)
    print(f"building a Dataset of {len(lengths):,} sequences, {int(lengths.sum()):,} tokens", flush=True)
    dataset = make_dataset(lengths)
    results = [run_strategy(s, lengths, dataset, args, trl_pack) for s in args.strategies]
    report = {"config": {"num_sequences": args.num_sequences, "num_tokens": int(lengths.sum()),
                         "seq_length": args.seq_length, "repeats": args.repeats,
                         "trl_repeats": 0 if trl_pack is None else args.trl_repeats},
              "results": results}
    run.write(report, title="Packing benchmark", body=to_markdown(report), plot=lambda png: write_png(report, png))
    return report


if __name__ == "__main__":
    main()
