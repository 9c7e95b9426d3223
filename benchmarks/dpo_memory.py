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
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _memory import (add_measure_args, cuda_peak_above_baseline, measure_in_subprocess,  # noqa: E402
                     measured_settings, peak_bytes, print_measured, resolve_device, with_baseline)
from _report import (MIB, acceptance_line, add_output_args, markdown_table, memory_time_figure,  # noqa: E402
                     start_run)

KERNELS = ("nll", "chunked_nll", "fused_linear")
LAYOUTS = ("padded", "padding_free")
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
    from twinseq.common.data.preference_batching import collate_preference

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

    from twinseq.common.objectives.dpo import validate_dpo_config

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
    from twinseq.torch_backend.dpo import dpo_from_logps
    from twinseq.torch_backend.logprobs import sequence_logps

    logps_D = sequence_logps(hidden, weight, pb, kernel, chunk_size)
    return dpo_from_logps(logps_D, pb, config, ref_chosen_logps=ref[0], ref_rejected_logps=ref[1]).loss


def run(state: dict) -> dict:
    extra = {}
    with cuda_peak_above_baseline(extra, state["hidden"].is_cuda):
        loss = _loss(state["pb"], state["hidden"], state["weight"], state["kernel"], state["chunk_size"],
                     state["config"], state["ref"])
        loss.backward()
    extra.update(loss=float(loss), grad_weight_norm=float(state["weight"].grad.float().norm()))
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

    from twinseq.common.objectives.dpo import validate_dpo_config
    from twinseq.jax_backend.dpo import dpo_losses
    from twinseq.jax_backend.logprobs import sequence_logps

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

def _measure(args, layout: str, kernel: str) -> dict:
    kwargs = dict(layout=layout, kernel=kernel, pairs=args.pairs, row=args.row, hidden=args.hidden, vocab=args.vocab,
                  dtype=args.dtype, device=args.device, threads=args.threads, chunk_size=args.chunk_size)
    res = measure_in_subprocess(Path(__file__), "setup", "run", kwargs, repeats=args.repeats, warmup=args.warmup,
                                num_threads=args.threads, timeout=args.timeout)
    extra = res["records"][0]["extra"]
    pb = preference_batch(layout, args.pairs, args.row, args.vocab, 0)
    row = {"layout": layout, "kernel": kernel, "batch_shape": list(pb.batch.shape),
           "positions": pb.batch.input_ids.size,
           "tokens": pb.batch.num_tokens, "targets": int(pb.num_target_tokens.sum()), "peak_bytes": peak_bytes(res),
           "median_seconds": res["median_seconds"], "seconds": res["seconds"], "loss": extra["loss"],
           "grad_weight_norm": extra["grad_weight_norm"]}
    if not args.no_jax:
        row["jax_temp_bytes"] = jax_temp_bytes(layout, kernel, args.pairs, args.row, args.hidden, args.vocab,
                                               args.chunk_size)
    print_measured(f"{layout} {kernel}", row)
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
    lines = [f"Measured: `sequence_logps` (lm_head + target log-probs + per-document sums) + the 'sigmoid' DPO loss "
             f"(beta {BETA}) + `backward()` w.r.t. the final hidden states and the lm_head, from random hidden "
             f"states (the decoder is not run). {s['pairs']} synthetic pairs; padded batch [{2 * s['pairs']}, "
             f"{s['row']}] = {2 * s['pairs'] * s['row']} positions; hidden {s['hidden']}, vocab {s['vocab']}, "
             f"{meta['dtype']} on {meta['device']}, chunks of {s['chunk_size']} rows, {meta['threads']} thread(s), "
             f"{meta['repeats']} repeat(s) after {meta['warmup']} warmup. Memory: {meta['memory_method']}. "
             "The machine may be shared (load average in the provenance): times are indicative.", ""]
    lines += markdown_table(
        ["layout", "kernel", "batch", "tokens / targets", "peak MiB", "vs full (same layout)", "vs full padded",
         "time s", "vs full", "JAX temp MiB", "JAX vs full"],
        [[r["layout"], r["kernel"], f"{r['batch_shape'][0]}x{r['batch_shape'][1]}", f"{r['tokens']} / {r['targets']}",
          f"{r['peak_bytes'] / MIB:,.0f}", f"{r['memory_vs_full_same_layout']:.3f}",
          f"{r['memory_vs_full_padded']:.3f}", f"{r['median_seconds']:.3g}", f"{r['time_vs_full_same_layout']:.2f}",
          f"{r['jax_temp_bytes'] / MIB:,.0f}" if "jax_temp_bytes" in r else "-",
          f"{r['jax_temp_vs_full_same_layout']:.3f}" if "jax_temp_bytes" in r else "-"] for r in rows],
        align="llllrrrrrrr")
    lines += ["", acceptance_line(meta["acceptance"]), "", "Notes:", "",
              "- `nll` holds the [positions, V] fp32 logits' log_softmax (saved for backward) and, in backward, two "
              "more [positions, V] buffers; it pays for prompt and padding positions too.",
              "- `fused_linear` holds per target row one logsumexp, one chunk of logits (and one temporary of it) at "
              "a time and one fp32 [V, H] weight-gradient buffer: ~(2 x chunk x V + V x H) x 4 bytes = 375 MiB "
              "here, independent of the token count, so padded and padding-free cost the same. The [V, H] part "
              "grows with H: 1 GiB at H = 2048 (not measured here; `benchmarks/loss_memory.py` measures SFT "
              "at H = 2048).",
              "- Both layouts hold the same documents and the same hidden vectors (padding-free drops the padded "
              "positions), so every row computes the same loss; the weight-gradient norms agree too (json)."]
    return "\n".join(lines) + "\n"


