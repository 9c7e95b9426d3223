"""Loss memory and time: nll vs chunked_nll vs fused_linear, forward + backward.

Each loss runs in its own fresh subprocess (benchmarks/_memory.py). Memory is the peak
above the baseline taken after the inputs and the lm_head are allocated:
- CPU: peak RSS of the subprocess minus its baseline (fp32);
- CUDA: ``torch.cuda.max_memory_allocated`` minus the allocated bytes before the loss (bf16).
Every figure is also given as a ratio against ``nll`` measured in the same run.

    .venv/bin/python benchmarks/loss_memory.py                      # 8192 x 2048 x 128256
    .venv/bin/python benchmarks/loss_memory.py --tokens 1024 --vocab 32000 --no-write   # quick

Acceptance (CPU, full shape): fused_linear peak <= nll / 8 and time <= 1.5 x nll.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _memory import measure_in_subprocess  # noqa: E402

LOSSES = ("nll", "chunked_nll", "fused_linear")
MIB = 1 << 20


# --- run inside the measured subprocess -------------------------------------------------

def setup(tokens: int, hidden: int, vocab: int, dtype: str, device: str, threads: int, seed: int = 0,
          loss_type: str = "nll", chunk_size: int = 256, ignore_fraction: float = 0.0) -> dict:
    import torch

    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(seed)
    dt = getattr(torch, dtype)
    hidden_BTH = (torch.randn(1, tokens, hidden, generator=gen) * 0.5).to(device, dt).requires_grad_()
    weight_VH = (torch.randn(vocab, hidden, generator=gen) * hidden ** -0.5).to(device, dt).requires_grad_()
    labels_BT = torch.randint(0, vocab, (1, tokens), generator=gen)
    labels_BT[torch.rand(1, tokens, generator=gen) < ignore_fraction] = -100
    labels_BT[:, 0] = -100  # a document start, as the collator writes it
    labels_BT = labels_BT.to(device)
    _warm_up(loss_type, chunk_size, device, dt)
    return {"hidden": hidden_BTH, "weight": weight_VH, "labels": labels_BT, "loss_type": loss_type,
            "chunk_size": chunk_size, "num_items": int((labels_BT != -100).sum())}


def _warm_up(loss_type: str, chunk_size: int, device: str, dtype) -> None:
    """A tiny call of the same loss, so that imports, kernel code pages and thread pools are
    already resident at the baseline and do not count as the loss's memory."""
    import torch

    from twinseq.torch_backend.losses import causal_lm_loss

    h = torch.randn(1, 8, 16, device=device, dtype=dtype, requires_grad=True)
    w = torch.randn(32, 16, device=device, dtype=dtype, requires_grad=True)
    causal_lm_loss(h, w, torch.randint(0, 32, (1, 8), device=device), 8, loss_type,
                   chunk_size=min(chunk_size, 4)).backward()


def run(state: dict) -> dict:
    import torch

    from twinseq.torch_backend.losses import causal_lm_loss

    cuda = state["hidden"].is_cuda
    if cuda:
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    loss = causal_lm_loss(state["hidden"], state["weight"], state["labels"], state["num_items"],
                          state["loss_type"], chunk_size=state["chunk_size"])
    loss.backward()
    extra = {"loss": float(loss)}
    if cuda:
        torch.cuda.synchronize()
        extra["cuda_peak_above_baseline_bytes"] = torch.cuda.max_memory_allocated() - before
    state["hidden"].grad = None
    state["weight"].grad = None
    del loss
    return extra


# --- driver ------------------------------------------------------------------------------

def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    except OSError:
        return platform.processor()


def _versions() -> dict:
    import numpy
    import torch

    return {"python": platform.python_version(), "torch": torch.__version__, "numpy": numpy.__version__,
            "platform": platform.platform(), "cpu_count": os.cpu_count(),
            "cuda": torch.version.cuda if torch.cuda.is_available() else None,
            "device_name": torch.cuda.get_device_name() if torch.cuda.is_available() else _cpu_name()}


