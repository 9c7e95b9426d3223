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
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _memory import (add_measure_args, cuda_peak_above_baseline, measure_in_subprocess,  # noqa: E402
                     measured_settings, peak_bytes, print_measured, resolve_device, with_baseline)
from _report import (MIB, acceptance_line, add_output_args, markdown_table, memory_time_figure,  # noqa: E402
                     start_run)

LOSSES = ("nll", "chunked_nll", "fused_linear")


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
    from twinseq.torch_backend.losses import causal_lm_loss

    extra = {}
    with cuda_peak_above_baseline(extra, state["hidden"].is_cuda):
        loss = causal_lm_loss(state["hidden"], state["weight"], state["labels"], state["num_items"],
                              state["loss_type"], chunk_size=state["chunk_size"])
        loss.backward()
    extra["loss"] = float(loss)
    state["hidden"].grad = None
    state["weight"].grad = None
    del loss
    return extra


# --- driver ------------------------------------------------------------------------------

def _measure(args, loss_type: str) -> dict:
    chunk = args.chunk_size if loss_type == "chunked_nll" else args.fused_chunk_size
    kwargs = dict(tokens=args.tokens, hidden=args.hidden, vocab=args.vocab, dtype=args.dtype, device=args.device,
                  threads=args.threads, loss_type=loss_type, chunk_size=chunk,
                  ignore_fraction=args.ignore_fraction)
    res = measure_in_subprocess(Path(__file__), "setup", "run", kwargs, repeats=args.repeats,
                                warmup=args.warmup, num_threads=args.threads, timeout=args.timeout)
    row = {"loss_type": loss_type, "chunk_size": None if loss_type == "nll" else chunk,
           "peak_bytes": peak_bytes(res), "median_seconds": res["median_seconds"], "seconds": res["seconds"],
           "loss": res["records"][0]["extra"]["loss"], "baseline_rss_bytes": res["baseline_rss_bytes"]}
    print_measured(loss_type, row)
    return row


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
    lines = [f"Forward + backward of `causal_lm_loss` from the last hidden state: {s['tokens']} tokens, "
             f"hidden {s['hidden']}, vocab {s['vocab']}, {meta['dtype']} on {meta['device']}, "
             f"{meta['repeats']} repeat(s) after {meta['warmup']} warmup, {meta['threads']} thread(s). "
             f"Memory: {meta['memory_method']}.", ""]
    lines += markdown_table(
        ["loss_type", "chunk", "peak memory (MiB)", "vs nll", "time (s, median)", "vs nll", "loss"],
        [[r["loss_type"], r["chunk_size"] or "-", f"{r['peak_bytes'] / MIB:,.0f}", f"{r['memory_ratio_vs_nll']:.3f}",
          f"{r['median_seconds']:.3g}", f"{r['time_ratio_vs_nll']:.2f}", f"{r['loss']:.6f}"] for r in rows])
    if meta["acceptance"]:
        lines += ["", acceptance_line(meta["acceptance"])]
    return "\n".join(lines) + "\n"


def _plot(path: Path, meta: dict, rows: list[dict]) -> None:
    s = meta["shape"]
    memory_time_figure(
        path, [r["loss_type"] if r["chunk_size"] is None else f"{r['loss_type']}\n({r['chunk_size']})" for r in rows],
        rows, ratio_keys=("memory_ratio_vs_nll", "time_ratio_vs_nll"), time_label="time, forward + backward (s)",
        title=f"Loss fwd+bwd, {s['tokens']} tok, H={s['hidden']}, V={s['vocab']}, {meta['dtype']}, {meta['hardware']}",
        colors=["#888888", "#4c72b0", "#dd8452", "#55a868"][:len(rows)])


def _parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--losses", default=",".join(LOSSES), help="comma-separated; nll is always measured")
    p.add_argument("--chunk-size", type=int, default=256, help="tokens per chunk for chunked_nll (TRL: 256)")
    p.add_argument("--fused-chunk-size", type=int, default=256, help="tokens per chunk for fused_linear")
    p.add_argument("--ignore-fraction", type=float, default=0.0, help="fraction of labels set to -100")
    add_measure_args(p)
    add_output_args(p)
    return p.parse_args(argv)


def main(argv=None) -> dict:
    run = start_run(_parse, argv, __file__, device=resolve_device)
    args = run.args
    rows = [_measure(args, loss_type) for loss_type in with_baseline(args.losses)]
    _add_ratios(rows)
    meta = {**measured_settings(args), "hardware": run.provenance["hardware_slug"],
            "shape": {"tokens": args.tokens, "hidden": args.hidden, "vocab": args.vocab},
            "acceptance": _acceptance(rows)}
    payload = {**meta, "results": rows}
    run.write(payload, title="Loss memory", body=_markdown(meta, rows), plot=lambda png: _plot(png, meta, rows))
    return payload


if __name__ == "__main__":
    main()
