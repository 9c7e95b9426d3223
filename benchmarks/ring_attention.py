"""Context-parallel attention: per-device memory, load balance, and step time, against dense.

Three measurements, each reported as a ratio against a baseline from the same run:

1. Per-device temporary memory of one attention forward + backward step at ``--seq-len``
   (default 16384) on ``--cp`` host devices, from
   ``jax.jit(step).lower(...).compile().memory_analysis().temp_size_in_bytes``. Baseline:
   dense single-device attention (``twinseq.jax_backend.attention``). Compile only: nothing
   of that size is allocated.
2. Attention blocks each rank computes (fully masked blocks skipped), with and without the
   zigzag load balancing (``twinseq.common.data.context_parallel.count_attention_blocks``), for one
   causal document and for a packed row.
3. Wall time of attention forward + backward, sharded (ring, all-gather) vs unsharded (dense,
   and single-device blocked) at ``--time-seq-len``. On CPU the ``cp`` host devices share the
   same cores, so this measures total work, not multi-accelerator speed.

    .venv/bin/python benchmarks/ring_attention.py            # writes benchmarks/results/ring_attention_*
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _report import add_output_args, markdown_table, pyplot, save_figure, start_run  # noqa: E402


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cp", type=int, default=8, help="context-parallel size (host devices)")
    p.add_argument("--seq-len", type=int, default=16384, help="T of the memory and block-count figures")
    p.add_argument("--time-seq-len", type=int, default=8192, help="T of the step-time figures")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3, help="timed repeats after one warm-up")
    p.add_argument("--skip-time", action="store_true", help="memory and block counts only")
    add_output_args(p)
    return p.parse_args(argv)


def _host_devices(cp: int) -> None:
    """Ask XLA for ``cp`` CPU devices; only possible before jax is first imported."""
    if "jax" in sys.modules:
        return
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={cp}".strip()


def _inputs(seq_len, args, seed=0):
    rng = np.random.default_rng(seed)
    shape = lambda h: (1, seq_len, h, args.head_dim)  # noqa: E731
    q, dout = (rng.standard_normal(shape(args.heads)).astype(np.float32) for _ in range(2))
    k, v = (rng.standard_normal(shape(args.kv_heads)).astype(np.float32) for _ in range(2))
    return q, k, v, dout


def _causal_ids(seq_len):
    return np.ones((1, seq_len), np.int32), np.arange(seq_len, dtype=np.int32)[None]


def _packed_ids(seq_len, seed=0):
    """One padding-free row of documents with ANCHORS' length law: clip(lognormal(5.5, 1), 1, T)."""
    rng = np.random.default_rng(seed)
    lengths = []
    while sum(lengths) < seq_len:
        lengths.append(int(np.clip(rng.lognormal(5.5, 1.0), 1, seq_len)))
    lengths[-1] -= sum(lengths) - seq_len
    seg = np.repeat(np.arange(1, len(lengths) + 1), lengths).astype(np.int32)
    pos = np.concatenate([np.arange(n) for n in lengths]).astype(np.int32)
    return seg[None], pos[None], len(lengths)


def _steps(args, mesh):
    """name -> (jitted step(q, k, v, dout, segment_ids, position_ids) -> (out, dq, dk, dv), zigzag inputs?)."""
    import jax
    from twinseq.jax_backend.attention import document_causal_mask, dot_product_attention
    from twinseq.jax_backend.context_parallel import blocked_attention, sharded_attention

    def to_bntd(a):
        return a.transpose(0, 2, 1, 3)

    def dense(q, k, v, seg, pos):
        mask = document_causal_mask(seg, pos)
        return to_bntd(dot_product_attention(to_bntd(q), to_bntd(k), to_bntd(v), mask, args.head_dim ** -0.5))

    fns = {
        "dense (1 device)": (dense, False),
        "blocked (1 device)": (blocked_attention, False),
        f"ring (cp={args.cp})": (lambda q, k, v, seg, pos: sharded_attention(q, k, v, seg, pos, mesh), True),
        f"all_gather (cp={args.cp})": (
            lambda q, k, v, seg, pos: sharded_attention(q, k, v, seg, pos, mesh, strategy="allgather"), True),
    }

    def fwd_bwd(f):
        def step(q, k, v, dout, seg, pos):
            out, vjp = jax.vjp(lambda q, k, v: f(q, k, v, seg, pos), q, k, v)
            return (out, *vjp(dout))
        return jax.jit(step)

    return {name: (fwd_bwd(f), zigzag) for name, (f, zigzag) in fns.items()}


