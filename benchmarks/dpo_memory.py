"""DPO log-prob memory and time: full logits vs chunked log-probs, padded vs padding-free.

What is measured, per (layout, kernel): the DPO loss *from the final hidden states*, i.e.
``torch_backend.dpo.sequence_logps`` (lm_head + per-token target log-probs + per-document
sums) + ``dpo_from_logps`` ('sigmoid', beta 0.1, fixed reference log-probs) + ``backward()``
w.r.t. the hidden states and the lm_head. The decoder below the hidden states is not run: it
is the same for every kernel, and at vocab 128256 the log-prob stage is the one that grows.

- Data: N = 16 synthetic pairs (seeded), prompts of 16-96 tokens, completions of 32 tokens up
  to the row length, so that the padded batch is exactly ``[2N, T] = [32, 256]`` = 8192
  positions; padding-free holds the same 32 documents in one row, without the padding.
- Kernels (``loss_type``): ``nll`` = full ``[B*T, V]`` logits and ``log_softmax`` (the
  baseline); ``chunked_nll`` = checkpointed chunks of 256 target rows; ``fused_linear`` = the
  custom autograd Function (logsumexp saved, chunk logits recomputed in backward).
- Memory: CPU, peak RSS of a fresh subprocess above its baseline after the inputs exist
  (``benchmarks/_memory.py``); CUDA, ``torch.cuda.max_memory_allocated`` above the allocated
  bytes before the call. Also JAX (``jax_backend.dpo``), compile only: ``memory_analysis()
  .temp_size_in_bytes`` of ``jit(value_and_grad)`` at the same shapes.

    .venv/bin/python benchmarks/dpo_memory.py                         # 8192 positions, V 128256, H 256
    .venv/bin/python benchmarks/dpo_memory.py --pairs 4 --row 64 --vocab 4096 --no-write   # quick

Acceptance: at the padded 8192-position shape, fused_linear peak <= nll peak / 8.
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

KERNELS = ("nll", "chunked_nll", "fused_linear")
LAYOUTS = ("padded", "padding_free")
MIB = 1 << 20
BETA = 0.1


# --- shared by the subprocess and the driver -----------------------------------------------

def synthetic_pairs(pairs: int, row: int, vocab: int, seed: int) -> list[dict]:
    """``pairs`` preference rows whose prompt + completion fit ``row`` tokens; the first chosen
    fills the row exactly, so the padded batch is ``[2 * pairs, row]``."""
    import numpy as np

    rng = np.random.default_rng(seed)
    out = []
    for i in range(pairs):
        p = int(rng.integers(row // 16, row * 3 // 8 + 1))
        c, r = (int(rng.integers(min(row // 8, row - p), row - p + 1)) for _ in range(2))
        if i == 0:
            c = row - p
        out.append({"prompt_input_ids": rng.integers(3, vocab, p).tolist(),
                    "chosen_input_ids": rng.integers(3, vocab, c).tolist(),
                    "rejected_input_ids": rng.integers(3, vocab, r).tolist()})
    return out


def preference_batch(layout: str, pairs: int, row: int, vocab: int, seed: int):
    from twinseq.common.dpo_batching import collate_preference

    return collate_preference(synthetic_pairs(pairs, row, vocab, seed), padding_free=layout == "padding_free")


def _ref_logps(pb, vocab: int):
    """A reference near a uniform model's log-probs, so the log-ratios stay O(1)."""
    import math

    counts = pb.num_target_tokens.astype(float)
    ref = -counts * math.log(vocab)
    return ref[:pb.num_examples], ref[pb.num_examples:]


# --- run inside the measured subprocess ----------------------------------------------------

def setup(layout: str, kernel: str, pairs: int, row: int, hidden: int, vocab: int, dtype: str, device: str,
          threads: int, chunk_size: int, seed: int = 0) -> dict:
    import torch

    from twinseq.common.dpo import validate_dpo_config

    torch.set_num_threads(threads)
    pb = preference_batch(layout, pairs, row, vocab, seed)
    gen = torch.Generator().manual_seed(seed)
    dt = getattr(torch, dtype)
    hidden_BTH = _layout_hidden(torch.randn(2 * pairs, row, hidden, generator=gen) * 0.5, pb)
    hidden_BTH = hidden_BTH.to(device, dt).requires_grad_()
    weight_VH = (torch.randn(vocab, hidden, generator=gen) * hidden ** -0.5).to(device, dt).requires_grad_()
    state = {"pb": pb, "hidden": hidden_BTH, "weight": weight_VH, "kernel": kernel, "chunk_size": chunk_size,
             "config": validate_dpo_config("sigmoid", beta=BETA), "ref": _ref_logps(pb, vocab)}
    _warm_up(state, device, dt)
    return state


