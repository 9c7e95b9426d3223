"""Tile sweep of twinseq's Triton linear cross-entropy (``torch_backend/triton_ce.py``) on one GPU, beside Cut
Cross-Entropy on the same inputs: how ``GPU_FWD`` / ``GPU_BWD`` were chosen.

Inputs as ``loss_kernels.py`` draws them (``[T, H]`` hidden states, a ``[V, H]`` head, 10 % of the targets -100).
Per forward tile: the forward alone (``torch.no_grad``), median of ``--repeats`` CUDA-event timings after a warmup
call (compilation happens there). Per backward tile: forward + backward with cut cross-entropy's gradient filter
(``filter_eps="auto"``) and, for the first ``--exact`` tiles, without it; peak memory above the inputs. Cut
Cross-Entropy runs first, its default (``filter_eps="high"``) and exact (``filter_eps=None``), as the yardstick.

    python benchmarks/gpu/_tune_triton_ce.py --out DIR [--vocabs 248320] [--tokens 16384] [--hidden 2048]

Prints one line a setting and writes ``DIR/tune_triton_ce.json``. A helper for tuning, not one of the README's
benchmarks (``run_all.sh`` skips ``_*.py``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent.parent))

FWD = [  # BLOCK_N, BLOCK_V, BLOCK_D, num_warps, num_stages, programs_per_sm
    (128, 256, 64, 8, 3, 2),
    (128, 256, 64, 8, 4, 2),
    (256, 128, 64, 8, 3, 2),
    (128, 256, 32, 8, 5, 2),
]
BWD = [  # BLOCK_N, BLOCK_V, BLOCK_D, BLOCK_D2, num_warps, num_stages, GROUP_N
    (128, 128, 64, 64, 8, 3, 8),
    (128, 256, 64, 32, 8, 2, 8),
    (128, 256, 32, 32, 8, 3, 8),
    (256, 128, 64, 32, 8, 2, 8),
    (128, 256, 64, 32, 8, 2, 16),
]

FWD_KEYS = ("BLOCK_N", "BLOCK_V", "BLOCK_D", "num_warps", "num_stages", "programs_per_sm")
BWD_KEYS = ("BLOCK_N", "BLOCK_V", "BLOCK_D", "BLOCK_D2", "num_warps", "num_stages", "GROUP_N")


def timed(fn, repeats: int, clear=None):
    import torch

    fn()  # warmup: compilation, autotuning
    torch.cuda.synchronize()
    times, peaks = [], []
    for _ in range(repeats):
        if clear is not None:
            clear()  # free the last call's gradients before the baseline is read
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
        peaks.append(torch.cuda.max_memory_allocated() - before)
    return statistics.median(times), max(peaks)


def main() -> None:
    import torch

    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--vocabs", default="248320")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--exact", type=int, default=3, help="backward tiles also timed without the filter")
    p.add_argument("--budget", type=float, default=400.0, help="seconds; the sweep stops starting settings after")
    p.add_argument("--out", default=".")
    args = p.parse_args()
    t_start = time.time()

    from loss_kernels import make_inputs

    from twinseq.torch_backend import triton_ce

    default_fwd, default_bwd = dict(triton_ce.GPU_FWD), dict(triton_ce.GPU_BWD)
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": []}

    def record(**row):
        results["rows"].append(row)
        ms = row.get("ms")
        print(f"{row['vocab']:>7} {row['what']:<12} {str(row.get('tiles')):<44} "
              + (f"{ms:9.2f} ms  peak {row['peak_mib']:9.1f} MiB" if ms is not None else f"FAILED {row.get('error')}"),
              flush=True)
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "tune_triton_ce.json").write_text(json.dumps(results, indent=1))

    for vocab in [int(v) for v in args.vocabs.split(",")]:
        inp = make_inputs(args.tokens, args.hidden, vocab, "bfloat16", "cuda", 0.1)
        h, w, t = inp["hidden"], inp["weight"], inp["targets_N"]
        h2 = h.reshape(-1, h.shape[-1])
        nv = inp["num_valid"]

        def clear():
            h.grad = w.grad = None

        def fwd_bwd(loss):
            def run():
                h.grad = w.grad = None
                loss().backward()
            return run

        try:
            from cut_cross_entropy import linear_cross_entropy

            for eps in ("high", None):
                ms, peak = timed(fwd_bwd(lambda eps=eps: linear_cross_entropy(
                    h2, w, t, ignore_index=-100, reduction="sum", filter_eps=eps) / nv), args.repeats, clear)
                record(vocab=vocab, what=f"cce {eps}", tiles="fwd+bwd", ms=ms, peak_mib=peak / 2**20)
                with torch.no_grad():
                    ms, peak = timed(lambda eps=eps: linear_cross_entropy(h2, w, t, ignore_index=-100,
                                                                          reduction="sum", filter_eps=eps),
                                     args.repeats)
                record(vocab=vocab, what=f"cce {eps} fwd", tiles="fwd", ms=ms, peak_mib=peak / 2**20)
        except Exception as err:  # noqa: BLE001
            record(vocab=vocab, what="cce", error=repr(err)[:300])

        for tiles in FWD:
            if time.time() - t_start > args.budget:
                break
            cfg = dict(zip(FWD_KEYS, tiles))
            triton_ce.GPU_FWD = cfg
            try:
                with torch.no_grad():
                    ms, peak = timed(lambda: triton_ce.linear_logps(h2, w, t), args.repeats)
                record(vocab=vocab, what="fwd", tiles=tiles, ms=ms, peak_mib=peak / 2**20)
            except Exception as err:  # noqa: BLE001
                traceback.print_exc(limit=2)
                record(vocab=vocab, what="fwd", tiles=tiles, error=repr(err)[:300])
        fwd_rows = [r for r in results["rows"] if r["vocab"] == vocab and r["what"] == "fwd" and "ms" in r]
        best_fwd = min(fwd_rows, key=lambda r: r["ms"])["tiles"] if fwd_rows else None
        triton_ce.GPU_FWD = dict(zip(FWD_KEYS, best_fwd)) if best_fwd else default_fwd
        print(f"best forward tiles {best_fwd}", flush=True)

        for i, tiles in enumerate(BWD):
            cfg = dict(zip(BWD_KEYS, tiles))
            triton_ce.GPU_BWD = cfg
            modes = [("auto", "input"), ("auto", "float32")] + ([(None, "float32")] if i < args.exact else [])
            for eps, acc in modes:
                if time.time() - t_start > args.budget:
                    break
                try:
                    loss = (lambda eps=eps, acc=acc: -triton_ce.linear_logps(h2, w, t, filter_eps=eps,
                                                                              accumulate=acc)[0].sum() / nv)
                    ms, peak = timed(fwd_bwd(loss), args.repeats, clear)
                    record(vocab=vocab, what=f"fb {eps} {acc[:3]}", tiles=tiles, ms=ms, peak_mib=peak / 2**20)
                except Exception as err:  # noqa: BLE001
                    traceback.print_exc(limit=2)
                    record(vocab=vocab, what=f"fb {eps} {acc[:3]}", tiles=tiles, error=repr(err)[:300])
        triton_ce.GPU_FWD, triton_ce.GPU_BWD = default_fwd, default_bwd
        del inp, h, w, t, h2
        torch.cuda.empty_cache()
    best = {}
    for which, prefix, keys, grid in (("fwd", "fwd", FWD_KEYS, FWD), ("bwd", "fb auto inp", BWD_KEYS, BWD)):
        rows = [r for r in results["rows"] if r["what"] == prefix and "ms" in r]
        vocabs = sorted({r["vocab"] for r in rows})
        # the tiles with the least total time over the vocabularies that measured every one of them
        totals = {}
        for tiles in grid:
            ms = [r["ms"] for r in rows if tuple(r["tiles"]) == tuple(tiles)]
            if len(ms) == len(vocabs) and ms:
                totals[tuple(tiles)] = sum(ms)
        if totals:
            best[which] = dict(zip(keys, min(totals, key=totals.get)))
    results["best"] = best
    (Path(args.out) / "tune_triton_ce.json").write_text(json.dumps(results, indent=1))
    (Path(args.out) / "best_tiles.json").write_text(json.dumps(best))
    print(f"best tiles {best}; sweep done in {time.time() - t_start:.0f} s", flush=True)


if __name__ == "__main__":
    main()