def _measure(args, device: str, dtype: str, loss_type: str) -> dict:
    chunk = args.chunk_size if loss_type == "chunked_nll" else args.fused_chunk_size
    kwargs = dict(tokens=args.tokens, hidden=args.hidden, vocab=args.vocab, dtype=dtype, device=device,
                  threads=args.threads, loss_type=loss_type, chunk_size=chunk,
                  ignore_fraction=args.ignore_fraction)
    res = measure_in_subprocess(Path(__file__), "setup", "run", kwargs, repeats=args.repeats,
                                warmup=args.warmup, num_threads=args.threads, timeout=args.timeout)
    extras = [r["extra"] for r in res["records"]]
    peak = (max(e["cuda_peak_above_baseline_bytes"] for e in extras) if device == "cuda"
            else res["peak_above_baseline_bytes"])
    return {"loss_type": loss_type, "chunk_size": None if loss_type == "nll" else chunk,
            "peak_bytes": peak, "median_seconds": res["median_seconds"], "seconds": res["seconds"],
            "loss": extras[0]["loss"], "baseline_rss_bytes": res["baseline_rss_bytes"]}


def _add_ratios(rows: list[dict]) -> None:
    base = next(r for r in rows if r["loss_type"] == "nll")
    for r in rows:
        r["memory_ratio_vs_nll"] = r["peak_bytes"] / base["peak_bytes"]
        r["time_ratio_vs_nll"] = r["median_seconds"] / base["median_seconds"]


def _acceptance(rows: list[dict]) -> dict:
    fused = next((r for r in rows if r["loss_type"] == "fused_linear"), None)
    if fused is None or not any(r["loss_type"] == "nll" for r in rows):
        return {}
    return {"fused_memory_le_nll_over_8": fused["memory_ratio_vs_nll"] <= 1 / 8,
            "fused_time_le_1.5x_nll": fused["time_ratio_vs_nll"] <= 1.5}


def _markdown(meta: dict, rows: list[dict]) -> str:
    s = meta["shape"]
    lines = [f"# Loss memory: {meta['hardware']}, {meta['date']}", "",
             f"Forward + backward of `causal_lm_loss` from the last hidden state: {s['tokens']} tokens, "
             f"hidden {s['hidden']}, vocab {s['vocab']}, {meta['dtype']} on {meta['device']}, "
             f"{meta['repeats']} repeat(s) after {meta['warmup']} warmup, {meta['threads']} thread(s). "
             f"Memory: {meta['memory_method']}. 1-min load average {meta['load_average_1min']['before']} "
             f"before, {meta['load_average_1min']['after']} after.", "",
             "| loss_type | chunk | peak memory (MiB) | vs nll | time (s, median) | vs nll | loss |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['loss_type']} | {r['chunk_size'] or '-'} | {r['peak_bytes'] / MIB:,.0f} | "
                     f"{r['memory_ratio_vs_nll']:.3f} | {r['median_seconds']:.3g} | "
                     f"{r['time_ratio_vs_nll']:.2f} | {r['loss']:.6f} |")
    if meta["acceptance"]:
        lines += ["", "Acceptance: " + ", ".join(f"{k}: {'PASS' if v else 'FAIL'}"
                                                 for k, v in meta["acceptance"].items())]
    lines += ["", "Command:", "", f"    {meta['command']}", "", "Versions: " +
              ", ".join(f"{k} {v}" for k, v in meta["versions"].items()), ""]
    return "\n".join(lines)