def _layout_hidden(padded_hidden_DTH, pb):
    """The padded layout's hidden states, or the same vectors without the padding (one row): both
    layouts then compute the same loss, a check that they score the same documents."""
    import torch

    if pb.batch.shape[0] == padded_hidden_DTH.shape[0]:
        return padded_hidden_DTH
    # document d is row d of the padded layout; padding-free concatenates them in that order
    real = torch.cat([padded_hidden_DTH[d, :n] for d, n in enumerate(_doc_lengths(pb))])
    return real[None]


def _doc_lengths(pb) -> list[int]:
    cu = pb.batch.cu_seqlens
    return [int(b - a) for a, b in zip(cu[:-1], cu[1:])]


def _warm_up(state: dict, device: str, dtype) -> None:
    """A tiny call of the same path, so imports and thread pools are resident at the baseline."""
    import torch

    small = preference_batch("padded", 2, 8, 32, 1)
    h = torch.randn(*small.batch.shape, 4, device=device, dtype=dtype, requires_grad=True)
    w = torch.randn(32, 4, device=device, dtype=dtype, requires_grad=True)
    _loss(small, h, w, state["kernel"], 4, state["config"], _ref_logps(small, 32)).backward()


def _loss(pb, hidden, weight, kernel, chunk_size, config, ref):
    from twinseq.torch_backend.dpo import dpo_from_logps, sequence_logps

    logps_D = sequence_logps(hidden, weight, pb, kernel, chunk_size)
    return dpo_from_logps(logps_D, pb, config, ref_chosen_logps=ref[0], ref_rejected_logps=ref[1]).loss


def run(state: dict) -> dict:
    import torch

    cuda = state["hidden"].is_cuda
    if cuda:
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    loss = _loss(state["pb"], state["hidden"], state["weight"], state["kernel"], state["chunk_size"],
                 state["config"], state["ref"])
    loss.backward()
    extra = {"loss": float(loss), "grad_weight_norm": float(state["weight"].grad.float().norm())}
    if cuda:
        torch.cuda.synchronize()
        extra["cuda_peak_above_baseline_bytes"] = torch.cuda.max_memory_allocated() - before
    state["hidden"].grad = None
    state["weight"].grad = None
    del loss
    return extra


# --- JAX, compile only ------------------------------------------------------------------------

def jax_temp_bytes(layout: str, kernel: str, pairs: int, row: int, hidden: int, vocab: int, chunk_size: int,
                   seed: int = 0) -> int:
    """``memory_analysis().temp_size_in_bytes`` of jit(value_and_grad) of the same stage (float32)."""
    import jax
    import jax.numpy as jnp

    from twinseq.common.dpo import validate_dpo_config
    from twinseq.jax_backend.dpo import dpo_losses, sequence_logps

    pb = preference_batch(layout, pairs, row, vocab, seed)
    config, (ref_c, ref_r), n = validate_dpo_config("sigmoid", beta=BETA), _ref_logps(pb, vocab), pb.num_examples

    def loss(hidden_BTH, lm_head_VH, labels_BT, target_doc_BT):
        logps = sequence_logps(hidden_BTH, lm_head_VH, labels_BT, target_doc_BT, 2 * n, kernel, chunk_size)
        return dpo_losses(logps[:n], logps[n:], jnp.asarray(ref_c, jnp.float32), jnp.asarray(ref_r, jnp.float32),
                          config)[0].mean()

    b, t = pb.batch.shape
    args = (jax.ShapeDtypeStruct((b, t, hidden), jnp.float32), jax.ShapeDtypeStruct((vocab, hidden), jnp.float32),
            jax.ShapeDtypeStruct((b, t), jnp.int32), jax.ShapeDtypeStruct((b, t), jnp.int32))
    with jax.default_matmul_precision("highest"):
        compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(*args).compile()
    return int(compiled.memory_analysis().temp_size_in_bytes)


# --- driver ------------------------------------------------------------------------------

def _versions() -> dict:
    import jax
    import numpy
    import torch

    return {"python": platform.python_version(), "torch": torch.__version__, "jax": jax.__version__,
            "numpy": numpy.__version__, "platform": platform.platform(), "cpu_count": os.cpu_count(),
            "cuda": torch.version.cuda if torch.cuda.is_available() else None,
            "device_name": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor()}


