"""One MoE layer's forward + backward on one GPU: twinseq's grouped kernel against transformers' ``grouped_mm`` and
per-expert loop and a dense MLP of the same active parameters, on torch, and jax's ragged_dot block; bfloat16.

The layer is Qwen3-30B-A3B's at full size by default (hidden 2048, 128 experts of 768, top-8), 16,384 tokens (four
4,096-token rows). Variants (``benchmarks/moe_grouped.py`` builds the same modules on CPU):

- ``grouped``: transformers' ``Qwen3MoeSparseMoeBlock`` with ``_experts_implementation = "twinseq_grouped"``
  (``torch_backend.moe``: copies sorted by expert, one ``grouped_mm`` per projection per chunk of whole experts, the
  gate/up pre-activations the only per-copy tensor saved);
- ``hf_grouped_mm``: the same block with transformers' ``grouped_mm`` (what ``build_model`` keeps on CUDA);
- ``eager``: transformers' per-expert loop (the reference every other variant is checked against);
- ``dense``: a gated MLP of intermediate ``top_k x 768`` (the active parameters of one token);
- ``jax moe block`` / ``jax dense``: ``jax_backend.model.SparseMoeBlock`` and ``MLP`` with the same weights (one
  ``jax.lax.ragged_dot`` per projection under autodiff, what jax runs on a GPU).

Memory: torch, ``torch.cuda.max_memory_allocated`` over one forward + backward minus the bytes allocated before it
(weights, input); jax, the compiled step's temporaries + outputs (``memory_analysis``). Each with the weights trained
(their gradients allocated) and frozen (the activations alone, which is what the kernel decides). Time: the median of
``--repeats`` steps after ``--warmup``, CUDA events (torch) or ``block_until_ready`` (jax). Check: each variant's
output and input gradient against the eager loop's, relative norm (bfloat16 rows: 10 ulps = 3.9e-2).

    python benchmarks/gpu/moe_gpu.py --out DIR               # Qwen3-30B-A3B's layer, 16,384 tokens
    python benchmarks/gpu/moe_gpu.py --smoke --no-write      # tiny, CPU or GPU
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from _report import MIB, acceptance_line, add_output_args, markdown_table, start_run  # noqa: E402
from moe_grouped import EXPERTS_IMPLEMENTATIONS, _torch_block  # noqa: E402

TORCH_VARIANTS = ("grouped", "hf_grouped_mm", "eager", "dense")
REFERENCE = "eager"
CHECK_REL = 10 * 2.0**-8
"""The bfloat16 ``grad_rel`` row of parity_tests/tolerances.py: 10 ulps."""
SMOKE = dict(hidden=64, experts=8, expert_intermediate=32, top_k=2, tokens=256, repeats=2, warmup=1)


def _version(name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return "not installed"


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


_MODULES: dict[str, Any] = {}


def _module(args: argparse.Namespace, kind: str):
    """The MoE block (one, shared by the three experts implementations: each run sets its own) or the dense MLP, on
    the device in ``--dtype``, built once (drawing 600M weights on the CPU takes seconds)."""
    import torch

    key = "dense" if kind == "dense" else "moe"
    if key not in _MODULES:
        module = _torch_block(kind, args.hidden, args.experts, args.top_k, args.expert_intermediate, seed=0)
        _MODULES[key] = module.to(device=args.device, dtype=getattr(torch, args.dtype))
    module = _MODULES[key]
    if kind != "dense":
        module.experts.config._experts_implementation = EXPERTS_IMPLEMENTATIONS[kind]
    return module


def measure_torch(args: argparse.Namespace, kind: str, train_weights: bool) -> dict[str, Any]:
    """Peak memory above the set-up bytes, median seconds, and the output / input gradient of one variant."""
    import torch

    dtype = getattr(torch, args.dtype)
    row: dict[str, Any] = {"backend": "torch", "variant": kind, "train_weights": train_weights}
    try:
        module = _module(args, kind).requires_grad_(train_weights)
        x = torch.randn(1, args.tokens, args.hidden, generator=torch.Generator().manual_seed(1))
        x = x.to(device=args.device, dtype=dtype).requires_grad_(True)

        def step():
            out = module(x)
            y = out[0] if isinstance(out, tuple) else out
            y.float().square().sum().backward()
            return y.detach()

        for _ in range(args.warmup):
            step()
            x.grad = None
            module.zero_grad(set_to_none=True)
        _sync(args.device)
        seconds, peak = [], None
        for _ in range(args.repeats):
            if args.device == "cuda":
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                y = step()
                end.record()
                torch.cuda.synchronize()
                seconds.append(start.elapsed_time(end) / 1e3)
                peak = max(peak or 0, torch.cuda.max_memory_allocated() - base)
            else:
                t0 = time.perf_counter()
                y = step()
                seconds.append(time.perf_counter() - t0)
            grad = x.grad.detach().clone()
            x.grad = None
            module.zero_grad(set_to_none=True)
        row.update(status="ok", peak_bytes=peak, median_seconds=statistics.median(seconds), seconds=seconds)
        row["_y"], row["_dx"] = y.float().cpu(), grad.float().cpu()
    except Exception as err:  # noqa: BLE001 - a variant that cannot run here is reported with its reason
        row.update(status="failed", error=f"{type(err).__name__}: {str(err).strip().splitlines()[0][:300]}")
    finally:
        module = x = None  # noqa: F841
        if args.device == "cuda":
            torch.cuda.empty_cache()
    return row


def measure_jax(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Compiled memory and median time of jax's MoE block (ragged_dot on a GPU) and dense MLP, same weights."""
    import dataclasses

    import jax
    import jax.numpy as jnp
    import torch
    from flax import nnx

    from twinseq.common.models.configs import resolve_model_config
    from twinseq.jax_backend.model import MLP, SparseMoeBlock

    cfg = dataclasses.replace(resolve_model_config("tiny-qwen3-moe"), hidden_size=args.hidden,
                              num_experts=args.experts, num_experts_per_tok=args.top_k,
                              moe_intermediate_size=args.expert_intermediate,
                              intermediate_size=args.top_k * args.expert_intermediate)
    rows = []
    x_np = torch.randn(1, args.tokens, args.hidden, generator=torch.Generator().manual_seed(1)).numpy()
    x = jnp.asarray(x_np, dtype=args.dtype)
    for kind in ("grouped", "dense"):
        w = {"mlp." + n: t.detach().float().cpu().numpy() for n, t in _module(args, kind).state_dict().items()}
        module = (MLP if kind == "dense" else SparseMoeBlock)(cfg, w, "mlp.", args.dtype)
        graphdef, params = nnx.split(module)

        def loss(params_, x_, graphdef_=graphdef):
            out = nnx.merge(graphdef_, params_)(x_)
            out = out[0] if isinstance(out, tuple) else out
            return jnp.sum(jnp.square(out.astype(jnp.float32)))

        for train_weights in (True, False):
            name = "jax moe block" if kind == "grouped" else "jax dense"
            row: dict[str, Any] = {"backend": "jax", "variant": name, "train_weights": train_weights}
            try:
                fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1) if train_weights else 1))
                mem = fn.lower(params, x).compile().memory_analysis()
                for _ in range(args.warmup):
                    jax.block_until_ready(fn(params, x))
                seconds = []
                for _ in range(args.repeats):
                    t0 = time.perf_counter()
                    jax.block_until_ready(fn(params, x))
                    seconds.append(time.perf_counter() - t0)
                row.update(status="ok", peak_bytes=int(mem.temp_size_in_bytes + mem.output_size_in_bytes),
                           median_seconds=statistics.median(seconds), seconds=seconds,
                           jax_device=str(jax.devices()[0]))
            except Exception as err:  # noqa: BLE001
                row.update(status="failed", error=f"{type(err).__name__}: {str(err).strip().splitlines()[0][:300]}")
            rows.append(row)
            print(f"{name:>16} weights={train_weights!s:>5}: {row.get('peak_bytes', 0) / MIB:9.1f} MiB  "
                  f"{row.get('median_seconds', float('nan')) * 1e3:8.2f} ms {row.get('error', '')}", flush=True)
    return rows


