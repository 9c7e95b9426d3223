"""MoE grouped matmul on CPU: one mixture-of-experts block's forward + backward, twinseq's grouped kernel vs
transformers' grouped_mm and per-expert loop vs a dense MLP with the same active parameters, on torch and jax.

What twinseq runs for a MoE layer:

- torch: transformers 5's ``Qwen3MoeSparseMoeBlock``/``MixtralSparseMoeBlock`` as ``build_model`` makes them, with
  the experts' forward switched (on CPU) to ``twinseq_grouped`` (``torch_backend.moe``): token copies sorted by
  expert, one ``grouped_mm`` per projection, walked in chunks of whole experts of about ``tokens / 2`` rows, an autograd
  function that saves only the gate/up pre-activations and recomputes the rest in backward.
- jax: ``jax_backend.model.SparseMoeBlock`` with the torch block's weights and input. On CPU it runs
  ``jax_backend.moe.grouped_experts``: the copies sorted by expert and walked in blocks of one expert's rows, each
  block gathering its inputs and adding its weighted outputs in place, a custom VJP that saves the gate/up
  pre-activations only (torch's kernel, in jax). ``grouped_per_projection`` is the same block through one
  ``jax_backend.grouped.grouped_matmul`` per projection under autodiff (what runs with expert LoRA, and with
  ``jax.lax.ragged_dot`` on TPU).

Variants (one block, ``hidden`` wide, ``experts`` experts of ``expert_intermediate`` each, top ``top_k``, ``tokens``
tokens in one row, float32, router softmax in float32, top-k weights renormalised):

- ``grouped``: the block with ``_experts_implementation = "twinseq_grouped"`` (twinseq's torch path);
- ``hf_grouped_mm``: the same block, ``"grouped_mm"``: transformers' grouped implementation (its default, what
  twinseq ran before), autograd through every intermediate;
- ``eager``: the same block, ``"eager"``: transformers' per-expert Python loop;
- ``dense``: a gated MLP with ``intermediate = top_k * expert_intermediate`` (the active parameters of one token,
  without the router's ``hidden x experts``), weights drawn with the same seed and scale.

``batched_mm`` (transformers' third implementation) gathers one expert weight per token copy
(``tokens x top_k x 2 m x h`` floats) and is left out.

The default shape is Qwen3-30B-A3B's MoE layer (hidden 2048, 128 experts of 768, top-8: many small experts, the
MoE of 2026) at half its width and half its experts: hidden 1024, 64 experts of 384, top-8, 512 tokens. It keeps
Qwen3's top-8 and its expert width of 0.375 x hidden; ``experts / top_k`` is 8 (Qwen3 16, Mixtral 8x7B's 8 experts
top-2: 4). The full layer does not fit the time of a 2-core run: transformers' eager loop indexes
``gate_up_proj[e]`` per expert, and each index's backward adds a zero-filled ``[E, 2m, h]`` gradient (1.6 GB at
Qwen3's size), ``E`` times per projection, minutes per step. The earlier default (hidden 1024, 16 experts x 512,
top-2, 2048 tokens) stays reachable by flags.

Each torch variant runs in a fresh subprocess (``benchmarks/_memory.py``): memory is the peak RSS above the RSS after
the block and the input are built, over one forward + backward (the input and every weight require grad, the loss is
``sum(y ** 2)``; the gradients are dropped after each repeat, so every repeat allocates them anew); time is the
median of ``--time-rounds`` rounds in one more subprocess that runs the variants back to back each round
(the machine is shared: separate processes met different loads, up to 5x apart between runs), each process's own
median kept as ``median_seconds_separate_process``. Two memory ratios are reported: with the weight gradients
(``requires_grad`` weights: the MoE's are ``experts / top_k`` times the dense MLP's, so this ratio grows with the
experts whatever the kernel) and for the activations alone (frozen weights, the input's gradient only), which is
what the grouped kernel decides. jax: ``jax.jit(value_and_grad).lower(...).compile().memory_analysis()`` (temporaries
+ outputs, i.e. the gradients), weights trained and frozen as torch's, and the median wall time of the compiled step
(XLA's default threads); its speed-up is read against the torch eager loop's interleaved median.

    .venv/bin/python benchmarks/moe_grouped.py                     # h 1024, 64 experts x 384, top-8, 512 tokens
    .venv/bin/python benchmarks/moe_grouped.py --tokens 256 --experts 8 --top-k 2 --no-write   # quick

Acceptance (the 2026-families issue): grouped peak <= 1.2 x dense (same active parameters), and grouped >= 3 x
faster than the per-expert loop, both measured in the same run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _memory import measure_in_subprocess  # noqa: E402
from _report import MIB, acceptance_line, add_output_args, markdown_table, start_run  # noqa: E402

TORCH_VARIANTS = ("grouped", "hf_grouped_mm", "eager", "dense")
FROZEN_VARIANTS = ("grouped", "hf_grouped_mm", "dense")
EXPERTS_IMPLEMENTATIONS = {"grouped": "twinseq_grouped", "hf_grouped_mm": "grouped_mm", "eager": "eager"}
MEMORY_RATIO_MAX = 1.2
SPEEDUP_MIN = 3.0


def _torch_block(kind: str, hidden: int, experts: int, top_k: int, expert_intermediate: int, seed: int):
    """The torch module of ``kind`` (``TORCH_VARIANTS``), its weights drawn N(0, 0.02) from ``seed``."""
    import torch
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeMLP, Qwen3MoeSparseMoeBlock

    from twinseq.torch_backend.moe import register_experts

    config = Qwen3MoeConfig(
        hidden_size=hidden,
        num_experts=experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=expert_intermediate,
        norm_topk_prob=True,
    )
    if kind == "dense":
        module = Qwen3MoeMLP(config, intermediate_size=top_k * expert_intermediate)
    else:
        register_experts()
        config._experts_implementation = EXPERTS_IMPLEMENTATIONS[kind]
        module = Qwen3MoeSparseMoeBlock(config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.02)
    return module


def setup(
    kind: str,
    hidden: int,
    experts: int,
    top_k: int,
    expert_intermediate: int,
    tokens: int,
    train_weights: bool,
    threads: int,
    seed: int = 0,
) -> dict[str, Any]:
    """The block and its input ``x_BTH`` (one row of ``tokens``), built before the measured baseline."""
    import torch

    torch.set_num_threads(threads)
    module = _torch_block(kind, hidden, experts, top_k, expert_intermediate, seed)
    module.requires_grad_(train_weights)
    x_BTH = torch.randn(1, tokens, hidden, generator=torch.Generator().manual_seed(seed + 1))
    return {"module": module, "x_BTH": x_BTH.requires_grad_(True)}


def run(state: dict[str, Any]) -> dict[str, Any]:
    """One forward + backward of ``sum(y ** 2)``; the gradients are dropped afterwards."""
    module, x_BTH = state["module"], state["x_BTH"]
    out = module(x_BTH)
    y_BTH = out[0] if isinstance(out, tuple) else out
    loss = y_BTH.square().sum()
    loss.backward()
    grad_norm = float(x_BTH.grad.norm())
    x_BTH.grad = None
    for p in module.parameters():
        p.grad = None
    return {"loss": float(loss.detach()), "input_grad_norm": grad_norm}


def setup_all(threads: int, **shape: Any) -> dict[str, Any]:
    """Every torch variant with frozen-or-not weights as ``shape`` says, for ``run_all``'s interleaved timing."""
    return {kind: setup(kind, threads=threads, **shape) for kind in TORCH_VARIANTS}