def _measure(args, device: str, dtype: str, layout: str, kernel: str) -> dict:
    kwargs = dict(layout=layout, kernel=kernel, pairs=args.pairs, row=args.row, hidden=args.hidden, vocab=args.vocab,
                  dtype=dtype, device=device, threads=args.threads, chunk_size=args.chunk_size)
    res = measure_in_subprocess(Path(__file__), "setup", "run", kwargs, repeats=args.repeats, warmup=args.warmup,
                                num_threads=args.threads, timeout=args.timeout)
    extras = [r["extra"] for r in res["records"]]
    peak = (max(e["cuda_peak_above_baseline_bytes"] for e in extras) if device == "cuda"
            else res["peak_above_baseline_bytes"])
    pb = preference_batch(layout, args.pairs, args.row, args.vocab, 0)
    row = {"layout": layout, "kernel": kernel, "batch_shape": list(pb.batch.shape),
           "positions": pb.batch.input_ids.size,
           "tokens": pb.batch.num_tokens, "targets": int(pb.num_target_tokens.sum()), "peak_bytes": peak,
           "median_seconds": res["median_seconds"], "seconds": res["seconds"], "loss": extras[0]["loss"],
           "grad_weight_norm": extras[0]["grad_weight_norm"]}
    if not args.no_jax:
        row["jax_temp_bytes"] = jax_temp_bytes(layout, kernel, args.pairs, args.row, args.hidden, args.vocab,
                                               args.chunk_size)
    return row


def _add_ratios(rows: list[dict]) -> None:
    base_all = next(r for r in rows if r["layout"] == "padded" and r["kernel"] == "nll")
    for r in rows:
        base = next(b for b in rows if b["layout"] == r["layout"] and b["kernel"] == "nll")
        r["memory_vs_full_same_layout"] = r["peak_bytes"] / base["peak_bytes"]
        r["time_vs_full_same_layout"] = r["median_seconds"] / base["median_seconds"]
        r["memory_vs_full_padded"] = r["peak_bytes"] / base_all["peak_bytes"]
        if "jax_temp_bytes" in r:
            r["jax_temp_vs_full_same_layout"] = r["jax_temp_bytes"] / base["jax_temp_bytes"]


def _acceptance(rows: list[dict]) -> dict:
    fused = next(r for r in rows if r["layout"] == "padded" and r["kernel"] == "fused_linear")
    return {"fused_linear_memory_le_full_over_8_padded": fused["memory_vs_full_same_layout"] <= 1 / 8}


def _markdown(meta: dict, rows: list[dict]) -> str:
    s = meta["shape"]
    lines = [f"# DPO log-prob memory: {meta['hardware']}, {meta['date']}", "",
             f"Measured: `sequence_logps` (lm_head + target log-probs + per-document sums) + the 'sigmoid' DPO loss "
             f"(beta {BETA}) + `backward()` w.r.t. the final hidden states and the lm_head, from random hidden "
             f"states (the decoder is not run). {s['pairs']} synthetic pairs; padded batch [{2 * s['pairs']}, "
             f"{s['row']}] = {2 * s['pairs'] * s['row']} positions; hidden {s['hidden']}, vocab {s['vocab']}, "
             f"{meta['dtype']} on {meta['device']}, chunks of {s['chunk_size']} rows, {meta['threads']} thread(s), "
             f"{meta['repeats']} repeat(s) after {meta['warmup']} warmup. Memory: {meta['memory_method']}. "
             f"1-min load average {meta['load_average_1min']['before']} before, "
             f"{meta['load_average_1min']['after']} after (the machine is shared: times are indicative).", "",
             "| layout | kernel | batch | tokens / targets | peak MiB | vs full (same layout) | vs full padded | "
             "time s | vs full | JAX temp MiB | JAX vs full |", "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        jax_cols = (f"{r['jax_temp_bytes'] / MIB:,.0f} | {r['jax_temp_vs_full_same_layout']:.3f}"
                    if "jax_temp_bytes" in r else "- | -")
        lines.append(f"| {r['layout']} | {r['kernel']} | {r['batch_shape'][0]}x{r['batch_shape'][1]} | "
                     f"{r['tokens']} / {r['targets']} | {r['peak_bytes'] / MIB:,.0f} | "
                     f"{r['memory_vs_full_same_layout']:.3f} | {r['memory_vs_full_padded']:.3f} | "
                     f"{r['median_seconds']:.3g} | {r['time_vs_full_same_layout']:.2f} | {jax_cols} |")
    lines += ["", "Acceptance: " + ", ".join(f"{k}: {'PASS' if v else 'FAIL'}" for k, v in meta["acceptance"].items()),
              "", "Notes:", "",
              "- `nll` holds the [positions, V] fp32 logits' log_softmax (saved for backward) and, in backward, two "
              "more [positions, V] buffers; it pays for prompt and padding positions too.",
              "- `fused_linear` holds per target row one logsumexp, one chunk of logits (and one temporary of it) at "
              "a time and one fp32 [V, H] weight-gradient buffer: ~(2 x chunk x V + V x H) x 4 bytes = 375 MiB "
              "here, independent of the token count, so padded and padding-free cost the same. The [V, H] part "
              "grows with H: 1 GiB at H = 2048 (not measured here; `benchmarks/loss_memory.py` measures SFT "
              "at H = 2048).",
              "- Both layouts hold the same documents and the same hidden vectors (padding-free drops the padded "
              "positions), so every row computes the same loss; the weight-gradient norms agree too (json).",
              "", "Command:", "", f"    {meta['command']}", "",
              "Versions: " + ", ".join(f"{k} {v}" for k, v in meta["versions"].items()), ""]
    return "\n".join(lines)


