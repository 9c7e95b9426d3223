"""Each single-device memory technique on and off: peak memory and time of one training step.

Techniques: gradient checkpointing, the chunked and fused-linear losses, and (CUDA only)
activation offloading. Every configuration runs forward + loss + backward of the same model
on the same batch in a fresh subprocess (``_memory.measure_in_subprocess``); memory is the
peak RSS above the subprocess's baseline on CPU, ``torch.cuda.max_memory_allocated`` on CUDA.
Ratios are against the baseline (``nll``, nothing else) measured in the same run.

    .venv/bin/python benchmarks/memory_techniques.py                 # small preset, 2 x 2048 tokens
    .venv/bin/python benchmarks/memory_techniques.py --preset tiny --seq-len 512
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _memory import measure_in_subprocess, peak_bytes  # noqa: E402
from _report import MIB, add_output_args, markdown_table, pyplot, save_figure, start_run  # noqa: E402

TECHNIQUES = {
    "baseline (nll)": dict(loss_type="nll"),
    "gradient checkpointing": dict(loss_type="nll", gradient_checkpointing=True),
    "chunked_nll loss": dict(loss_type="chunked_nll"),
    "fused_linear loss": dict(loss_type="fused_linear"),
    "checkpointing + fused_linear": dict(loss_type="fused_linear", gradient_checkpointing=True),
}
CUDA_ONLY = {
    "activation offloading": dict(loss_type="nll", activation_offloading=True),
    "offloading + checkpointing + fused_linear": dict(loss_type="fused_linear", activation_offloading=True,
                                                      gradient_checkpointing=True),
}


def setup(preset: str, seq_len: int, batch_size: int, loss_type: str, gradient_checkpointing: bool = False,
          activation_offloading: bool = False, threads: int = 2) -> dict:
    import numpy as np
    import torch

    from twinseq.common.data.batching import collate
    from twinseq.common.config import ModelConfig
    from twinseq.common.models.init import init_weights
    from twinseq.torch_backend.model import build_model

    torch.set_num_threads(threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = ModelConfig.preset(preset)
    model = build_model(cfg, init_weights(cfg, seed=0), attn_implementation="sdpa", device=device)
    if gradient_checkpointing:
        from twinseq.torch_backend.memory import apply_activation_checkpointing

        apply_activation_checkpointing(model)
    model.train()
    rng = np.random.default_rng(0)
    docs = [{"input_ids": rng.integers(3, cfg.vocab_size, seq_len).tolist()} for _ in range(batch_size)]
    return {"model": model, "batch": collate(docs), "loss_type": loss_type, "device": device,
            "offload": activation_offloading}


def run(state: dict) -> dict:
    import contextlib

    import torch

    from twinseq.torch_backend.attention import forward_hidden
    from twinseq.torch_backend.losses import causal_lm_loss
    from twinseq.torch_backend.model import final_logit_softcap

    model, batch, device = state["model"], state["batch"], state["device"]
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    offload = contextlib.nullcontext()
    if state["offload"]:
        from twinseq.torch_backend.memory import offload_activations

        offload = offload_activations(model, loss_type=state["loss_type"])
    with offload:
        hidden = forward_hidden(model, batch, "sdpa")
        labels = torch.as_tensor(batch.labels, dtype=torch.long, device=device)
        loss = causal_lm_loss(hidden, model.lm_head.weight, labels, batch.num_items_in_batch, state["loss_type"],
                              logit_softcap=final_logit_softcap(model))
        loss.backward()
    model.zero_grad(set_to_none=True)
    out = {"loss": float(loss)}
    if device == "cuda":
        torch.cuda.synchronize()
        out["cuda_peak_bytes"] = int(torch.cuda.max_memory_allocated())
    return out


def _row(name: str, res: dict, base: dict) -> dict:
    mem, base_mem = peak_bytes(res, "cuda_peak_bytes"), peak_bytes(base, "cuda_peak_bytes")
    return {"technique": name, "peak_mib": mem / MIB, "memory_ratio": mem / base_mem,
            "seconds": res["median_seconds"], "time_ratio": res["median_seconds"] / base["median_seconds"],
            "loss": res["records"][0]["extra"]["loss"]}


def _markdown(rows: list[dict], args: argparse.Namespace, cuda: bool) -> str:
    lines = [f"Model `{args.preset}`, batch {args.batch_size} x {args.seq_len} tokens (one document per row, "
             f"sdpa), forward + loss + backward, fp32. Memory: "
             + ("`torch.cuda.max_memory_allocated`." if cuda else "peak RSS of a fresh subprocess above its "
                "baseline (model, weights and batch already allocated).")
             + f" Time: median of {args.repeats} repeat(s) after 1 warmup. Offloading needs CUDA and is "
               "skipped on CPU.", ""]
    lines += markdown_table(["technique", "peak MiB", "vs baseline", "seconds", "vs baseline", "loss"],
                            [[r["technique"], f"{r['peak_mib']:,.0f}", f"{r['memory_ratio']:.3f}",
                              f"{r['seconds']:.2f}", f"{r['time_ratio']:.2f}", f"{r['loss']:.6f}"] for r in rows],
                            align="lrrrrr")
    return "\n".join(lines) + "\n"


def _plot(rows: list[dict], path: Path) -> None:
    fig, ax = pyplot().subplots(figsize=(8, 3.5))
    ax.barh([r["technique"] for r in rows][::-1], [r["peak_mib"] for r in rows][::-1])
    ax.set_xlabel("peak memory above baseline (MiB)")
    save_figure(fig, path, dpi=110)


def _parse(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    add_output_args(parser)
    return parser.parse_args(argv)


def _device(args: argparse.Namespace) -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def main(argv=None) -> dict:
    run = start_run(_parse, argv, __file__, device=_device)
    args, cuda = run.args, run.provenance["device"] == "cuda"
    techniques = {**TECHNIQUES, **(CUDA_ONLY if cuda else {})}
    results = {}
    for name, kw in techniques.items():
        print(f"[{name}] ...", flush=True)
        results[name] = measure_in_subprocess(
            __file__, "setup", "run", dict(preset=args.preset, seq_len=args.seq_len, batch_size=args.batch_size, **kw),
            repeats=args.repeats, warmup=1)
    base = results["baseline (nll)"]
    rows = [_row(name, res, base) for name, res in results.items()]
    for r in rows:
        print(f"{r['technique']:42s} {r['peak_mib']:9,.0f} MiB ({r['memory_ratio']:.3f}x)  "
              f"{r['seconds']:6.2f} s ({r['time_ratio']:.2f}x)")
    payload = {"rows": rows, "args": run.arguments()}
    run.write(payload, title="Memory techniques, one training step", body=_markdown(rows, args, cuda),
              plot=lambda png: _plot(rows, png))
    return payload


if __name__ == "__main__":
    main()