def _rel(a, b) -> float:
    return float((a - b).norm() / b.norm())


def add_checks(rows: list[dict[str, Any]]) -> None:
    """Each torch variant's output and input gradient against the eager loop's (same weights trained or not)."""
    for train_weights in (True, False):
        ref = next((r for r in rows if r["variant"] == REFERENCE and r["train_weights"] == train_weights
                    and r["status"] == "ok"), None)
        for r in rows:
            if r["backend"] == "torch" and r["train_weights"] == train_weights and r["status"] == "ok":
                if ref is not None and r["variant"] != "dense":
                    r["check"] = {"y_rel": _rel(r["_y"], ref["_y"]), "dx_rel": _rel(r["_dx"], ref["_dx"])}
                    r["check"]["agrees"] = max(r["check"]["y_rel"], r["check"]["dx_rel"]) <= CHECK_REL
    for r in rows:
        r.pop("_y", None)
        r.pop("_dx", None)


def acceptance(rows: list[dict[str, Any]]) -> dict[str, bool]:
    ok = {(r["variant"], r["train_weights"]): r for r in rows if r["status"] == "ok"}
    out = {}
    g, d, e = ok.get(("grouped", False)), ok.get(("dense", False)), ok.get(("eager", True))
    if g and d and g.get("peak_bytes") and d.get("peak_bytes"):
        out["grouped activations <= 1.2x dense"] = g["peak_bytes"] <= 1.2 * d["peak_bytes"]
    gt = ok.get(("grouped", True))
    if gt and e:
        out["grouped >= 3x faster than the eager loop"] = e["median_seconds"] >= 3 * gt["median_seconds"]
    return out