def _plot(path: Path, meta: dict, rows: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_m, ax_t) = plt.subplots(1, 2, figsize=(11, 4))
    names = [f"{r['kernel']}\n{r['layout']}" for r in rows]
    colors = ["#888888" if r["kernel"] == "nll" else "#4c72b0" if r["kernel"] == "chunked_nll" else "#55a868"
              for r in rows]
    for ax, key, scale, ratio, label in (
            (ax_m, "peak_bytes", MIB, "memory_vs_full_same_layout", "peak memory above baseline (MiB)"),
            (ax_t, "median_seconds", 1, "time_vs_full_same_layout", "log-probs + loss + backward (s)")):
        bars = ax.bar(names, [r[key] / scale for r in rows], color=colors)
        ax.bar_label(bars, labels=[f"{r[ratio]:.2f}x" for r in rows])
        ax.set_ylabel(label)
        ax.tick_params(axis="x", labelsize=8)
    s = meta["shape"]
    fig.suptitle(f"DPO log-probs from hidden states: {2 * s['pairs']}x{s['row']} positions, H={s['hidden']}, "
                 f"V={s['vocab']}, {meta['dtype']}, {meta['hardware']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pairs", type=int, default=16)
    p.add_argument("--row", type=int, default=256, help="padded row length; 2 * pairs * row positions")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--chunk-size", type=int, default=256)
    p.add_argument("--kernels", default=",".join(KERNELS), help="comma-separated; nll is always measured")
    p.add_argument("--repeats", type=int, default=None, help="default: 1 on CPU, 5 on CUDA")
    p.add_argument("--warmup", type=int, default=None, help="default: 0 on CPU, 1 on CUDA")
    p.add_argument("--threads", type=int, default=min(os.cpu_count() or 1, 16))
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--timeout", type=float, default=3600.0)
    p.add_argument("--no-jax", action="store_true", help="skip the JAX compile-only column")
    p.add_argument("--hardware", default=None, help="tag in the file name; default cpu-<n>core or the GPU")
    p.add_argument("--date", default=datetime.date.today().isoformat())
    p.add_argument("--out-dir", type=Path, default=HERE / "results")
    p.add_argument("--no-write", action="store_true")
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
    kernels = ["nll"] + [k for k in args.kernels.split(",") if k and k != "nll"]
    load_before = os.getloadavg()
    rows = []
    for layout in LAYOUTS:
        for kernel in kernels:
            rows.append(_measure(args, device, dtype, layout, kernel))
            r = rows[-1]
            print(f"{layout:>12} {kernel:>12}: peak {r['peak_bytes'] / MIB:9,.0f} MiB  "
                  f"time {r['median_seconds']:7.2f} s  loss {r['loss']:.6f}", flush=True)
    _add_ratios(rows)
    meta = {"hardware": hardware, "date": args.date, "device": device, "dtype": dtype,
            "shape": {"pairs": args.pairs, "row": args.row, "hidden": args.hidden, "vocab": args.vocab,
                      "chunk_size": args.chunk_size},
            "repeats": args.repeats, "warmup": args.warmup, "threads": args.threads,
            "memory_method": ("torch.cuda.max_memory_allocated minus allocated before the call" if device == "cuda"
                              else "peak RSS of a fresh subprocess minus its RSS after inputs and weights"),
            "jax_memory_method": "jit(value_and_grad).lower().compile().memory_analysis().temp_size_in_bytes, "
                                 "float32, compile only",
            "command": " ".join(shlex.quote(a) for a in [".venv/bin/python", "benchmarks/dpo_memory.py",
                                                           *(sys.argv[1:] if argv is None else argv)]),
            "versions": _versions(),
            "load_average_1min": {"before": round(load_before[0], 2), "after": round(os.getloadavg()[0], 2)}}
    meta["acceptance"] = _acceptance(rows)
    md = _markdown(meta, rows)
    print(md)
    if not args.no_write:
        stem = args.out_dir / f"dpo_memory_{hardware}_{args.date}"
        args.out_dir.mkdir(parents=True, exist_ok=True)
        stem.with_suffix(".md").write_text(md)
        stem.with_suffix(".json").write_text(json.dumps({**meta, "results": rows}, indent=2) + "\n")
        _plot(stem.with_suffix(".png"), meta, rows)
        print(f"wrote {stem}.{{md,json,png}}")
    return {**meta, "results": rows}


if __name__ == "__main__":
    main()