def _plot(path: Path, meta: dict, rows: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["loss_type"] if r["chunk_size"] is None else f"{r['loss_type']}\n({r['chunk_size']})" for r in rows]
    fig, (ax_m, ax_t) = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, scale, label in ((ax_m, "peak_bytes", MIB, "peak memory above baseline (MiB)"),
                                  (ax_t, "median_seconds", 1, "time, forward + backward (s)")):
        vals = [r[key] / scale for r in rows]
        bars = ax.bar(names, vals, color=["#888888", "#4c72b0", "#dd8452", "#55a868"][:len(rows)])
        ratio_key = "memory_ratio_vs_nll" if key == "peak_bytes" else "time_ratio_vs_nll"
        ax.bar_label(bars, labels=[f"{r[ratio_key]:.2f}x" for r in rows])
        ax.set_ylabel(label)
    s = meta["shape"]
    fig.suptitle(f"Loss fwd+bwd, {s['tokens']} tok, H={s['hidden']}, V={s['vocab']}, {meta['dtype']}, "
                 f"{meta['hardware']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--losses", default=",".join(LOSSES), help="comma-separated; nll is always measured")
    p.add_argument("--chunk-size", type=int, default=256, help="tokens per chunk for chunked_nll (TRL: 256)")
    p.add_argument("--fused-chunk-size", type=int, default=256, help="tokens per chunk for fused_linear")
    p.add_argument("--repeats", type=int, default=None, help="default: 1 on CPU, 5 on CUDA")
    p.add_argument("--warmup", type=int, default=None, help="default: 0 on CPU, 1 on CUDA")
    p.add_argument("--threads", type=int, default=min(os.cpu_count() or 1, 16))
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--ignore-fraction", type=float, default=0.0, help="fraction of labels set to -100")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per loss subprocess")
    p.add_argument("--hardware", default=None, help="tag in the file name; default cpu-<n>core or the GPU")
    p.add_argument("--date", default=datetime.date.today().isoformat())
    p.add_argument("--out-dir", type=Path, default=HERE / "results")
    p.add_argument("--no-write", action="store_true", help="print only")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = _parse(argv)
    import torch

    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    dtype = "bfloat16" if device == "cuda" else "float32"
    args.repeats = args.repeats or (5 if device == "cuda" else 1)
    args.warmup = args.warmup if args.warmup is not None else (1 if device == "cuda" else 0)
    hardware = args.hardware or (f"cpu-{os.cpu_count()}core" if device == "cpu" else
                                 torch.cuda.get_device_name().lower().replace(" ", "-"))
    losses = ["nll"] + [x for x in args.losses.split(",") if x and x != "nll"]
    load_before = os.getloadavg()
    rows = []
    for loss_type in losses:
        rows.append(_measure(args, device, dtype, loss_type))
        r = rows[-1]
        print(f"{loss_type:>13}: peak {r['peak_bytes'] / MIB:10,.0f} MiB  time {r['median_seconds']:8.2f} s  "
              f"loss {r['loss']:.6f}", flush=True)
    _add_ratios(rows)
    meta = {"hardware": hardware, "date": args.date, "device": device, "dtype": dtype,
            "shape": {"tokens": args.tokens, "hidden": args.hidden, "vocab": args.vocab},
            "repeats": args.repeats, "warmup": args.warmup, "threads": args.threads,
            "memory_method": ("torch.cuda.max_memory_allocated minus allocated before the loss" if device == "cuda"
                              else "peak RSS of a fresh subprocess minus its RSS after inputs and weights"),
            "command": " ".join(shlex.quote(a) for a in [".venv/bin/python", "benchmarks/loss_memory.py",
                                                           *(sys.argv[1:] if argv is None else argv)]),
            "versions": _versions(),
            # timings on a shared machine are only comparable when this stays near the thread count
            "load_average_1min": {"before": round(load_before[0], 2), "after": round(os.getloadavg()[0], 2)}}
    meta["acceptance"] = _acceptance(rows)
    md = _markdown(meta, rows)
    print(md)
    if not args.no_write:
        stem = args.out_dir / f"loss_memory_{hardware}_{args.date}"
        args.out_dir.mkdir(parents=True, exist_ok=True)
        stem.with_suffix(".md").write_text(md)
        stem.with_suffix(".json").write_text(json.dumps({**meta, "results": rows}, indent=2) + "\n")
        _plot(stem.with_suffix(".png"), meta, rows)
        print(f"wrote {stem}.{{md,json,png}}")
    return {**meta, "results": rows}


if __name__ == "__main__":
    main()