def run_all(states: dict[str, Any]) -> dict[str, Any]:
    """One forward + backward of each variant, back to back, so that a busy machine slows them alike."""
    seconds = {}
    for kind, state in states.items():
        t0 = time.perf_counter()
        run(state)
        seconds[kind] = time.perf_counter() - t0
    return seconds


def time_interleaved(args: argparse.Namespace) -> dict[str, list[float]]:
    """Seconds of each torch variant (weights trained) over ``--time-rounds`` rounds of ``run_all`` in one process."""
    shape = dict(
        hidden=args.hidden,
        experts=args.experts,
        top_k=args.top_k,
        expert_intermediate=args.expert_intermediate,
        tokens=args.tokens,
        train_weights=True,
    )
    res = measure_in_subprocess(
        __file__,
        "setup_all",
        "run_all",
        dict(threads=args.threads, **shape),
        repeats=args.time_rounds,
        warmup=1,
        num_threads=args.threads,
        timeout=args.timeout,
    )
    return {kind: [r["extra"][kind] for r in res["records"]] for kind in TORCH_VARIANTS}


def measure_torch(args: argparse.Namespace, kind: str, train_weights: bool) -> dict[str, Any]:
    kwargs = dict(
        kind=kind,
        hidden=args.hidden,
        experts=args.experts,
        top_k=args.top_k,
        expert_intermediate=args.expert_intermediate,
        tokens=args.tokens,
        train_weights=train_weights,
        threads=args.threads,
    )
    res = measure_in_subprocess(
        __file__,
        "setup",
        "run",
        kwargs,
        repeats=args.repeats,
        warmup=args.warmup,
        num_threads=args.threads,
        timeout=args.timeout,
    )
    extra = res["records"][-1]["extra"]
    return {
        "backend": "torch",
        "variant": kind,
        "train_weights": train_weights,
        "peak_bytes": res["peak_above_baseline_bytes"],
        "median_seconds": res["median_seconds"],
        "seconds": res["seconds"],
        "loss": extra["loss"],
        "input_grad_norm": extra["input_grad_norm"],
    }