def _step_inputs(seq_len, args, mesh, zigzag):
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    from twinseq.common.data.context_parallel import shard_sequence
    arrays = [*_inputs(seq_len, args), *_causal_ids(seq_len)]
    if not zigzag:
        return [jax.device_put(a, jax.devices()[0]) for a in arrays]
    sharding = NamedSharding(mesh, P(None, "cp"))
    return [jax.device_put(shard_sequence(a, args.cp, axis=1), sharding) for a in arrays]


def measure_memory(args, mesh) -> list[dict]:
    rows = []
    for name, (step, zigzag) in _steps(args, mesh).items():
        stats = step.lower(*_step_inputs(args.seq_len, args, mesh, zigzag)).compile().memory_analysis()
        rows.append({"name": name, "temp_bytes_per_device": int(stats.temp_size_in_bytes),
                     "argument_bytes_per_device": int(stats.argument_size_in_bytes)})
    base = rows[0]["temp_bytes_per_device"]
    for r in rows:
        r["ratio_vs_dense"] = r["temp_bytes_per_device"] / base
    return rows


def measure_blocks(args) -> list[dict]:
    from twinseq.common.data.context_parallel import count_attention_blocks, imbalance
    seg_p, pos_p, num_docs = _packed_ids(args.seq_len)
    workloads = {"causal, 1 document": _causal_ids(args.seq_len),
                 f"packed, {num_docs} documents": (seg_p, pos_p)}
    chunk = args.seq_len // (2 * args.cp)
    rows = []
    for workload, (seg, pos) in workloads.items():
        for block_size in (chunk, chunk // 4):
            for load_balance in (False, True):
                counts = count_attention_blocks(seg, pos, args.cp, block_size, load_balance)
                rows.append({"workload": workload, "block_size": block_size, "load_balance": load_balance,
                             "blocks_per_rank": counts.tolist(), "max": int(counts.max()),
                             "mean": float(counts.mean()), "max_over_mean": imbalance(counts)})
    return rows


def measure_time(args, mesh) -> list[dict]:
    import jax
    rows = []
    for name, (step, zigzag) in _steps(args, mesh).items():
        arrays = _step_inputs(args.time_seq_len, args, mesh, zigzag)
        jax.block_until_ready(step(*arrays))  # compile + warm-up
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            jax.block_until_ready(step(*arrays))
            times.append(time.perf_counter() - start)
        rows.append({"name": name, "seconds_median": float(np.median(times)), "seconds_all": times})
    base = rows[0]["seconds_median"]
    for r in rows:
        r["ratio_vs_dense"] = r["seconds_median"] / base
    return rows


def _markdown(result: dict) -> str:
    a = result["args"]
    lines = [f"Shapes: B=1, heads={a['heads']}, kv_heads={a['kv_heads']}, head_dim={a['head_dim']}, float32, "
             f"causal mask, cp={a['cp']} host devices ({result['jax_devices']}), zigzag order for the sharded rows.",
             "", f"## Per-device temp memory, attention fwd+bwd, T={a['seq_len']}", ""]
    lines += markdown_table(["step", "temp MiB / device", "vs dense"],
                            [[r["name"], f"{r['temp_bytes_per_device'] / 2**20:,.1f}", f"{r['ratio_vs_dense']:.4f}"]
                             for r in result["memory"]], align="lrr")
    lines += ["", f"## Attention blocks per rank (fully masked skipped), T={a['seq_len']}", ""]
    lines += markdown_table(["workload", "block", "load balance", "max", "mean", "max/mean", "per rank"],
                            [[r["workload"], r["block_size"], "zigzag" if r["load_balance"] else "contiguous", r["max"],
                              f"{r['mean']:.1f}", f"{r['max_over_mean']:.3f}", r["blocks_per_rank"]]
                             for r in result["blocks"]], align="lrlrrrl")
    lines += ["", f"## Step time, attention fwd+bwd, T={a['time_seq_len']} (median of {a['repeats']})", "",
              "The host devices share the machine's cores: this is total work, not multi-device speed.", ""]
    lines += markdown_table(["step", "seconds", "vs dense"],
                            [[r["name"], f"{r['seconds_median']:.3f}", f"{r['ratio_vs_dense']:.3f}"]
                             for r in result["time"]], align="lrr")
    lines += ["", "## Notes", "",
              "- Memory is XLA's compile-time figure for one device's program (shard_map programs are "
              "per device); the sharded rows hold T/cp of q, k, v plus one score block, dense holds "
              "[heads, T, T] scores, probabilities and their gradients.",
              "- Block counts use the kernel's rule: a (query block, key block) pair is computed iff "
              "it holds an allowed pair. With many short packed documents the work is already spread "
              "evenly, zigzag neither helps nor hurts much, and the residual imbalance comes from the "
              "coarse block grid (a few blocks per rank).",
              "- Step times are taken on a possibly shared machine (load average in the provenance): absolute "
              "seconds may be inflated, compare ratios within one run."]
    return "\n".join(lines) + "\n"


def _plot(result: dict, path: Path) -> None:
    fig, (ax_mem, ax_blk) = pyplot().subplots(1, 2, figsize=(12, 4.5))
    names = [r["name"] for r in result["memory"]]
    ax_mem.barh(names, [r["temp_bytes_per_device"] / 2**20 for r in result["memory"]])
    ax_mem.set_xscale("log")
    ax_mem.set_xlabel("temp MiB per device (log)")
    ax_mem.set_title(f"attention fwd+bwd, T={result['args']['seq_len']}")
    causal = [r for r in result["blocks"] if r["workload"].startswith("causal") and
              r["block_size"] == result["args"]["seq_len"] // (2 * result["args"]["cp"])]
    ranks = np.arange(result["args"]["cp"])
    for i, r in enumerate(causal):
        label = "zigzag" if r["load_balance"] else "contiguous"
        ax_blk.bar(ranks + (i - 0.5) * 0.4, r["blocks_per_rank"], width=0.4,
                   label=f"{label} ({r['max_over_mean']:.2f})")
    ax_blk.set_xlabel("rank")
    ax_blk.set_ylabel("blocks computed")
    ax_blk.set_title("causal, blocks per rank (max/mean)")
    ax_blk.legend()
    save_figure(fig, path, dpi=110)


def main(argv=None) -> dict:
    run = start_run(_parse, argv, __file__)
    args = run.args
    _host_devices(args.cp)
    import jax
    if jax.device_count() < args.cp:
        raise SystemExit(f"--cp={args.cp} needs {args.cp} devices, jax sees {jax.device_count()}; run this script "
                         f"in a fresh process (XLA_FLAGS is set before jax is imported).")
    jax.config.update("jax_default_matmul_precision", "highest")
    from twinseq.jax_backend.parallel import make_mesh
    mesh = make_mesh(cp=args.cp, devices=jax.devices()[:args.cp])
    result = {"args": run.arguments(),
              "jax_devices": f"{jax.device_count()} x {jax.devices()[0].platform}"}
    result["memory"] = measure_memory(args, mesh)
    result["blocks"] = measure_blocks(args)
    result["time"] = [] if args.skip_time else measure_time(args, mesh)
    run.write(result, title="Ring attention", body=_markdown(result), plot=lambda png: _plot(result, png))
    return result


if __name__ == "__main__":
    main()