def _plot(path: Path, meta: dict, rows: list[dict]) -> None:
    s = meta["shape"]
    memory_time_figure(
        path, [f"{r['kernel']}\n{r['layout']}" for r in rows], rows,
        ratio_keys=("memory_vs_full_same_layout", "time_vs_full_same_layout"),
        time_label="log-probs + loss + backward (s)",
        title=f"DPO log-probs from hidden states: {2 * s['pairs']}x{s['row']} positions, H={s['hidden']}, "
              f"V={s['vocab']}, {meta['dtype']}, {meta['hardware']}",
        colors=[{"nll": "#888888", "chunked_nll": "#4c72b0"}.get(r["kernel"], "#55a868") for r in rows],
        figsize=(11, 4))


def _parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pairs", type=int, default=16)
    p.add_argument("--row", type=int, default=256, help="padded row length; 2 * pairs * row positions")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--chunk-size", type=int, default=256)
    p.add_argument("--kernels", default=",".join(KERNELS), help="comma-separated; nll is always measured")
    p.add_argument("--no-jax", action="store_true", help="skip the JAX compile-only column")
    add_measure_args(p)
    add_output_args(p)
    return p.parse_args(argv)


def main(argv=None) -> dict:
    run = start_run(_parse, argv, __file__, device=resolve_device)
    args = run.args
    rows = [_measure(args, layout, kernel) for layout in LAYOUTS for kernel in with_baseline(args.kernels)]
    _add_ratios(rows)
    meta = {**measured_settings(args), "hardware": run.provenance["hardware_slug"],
            "shape": {"pairs": args.pairs, "row": args.row, "hidden": args.hidden, "vocab": args.vocab,
                      "chunk_size": args.chunk_size},
            "jax_memory_method": "jit(value_and_grad).lower().compile().memory_analysis().temp_size_in_bytes, "
                                 "float32, compile only",
            "acceptance": _acceptance(rows)}
    payload = {**meta, "results": rows}
    run.write(payload, title="DPO log-prob memory", body=_markdown(meta, rows),
              plot=lambda png: _plot(png, meta, rows))
    return payload


if __name__ == "__main__":
    main()