def _jax_modules(args: argparse.Namespace):
    """(``SparseMoeBlock``, dense ``MLP``) of jax_backend with the torch blocks' weights (same seed, same numbers)."""
    import dataclasses

    from twinseq.common.models.configs import resolve_model_config
    from twinseq.jax_backend.model import MLP, SparseMoeBlock

    h, e, m, k = args.hidden, args.experts, args.expert_intermediate, args.top_k
    cfg = dataclasses.replace(
        resolve_model_config("tiny-qwen3-moe"),
        hidden_size=h,
        num_experts=e,
        num_experts_per_tok=k,
        moe_intermediate_size=m,
        intermediate_size=k * m,
    )
    w = {}
    for kind in ("grouped", "dense"):
        module = _torch_block(kind, h, e, k, m, seed=0)
        w.update({"mlp." + n: t.detach().numpy().copy() for n, t in module.state_dict().items()})
    return SparseMoeBlock(cfg, w, "mlp.", "float32"), MLP(cfg, w, "mlp.", "float32")


JAX_VARIANTS = ("grouped", "grouped_per_projection", "dense")


def measure_jax(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Compiled memory (temporaries + outputs, i.e. the gradients) and median time of each jax variant's forward +
    backward: ``grouped`` (``jax_backend.moe.grouped_experts``, what twinseq runs on CPU), ``grouped_per_projection``
    (the same block through one ``grouped_matmul`` per projection under autodiff, what runs with expert LoRA and on
    accelerators) and ``dense``; weights trained (gradients of the weights and the input) or frozen (the input's)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    x_BTH = jnp.asarray(
        setup(
            "dense", args.hidden, args.experts, args.top_k, args.expert_intermediate, args.tokens, False, args.threads
        )["x_BTH"]
        .detach()
        .numpy()
    )  # torch's input: the losses compare
    moe_block, dense = _jax_modules(args)
    rows = []
    for kind in JAX_VARIANTS:
        module = dense if kind == "dense" else moe_block
        if kind != "dense":
            module.grouped_experts_kernel = kind == "grouped"
        graphdef, params = nnx.split(module)

        def loss(params_, x_, graphdef_=graphdef):
            return jnp.sum(jnp.square(nnx.merge(graphdef_, params_)(x_)))

        for train_weights in (True, False):
            step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1) if train_weights else 1))
            mem = step.lower(params, x_BTH).compile().memory_analysis()
            jax.block_until_ready(step(params, x_BTH))
            seconds = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                value, _ = jax.block_until_ready(step(params, x_BTH))
                seconds.append(time.perf_counter() - t0)
            rows.append(
                {
                    "backend": "jax",
                    "variant": kind,
                    "train_weights": train_weights,
                    "peak_bytes": int(mem.temp_size_in_bytes + mem.output_size_in_bytes),
                    "temp_bytes": int(mem.temp_size_in_bytes),
                    "output_bytes": int(mem.output_size_in_bytes),
                    "median_seconds": statistics.median(seconds),
                    "seconds": seconds,
                    "loss": float(value),
                }
            )
            r = rows[-1]
            print(
                f"jax {kind:>22} weights={train_weights!s:>5}: compiled {r['peak_bytes'] / MIB:8.1f} MiB  "
                f"{r['median_seconds']:.3f} s",
                flush=True,
            )
    return rows


