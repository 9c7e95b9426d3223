"""Per-rank peak memory of ``allgather`` context parallelism against one process, at a long row length.

The claim (issue 13, torch half): with the blocked attention, a CP rank holds T/cp tokens and its
attention temporaries are O(T/cp x block), so at T = 16384 (small preset, fp32, gradient
checkpointing, fused_linear) each of 2 gloo ranks peaks at no more than 0.6x the single process on
the same rows (which also runs the blocked attention: T >= ``blocked_attention.BLOCKED_MIN_SEQ_LEN``).

Both runs are ``twinseq train`` steps measured by ``_long_context.train_step_peak`` (peak RSS of a
fresh subprocess above its RSS before the model was built). They run at the same time (3 processes):
RSS peaks are per process, so only the timings feel the sharing; seconds per step are reported as is.

    .venv/bin/python benchmarks/cp_memory.py                  # T=16384, cp=2
    .venv/bin/python benchmarks/cp_memory.py --seq-len 4096 --model-config tiny --no-write
"""

from __future__ import annotations

import argparse
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _long_context import LONG_CONTEXT_DEFAULTS, train_step_peak  # noqa: E402
from _report import MIB, add_output_args, markdown_table, start_run  # noqa: E402

TARGET_RATIO = 0.6


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-len", type=int, default=16384)
    parser.add_argument("--cp", type=int, default=2)
    parser.add_argument("--model-config", default=LONG_CONTEXT_DEFAULTS["model_config"])
    parser.add_argument("--max-steps", type=int, default=1)
    parser.add_argument("--tiled-mlp", action="store_true", help="both runs with tiled_mlp=True")
    add_output_args(parser)
    return parser.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> None:
    run = start_run(parse_args, argv, __file__, device="cpu")
    args = run.args
    common = dict(model_config=args.model_config, max_steps=args.max_steps, tiled_mlp=args.tiled_mlp)
    with ThreadPoolExecutor(2) as pool:
        single = pool.submit(train_step_peak, args.seq_len, **common)
        sharded = pool.submit(train_step_peak, args.seq_len, cp=args.cp, **common)
        single, sharded = single.result(), sharded.result()
    per_rank = sharded["per_rank_peak_bytes"]
    ratio = max(per_rank) / single["peak_bytes"]
    rows = [["1 process", f"{single['peak_bytes'] / MIB:.0f}", "1.00",
             f"{single['seconds_per_step']:.0f}"]]
    rows += [[f"cp={args.cp} allgather, rank {r}", f"{p / MIB:.0f}", f"{p / single['peak_bytes']:.2f}",
              f"{sharded['seconds_per_step']:.0f}" if r == 0 else ""] for r, p in enumerate(per_rank)]
    verdict = "meets" if ratio <= TARGET_RATIO else "MISSES"
    body = "\n".join([
        f"One training step on one packed row of T={args.seq_len} tokens, model `{args.model_config}`, fp32, "
        f"gradient checkpointing, fused_linear{', tiled MLP' if args.tiled_mlp else ''}; peak RSS above the "
        f"pre-build baseline.", "",
        *markdown_table(["run", "peak MiB", "ratio vs 1 process", "s/step (shared CPU)"], rows), "",
        f"Largest rank / single process = **{ratio:.2f}** ({verdict} the target <= {TARGET_RATIO}).", "",
        f"Commands: `{single['command']}`; `{sharded['command']}`."])
    run.write({"seq_len": args.seq_len, "cp": args.cp, "target_ratio": TARGET_RATIO, "ratio": ratio,
               "single": single, "cp_run": sharded}, title="Context-parallel memory (allgather, blocked attention)",
              body=body)


if __name__ == "__main__":
    main()