def markdown(meta: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    table = []
    for train_weights in (True, False):
        dense = next((r for r in rows if r["variant"] == "dense" and r["train_weights"] == train_weights
                      and r["status"] == "ok"), None)
        eager = next((r for r in rows if r["variant"] == "eager" and r["train_weights"] == train_weights
                      and r["status"] == "ok"), None)
        for r in (r for r in rows if r["train_weights"] == train_weights):
            weights = "trained" if train_weights else "frozen"
            if r["status"] != "ok":
                table.append([r["backend"], r["variant"], weights, "failed", "", "", "", "", r["error"]])
                continue
            peak = r.get("peak_bytes")
            jd = next((x for x in rows if x["variant"] == "jax dense" and x["train_weights"] == train_weights
                       and x["status"] == "ok"), None)
            base = jd if r["backend"] == "jax" else dense
            vs_dense = f"{peak / base['peak_bytes']:.2f}x" if peak and base and base.get("peak_bytes") else ""
            speed = f"{eager['median_seconds'] / r['median_seconds']:.1f}x" if eager else ""
            check = r.get("check")
            check_s = f"y {check['y_rel']:.1e}, dx {check['dx_rel']:.1e}" if check else ""
            table.append([r["backend"], r["variant"], weights, f"{peak / MIB:,.0f}" if peak else "n/a", vs_dense,
                          f"{r['median_seconds'] * 1e3:.2f}", speed, check_s, ""])
    lines = [
        f"One MoE layer, hidden {meta['hidden']}, {meta['experts']} experts of {meta['expert_intermediate']}, "
        f"top-{meta['top_k']}, {meta['tokens']:,} tokens, {meta['dtype']}, device `{meta['device']}`; forward + "
        f"backward of `sum(y**2)`. Memory: {meta['memory_method']}. Time: median of {meta['repeats']} steps. "
        f"Speed-up: the eager loop's time over the row's (torch, same weights setting).",
        "",
        *markdown_table(["backend", "variant", "weights", "peak MiB", "vs dense", "ms", "vs eager", "vs eager (rel)",
                         "note"], table, "lllrrrrll"),
        "",
        acceptance_line(meta["acceptance"]),
    ]
    return "\n".join(lines) + "\n"


def _parse(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--expert-intermediate", type=int, default=768)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--variants", default=",".join(TORCH_VARIANTS))
    p.add_argument("--no-jax", action="store_true", help="skip the jax rows")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--smoke", action="store_true", help=f"a tiny run that works anywhere ({SMOKE})")
    add_output_args(p)
    return p.parse_args(argv)


def _resolve(args: argparse.Namespace) -> str:
    import torch

    unknown = [v for v in args.variants.split(",") if v and v not in TORCH_VARIANTS]
    if unknown:
        raise SystemExit(f"--variants: unknown {unknown}; choose from {TORCH_VARIANTS}")
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.smoke:
        for key, value in SMOKE.items():
            setattr(args, key, value)
        if args.device == "cpu":
            args.dtype = "float32"  # CPU grouped_mm: float32 is the dtype twinseq trains in there
    return args.device


def main(argv: Optional[Sequence[str]] = None) -> dict:
    run = start_run(_parse, argv, __file__, device=_resolve)
    args = run.args
    rows: list[dict[str, Any]] = []
    for train_weights in (True, False):
        for kind in (v for v in args.variants.split(",") if v):
            row = measure_torch(args, kind, train_weights)
            rows.append(row)
            print(f"{kind:>16} weights={train_weights!s:>5}: {(row.get('peak_bytes') or 0) / MIB:9.1f} MiB  "
                  f"{row.get('median_seconds', float('nan')) * 1e3:8.2f} ms {row.get('error', '')}", flush=True)
    add_checks(rows)
    if not args.no_jax:
        rows += measure_jax(args)
    meta = {k: getattr(args, k) for k in ("hidden", "experts", "expert_intermediate", "top_k", "tokens", "dtype",
                                          "repeats", "device")}
    meta.update(acceptance=acceptance(rows), experts_implementations=EXPERTS_IMPLEMENTATIONS,
                memory_method=("torch: torch.cuda.max_memory_allocated over a step minus the bytes allocated before "
                               "it; jax: compiled temporaries + outputs" if args.device == "cuda"
                               else "torch: not measured on CPU (benchmarks/moe_grouped.py measures RSS); jax: "
                               "compiled temporaries + outputs"),
                packages={p: _version(p) for p in ("torch", "transformers", "jax", "jaxlib")})
    payload = {**meta, "arguments": run.arguments(), "results": rows}
    run.write(payload, title="One MoE layer on one GPU: twinseq's grouped kernel, transformers' grouped_mm and eager "
              "loop, a dense MLP, jax's ragged_dot", body=markdown(meta, rows))
    return payload


if __name__ == "__main__":
    main()