def _find(rows: list[dict], backend: str, variant: str, train_weights: bool = True) -> dict[str, Any]:
    return next(
        r for r in rows if (r["backend"], r["variant"], r["train_weights"]) == (backend, variant, train_weights)
    )


def summarise(rows: list[dict]) -> dict[str, float]:
    """The ratios the acceptance reads, each against the baseline measured in the same run."""
    grouped, hf, eager, dense = (_find(rows, "torch", v) for v in TORCH_VARIANTS)
    out = {
        "torch_speedup_vs_eager": eager["median_seconds"] / grouped["median_seconds"],
        "torch_memory_vs_dense": grouped["peak_bytes"] / dense["peak_bytes"],
        "torch_memory_vs_eager": grouped["peak_bytes"] / eager["peak_bytes"],
        "torch_time_vs_dense": grouped["median_seconds"] / dense["median_seconds"],
        "torch_max_abs_loss_diff_grouped_eager": abs(grouped["loss"] - eager["loss"]),
        "torch_speedup_vs_hf_grouped_mm": hf["median_seconds"] / grouped["median_seconds"],
        "torch_hf_grouped_mm_speedup_vs_eager": eager["median_seconds"] / hf["median_seconds"],
        "torch_hf_grouped_mm_memory_vs_dense": hf["peak_bytes"] / dense["peak_bytes"],
    }
    frozen = [r for r in rows if r["backend"] == "torch" and not r["train_weights"]]
    if frozen:
        frozen_dense = _find(rows, "torch", "dense", False)["peak_bytes"]
        out["torch_activation_memory_vs_dense"] = _find(rows, "torch", "grouped", False)["peak_bytes"] / frozen_dense
        out["torch_hf_grouped_mm_activation_memory_vs_dense"] = (
            _find(rows, "torch", "hf_grouped_mm", False)["peak_bytes"] / frozen_dense
        )
    if any(r["backend"] == "jax" for r in rows):
        jg, jp, jd = (_find(rows, "jax", v) for v in JAX_VARIANTS)
        frozen_jg, frozen_jp, frozen_jd = (_find(rows, "jax", v, False) for v in JAX_VARIANTS)
        out["jax_speedup_vs_eager"] = eager["median_seconds"] / jg["median_seconds"]
        out["jax_activation_memory_vs_dense"] = frozen_jg["peak_bytes"] / frozen_jd["peak_bytes"]
        out["jax_memory_vs_dense"] = jg["peak_bytes"] / jd["peak_bytes"]
        out["jax_temp_memory_vs_dense"] = jg["temp_bytes"] / jd["temp_bytes"]
        out["jax_time_vs_dense"] = jg["median_seconds"] / jd["median_seconds"]
        out["jax_per_projection_activation_memory_vs_dense"] = frozen_jp["peak_bytes"] / frozen_jd["peak_bytes"]
        out["jax_speedup_vs_per_projection"] = jp["median_seconds"] / jg["median_seconds"]
        out["jax_max_abs_loss_diff_vs_torch_eager"] = abs(jg["loss"] - eager["loss"])
    return out


def body(args: argparse.Namespace, rows: list[dict], ratios: dict[str, float]) -> str:
    from twinseq.torch_backend.moe import CHUNK_DIVISOR

    table = markdown_table(
        ["backend", "variant", "weights train", "peak above baseline (MiB)", "median s", "loss"],
        [
            [
                r["backend"],
                r["variant"],
                r["train_weights"],
                f"{r['peak_bytes'] / MIB:,.1f}",
                f"{r['median_seconds']:.3f}",
                f"{r['loss']:.6g}",
            ]
            for r in rows
        ],
        "lllrrr",
    )
    checks = {
        "torch grouped >= 3x faster than eager loop": ratios["torch_speedup_vs_eager"] >= SPEEDUP_MIN,
        "torch grouped peak <= 1.2x dense (weights trained)": ratios["torch_memory_vs_dense"] <= MEMORY_RATIO_MAX,
    }
    if "torch_activation_memory_vs_dense" in ratios:
        checks["torch grouped activations <= 1.2x dense"] = (
            ratios["torch_activation_memory_vs_dense"] <= MEMORY_RATIO_MAX
        )
    if "jax_memory_vs_dense" in ratios:
        checks["jax grouped >= 3x faster than the torch eager loop (same weights)"] = (
            ratios["jax_speedup_vs_eager"] >= SPEEDUP_MIN
        )
        checks["jax grouped peak <= 1.2x dense (weights trained)"] = ratios["jax_memory_vs_dense"] <= MEMORY_RATIO_MAX
        checks["jax grouped activations <= 1.2x dense"] = ratios["jax_activation_memory_vs_dense"] <= MEMORY_RATIO_MAX
    shape = (
        f"hidden {args.hidden}, {args.experts} experts x {args.expert_intermediate}, top-{args.top_k}, "
        f"{args.tokens} tokens, float32; dense MLP intermediate {args.top_k * args.expert_intermediate}"
    )
    h, m, k, e = args.hidden, args.expert_intermediate, args.top_k, args.experts
    why = (
        f"Saved for backward per token (counted, float32 numbers): dense MLP {4 * k * m} (gate, up, act, product); "
        f"transformers' grouped_mm block {k * (4 * m + 2 * h) + 2 * e} (per copy the gathered input and the unweighted "
        f"down output on top of the same four, plus the router's logits and softmax): "
        f"{(k * (4 * m + 2 * h) + 2 * e) / (4 * k * m):.2f}x; twinseq's grouped kernel {k * (2 * m + 7) + 2 * e} "
        f"(per copy the gate/up pre-activations, its token, expert and sort position as int64 and its weight, plus "
        f"the router's): {(k * (2 * m + 7) + 2 * e) / (4 * k * m):.2f}x, and its temporaries are one chunk of about "
        f"{-(-args.tokens // CHUNK_DIVISOR)} copies; jax's kernel saves the same gate/up pre-activations, with an "
        f"int32 token and the weight per copy, and its temporaries are one block of at most 32 copies (the "
        f"per-projection path keeps the gathered input, gate/up, the gated product and the output per copy). "
        f"Weight gradients: the experts' are {e // k}x the dense MLP's "
        f"({e} experts, top-{k}), whatever the kernel."
    )
    lines = [f"Shape: {shape}.", "", *table, "", why, "", "Ratios (same run):", ""]
    lines += [f"- {k}: {v:.3f}" for k, v in ratios.items()]
    return "\n".join(lines + ["", acceptance_line(checks)])


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--expert-intermediate", type=int, default=384)
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--time-rounds", type=int, default=3, help="rounds of the interleaved torch timing")
    p.add_argument("--no-jax", action="store_true", help="torch rows only")
    add_output_args(p)
    return p.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    bench = start_run(parse_args, argv, __file__, device="cpu")
    args = bench.args
    rows = []
    for train_weights in (True, False):
        for kind in TORCH_VARIANTS if train_weights else FROZEN_VARIANTS:
            rows.append(measure_torch(args, kind, train_weights))
            r = rows[-1]
            print(
                f"torch {kind:>8} weights={train_weights!s:>5}: peak {r['peak_bytes'] / MIB:8.1f} MiB  "
                f"{r['median_seconds']:.3f} s",
                flush=True,
            )
    interleaved = time_interleaved(args)
    for r in rows:
        if r["train_weights"]:  # the time ratios read the interleaved medians (same moments, same load)
            r["seconds_separate_process"], r["median_seconds_separate_process"] = r["seconds"], r["median_seconds"]
            r["seconds"], r["median_seconds"] = interleaved[r["variant"]], statistics.median(interleaved[r["variant"]])
    if not args.no_jax:
        rows += measure_jax(args)
    ratios = summarise(rows)
    bench.write(
        {"arguments": bench.arguments(), "rows": rows, "ratios": ratios},
        title="MoE grouped matmul vs per-expert loop vs dense MLP (CPU)",
        body=body(args, rows, ratios),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
