"""Torch vs JAX: training-step time and peak memory, same model, same batch, float32.

Each backend runs its own trainer's optimizer step on one identical batch (packed rows of the
embedded SFT data, ``--batch-size`` x ``--max-length``) from the same ``init_weights``:

- torch: ``torch_backend.trainer.SFTTrainer.step`` (forward + ``nll`` loss + backward, clipping, AdamW);
- jax: ``jax_backend.trainer.SFTTrainer.step`` (the jitted value-and-grad step, clipping, optax AdamW).

Every measurement runs in a fresh subprocess per backend (``benchmarks/_memory.py``), after one
warm-up step in ``setup`` (the optimizer state exists, the jax step is compiled; its time is
reported apart). The two backends are not timed in one process: XLA's and OpenMP's worker
threads spin between steps and slow the other framework down (measured here: torch's tiny step
took 2.2x longer next to jax than alone). To spread machine load over both, ``--rounds`` rounds
alternate torch and jax processes. Two ratios jax/torch are reported: of the best (minimum) step
times over all rounds, the usual estimator on a shared machine (``timeit``), since other jobs
only ever add time; and the median over rounds of the per-round ratio of median step times.

Threads: by default each framework gets one core (the process is pinned to one CPU; torch
``set_num_threads(1)``, XLA ``--xla_cpu_multi_thread_eigen=false``). On this shared 2-core machine two-thread torch stalls
on OpenMP barriers whenever another job holds a core (measured: its median tiny step was 15x
its best one), which would make the ratio a measure of machine load; ``--num-threads 2``
runs torch with 2 threads and XLA with its default pool.

Memory (DESIGN.md, "Benchmarks"), from the same subprocesses:

- torch on CPU: peak RSS above the subprocess's baseline over the timed steps;
  on CUDA: ``torch.cuda.max_memory_allocated``;
- jax: ``memory_analysis().temp_size_in_bytes`` of the compiled value-and-grad step (what XLA
  allocates besides the parameters, the batch and the gradients), plus the same RSS figure as
  torch for comparability; on GPU also ``peak_bytes_in_use``.

    .venv/bin/python benchmarks/torch_vs_jax.py --presets tiny small
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _report import add_output_args, grouped_bars, markdown_table, pyplot, save_figure, start_run  # noqa: E402

BACKENDS = ("torch", "jax")


# --------------------------------------------------------------------------------------
# Measured in the subprocess
# --------------------------------------------------------------------------------------


def make_batch(batch_size: int, max_length: int, seed: int):
    """``batch_size`` packed rows of ``max_length`` tokens from the embedded SFT data (``common``)."""
    from twinseq.common.data.batching import collate
    from twinseq.common.config import TrainConfig
    from twinseq.common.data.prepare import prepare_sft_dataset
    from twinseq.common.data.packing import pack_dataset

    rows = prepare_sft_dataset(TrainConfig.from_flat(max_length=max_length, disable_tqdm=True))[0]
    packed = pack_dataset(rows, max_length, strategy="bfd")
    order = np.random.default_rng(seed).permutation(len(packed))[:batch_size]
    return collate([packed[int(i)] for i in order], pad_to_multiple_of=64)


def train_config(batch_size: int, loss_type: str):
    from twinseq.common.config import TrainConfig

    return TrainConfig.from_flat(max_steps=10_000, learning_rate=1e-4, lr_scheduler_type="constant", weight_decay=0.1,
                       max_grad_norm=1.0, per_device_train_batch_size=batch_size, pad_to_multiple_of=64,
                       loss_type=loss_type, disable_tqdm=True)


class TorchStep:
    def __init__(self, preset: str, cfg, seed: int, device: str) -> None:
        import torch

        import twinseq.torch_backend as tb
        from twinseq.common.config import ModelConfig
        from twinseq.common.models.init import init_weights
        from twinseq.torch_backend.parallel import parallelize
        from twinseq.torch_backend.trainer import SFTTrainer

        self.device = torch.device(device)
        model_cfg = ModelConfig.preset(preset)
        model = tb.build_model(model_cfg, init_weights(model_cfg, seed=seed), device=device)
        self.trainer = SFTTrainer(cfg, parallelize(model, None, cfg), self.device)

    def __call__(self, batch) -> tuple[float, float]:
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        t0 = time.perf_counter()
        out = self.trainer.step([batch])
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return out["loss"], time.perf_counter() - t0

    def peak_device_bytes(self) -> dict:
        import torch

        if self.device.type != "cuda":
            return {}
        return {"torch_cuda_max_memory_allocated": int(torch.cuda.max_memory_allocated(self.device))}


class JaxStep:
    def __init__(self, preset: str, cfg, seed: int) -> None:
        import twinseq.jax_backend as jb
        from twinseq.common.config import ModelConfig
        from twinseq.common.models.init import init_weights
        from twinseq.jax_backend.trainer import SFTTrainer

        model_cfg = ModelConfig.preset(preset)
        self.trainer = SFTTrainer(jb.build_model(model_cfg, init_weights(model_cfg, seed=seed)), cfg)

    def __call__(self, batch) -> tuple[float, float]:
        import jax

        t0 = time.perf_counter()
        out = self.trainer.step([batch])
        jax.block_until_ready(self.trainer.params)
        return out["loss"], time.perf_counter() - t0

    def memory_analysis(self, batch) -> dict:
        """XLA's own accounting of the compiled value-and-grad step (the ``grads_jit`` the trainer runs)."""
        import jax.numpy as jnp

        from twinseq.jax_backend import batch_inputs, grads_jit

        t = self.trainer
        compiled = grads_jit.lower(t.graphdef, t.params, batch_inputs(batch, t.vocab_size),
                                   jnp.asarray(batch.num_items_in_batch, jnp.int32), loss_type=t.cfg.loss.loss_type,
                                   chunk_size=t.cfg.loss.loss_chunk_size, compute_dtype=None).compile()
        m = compiled.memory_analysis()
        return {"jax_temp_bytes": int(m.temp_size_in_bytes), "jax_argument_bytes": int(m.argument_size_in_bytes),
                "jax_output_bytes": int(m.output_size_in_bytes)}

    def peak_device_bytes(self) -> dict:
        import jax

        device = jax.devices()[0]
        if device.platform == "cpu":
            return {}
        return {"jax_peak_bytes_in_use": int((device.memory_stats() or {}).get("peak_bytes_in_use", 0))}


def setup(backends: list[str], preset: str, batch_size: int, max_length: int, loss_type: str, seed: int,
          num_threads: int, device: str, num_steps: int) -> dict:
    """Both (or one) trainers and the batch; one warm-up step each (allocates Adam state, compiles jax)."""
    import torch

    if num_threads == 1 and device == "cpu":
        # XLA still runs some work on a second thread with multi_thread_eigen off; pinning the process
        # (before XLA starts its pool: threads inherit it) gives both frameworks exactly one core.
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    torch.set_num_threads(num_threads)
    batch = make_batch(batch_size, max_length, seed)
    cfg = train_config(batch_size, loss_type)
    steps = {}
    if "torch" in backends:
        steps["torch"] = TorchStep(preset, cfg, seed, device)
    if "jax" in backends:
        steps["jax"] = JaxStep(preset, cfg, seed)
    warmup = {name: step(batch) for name, step in steps.items()}
    return {"steps": steps, "batch": batch, "warmup": warmup, "num_steps": num_steps}


def run(state: dict) -> dict:
    """The timed steps (with two backends, alternating step by step)."""
    steps, batch = state["steps"], state["batch"]
    names = list(steps)
    out: dict[str, Any] = {n: {"seconds": [], "loss": []} for n in names}
    for i in range(state["num_steps"]):
        for name in (names if i % 2 == 0 else names[::-1]):
            loss, seconds = steps[name](batch)
            out[name]["seconds"].append(seconds)
            out[name]["loss"].append(loss)
    for name in names:
        out[name]["warmup_seconds"] = state["warmup"][name][1]
        out[name]["first_loss"] = state["warmup"][name][0]
        out[name].update(steps[name].peak_device_bytes())
    if "jax" in steps:
        out["jax"].update(steps["jax"].memory_analysis(batch))
    out["batch_shape"] = list(batch.shape)
    out["batch_tokens"] = int(batch.num_tokens)
    return out


# --------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------


def _kwargs(preset: str, backends: list[str], args: argparse.Namespace) -> dict:
    return dict(backends=backends, preset=preset, batch_size=args.batch_size, max_length=args.max_length,
                loss_type=args.loss_type, seed=args.seed, num_threads=args.num_threads, device=args.device,
                num_steps=args.steps)


def _child_env(args: argparse.Namespace) -> dict:
    """One JAX device (a forced host device count would split the cores) on the platform asked for;
    with ``--num-threads 1`` XLA's CPU runtime is single-threaded too, like torch."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    if args.device == "cpu" and args.num_threads == 1:
        flags += ["--xla_cpu_multi_thread_eigen=false", "intra_op_parallelism_threads=1"]
    return {"XLA_FLAGS": " ".join(flags), **({"JAX_PLATFORMS": "cpu"} if args.device == "cpu" else {})}


def measure(preset: str, backends: list[str], args: argparse.Namespace) -> dict:
    from _memory import measure_in_subprocess

    res = measure_in_subprocess(__file__, "setup", "run", _kwargs(preset, backends, args),
                                num_threads=args.num_threads, timeout=3600, env=_child_env(args))
    return {"extra": res["records"][0]["extra"], "peak_above_baseline_bytes": res["peak_above_baseline_bytes"],
            "baseline_rss_bytes": res["baseline_rss_bytes"]}


def summarize(preset: str, rounds: list[dict]) -> dict:
    """``rounds``: per round ``{"torch": measure(...), "jax": measure(...)}``."""
    def median(backend: str, key: str) -> float:
        return statistics.median(statistics.median(r[backend]["extra"][backend][key]) if key == "seconds"
                                 else r[backend]["extra"][backend][key] for r in rounds)

    def median_rss(backend: str) -> int:
        return int(statistics.median(r[backend]["peak_above_baseline_bytes"] for r in rounds))

    ratios = [statistics.median(r["jax"]["extra"]["jax"]["seconds"]) /
              statistics.median(r["torch"]["extra"]["torch"]["seconds"]) for r in rounds]
    best = {b: min(min(r[b]["extra"][b]["seconds"]) for r in rounds) for b in BACKENDS}
    first = rounds[0]
    t, j = first["torch"]["extra"]["torch"], first["jax"]["extra"]["jax"]
    row = {"preset": preset, "batch_shape": first["jax"]["extra"]["batch_shape"],
           "batch_tokens": first["jax"]["extra"]["batch_tokens"],
           "torch_step_seconds": median("torch", "seconds"), "jax_step_seconds": median("jax", "seconds"),
           "jax_over_torch_time": statistics.median(ratios), "jax_over_torch_time_per_round": ratios,
           "torch_best_step_seconds": best["torch"], "jax_best_step_seconds": best["jax"],
           "jax_over_torch_best_time": best["jax"] / best["torch"],
           "jax_first_step_seconds": median("jax", "warmup_seconds"),
           "torch_first_step_seconds": median("torch", "warmup_seconds"),
           "first_loss_rel_diff": abs(j["first_loss"] - t["first_loss"]) / abs(t["first_loss"]),
           "torch_rss_bytes": median_rss("torch"), "jax_rss_bytes": median_rss("jax")}
    memory = first
    jm = memory["jax"]["extra"]["jax"]
    row.update({k: jm[k] for k in ("jax_temp_bytes", "jax_argument_bytes", "jax_output_bytes")})
    row["jax_over_torch_rss"] = row["jax_rss_bytes"] / max(row["torch_rss_bytes"], 1)
    row["jax_temp_over_torch_rss"] = row["jax_temp_bytes"] / max(row["torch_rss_bytes"], 1)
    for key in ("torch_cuda_max_memory_allocated", "jax_peak_bytes_in_use"):
        for backend in BACKENDS:
            if key in memory[backend]["extra"][backend]:
                row[key] = memory[backend]["extra"][backend][key]
    if "torch_cuda_max_memory_allocated" in row and "jax_peak_bytes_in_use" in row:
        row["jax_over_torch_gpu_memory"] = row["jax_peak_bytes_in_use"] / max(row["torch_cuda_max_memory_allocated"], 1)
    return row


def markdown(rows: list[dict], args: argparse.Namespace) -> str:
    mib = 1 / 2 ** 20
    lines = [f"Threads on {args.device}: "
             + ("one core each (process pinned to one CPU, torch `set_num_threads(1)`, XLA "
                "`--xla_cpu_multi_thread_eigen=false`)"
                if args.num_threads == 1 else f"torch {args.num_threads} threads, XLA its default pool")
             + ".", "",
             f"Setup: the same `init_weights(seed={args.seed})` model and one identical batch "
             f"({args.batch_size} packed "
             f"rows x {args.max_length} tokens of the embedded SFT data), float32, `{args.loss_type}` loss. One step "
             "= each trainer's own optimizer step (forward, loss, backward, clip at 1.0, AdamW). Each backend runs "
             f"alone in a fresh subprocess; {args.rounds} rounds alternate torch and jax processes; "
             f"{args.steps} timed steps per process after one warm-up step (the jax warm-up step compiles). "
             "Best = minimum step time over all rounds (other jobs on this shared machine only ever add time); "
             "median = median over rounds of the per-process median; the median ratio is the median over rounds "
             "of the per-round jax/torch ratio. Memory: RSS is the peak above the baseline taken after "
             "setup (weights, Adam state, batch and compiled step already there); jax temp is XLA's "
             "`memory_analysis().temp_size_in_bytes` of the compiled value-and-grad step.",
             ""]
    lines += markdown_table(
        ["preset", "batch", "torch step best / median (s)", "jax step best / median (s)", "**jax/torch time, best**",
         "jax/torch time, median (per round)", "jax 1st step (compile, s)", "torch RSS MiB", "jax RSS MiB",
         "**jax/torch RSS**", "jax temp MiB", "jax temp / torch RSS", "first-step loss rel diff"],
        [[r["preset"], f"{r['batch_shape'][0]}x{r['batch_shape'][1]}",
          f"{r['torch_best_step_seconds']:.3f} / {r['torch_step_seconds']:.3f}",
          f"{r['jax_best_step_seconds']:.3f} / {r['jax_step_seconds']:.3f}", f"**{r['jax_over_torch_best_time']:.2f}**",
          f"{r['jax_over_torch_time']:.2f} ({', '.join(f'{x:.2f}' for x in r['jax_over_torch_time_per_round'])})",
          f"{r['jax_first_step_seconds']:.1f}", f"{r['torch_rss_bytes'] * mib:.1f}",
          f"{r['jax_rss_bytes'] * mib:.1f}", f"**{r['jax_over_torch_rss']:.2f}**", f"{r['jax_temp_bytes'] * mib:.1f}",
          f"{r['jax_temp_over_torch_rss']:.2f}", f"{r['first_loss_rel_diff']:.1e}"] for r in rows])
    gpu = [r for r in rows if "jax_over_torch_gpu_memory" in r]
    if gpu:
        lines += [""] + markdown_table(
            ["preset", "torch cuda max allocated MiB", "jax peak bytes in use MiB", "jax/torch"],
            [[r["preset"], f"{r['torch_cuda_max_memory_allocated'] * mib:.1f}",
              f"{r['jax_peak_bytes_in_use'] * mib:.1f}", f"{r['jax_over_torch_gpu_memory']:.2f}"] for r in gpu])
    else:
        lines += ["", "GPU column: no CUDA device on this machine (`torch.cuda.is_available()` is False); run the "
                  "same command with `--device cuda` on a GPU machine to add `torch.cuda.max_memory_allocated` and "
                  "JAX `peak_bytes_in_use`."]
    lines.append("")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    presets, mib = [r["preset"] for r in rows], 1 / 2 ** 20
    fig, (ax_t, ax_m) = pyplot().subplots(1, 2, figsize=(9, 3.5))
    grouped_bars(ax_t, presets, {b: [r[f"{b}_best_step_seconds"] for r in rows] for b in BACKENDS},
                 title="optimizer step time (s, best)",
                 labels={"jax": [f"{r['jax_over_torch_best_time']:.2f}x" for r in rows]})
    grouped_bars(ax_m, presets, {"torch RSS": [r["torch_rss_bytes"] * mib for r in rows],
                                 "jax RSS": [r["jax_rss_bytes"] * mib for r in rows],
                                 "jax XLA temp": [r["jax_temp_bytes"] * mib for r in rows]},
                 title="step memory (MiB)")
    save_figure(fig, path)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--presets", nargs="+", default=["tiny", "small"])
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-length", type=int, default=256)
    parser.add_argument("--loss-type", default="nll", choices=["nll", "chunked_nll", "fused_linear"])
    parser.add_argument("--steps", type=int, default=4, help="timed steps after one warm-up step")
    parser.add_argument("--rounds", type=int, default=3, help="alternating torch/jax subprocess rounds")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-threads", type=int, default=1,
                        help="1: torch and XLA single-threaded (robust on a shared machine); N > 1: torch N "
                             "threads, XLA its default pool of all cores")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    add_output_args(parser)
    return parser.parse_args(argv)


def main(argv=None) -> dict:
    run = start_run(parse_args, argv, __file__, device=lambda a: a.device)
    args = run.args
    rounds: dict[str, list] = {preset: [] for preset in args.presets}
    for index in range(args.rounds):
        for preset in args.presets:
            order = BACKENDS if index % 2 == 0 else BACKENDS[::-1]
            rounds[preset].append({b: measure(preset, [b], args) for b in order})
            r = rounds[preset][-1]
            print(f"round {index} {preset:5s} " + "  ".join(
                f"{b} {statistics.median(r[b]['extra'][b]['seconds']):.3f} s/step "
                f"{r[b]['peak_above_baseline_bytes'] / 2 ** 20:.0f} MiB" for b in BACKENDS), flush=True)
    rows = [summarize(preset, rounds[preset]) for preset in args.presets]
    payload = {"settings": run.arguments(), "summary": rows,
               "raw": [{"preset": preset, "rounds": rounds[preset]} for preset in args.presets]}
    run.write(payload, title="Torch vs JAX training step", body=markdown(rows, args), plot=lambda png: plot(rows, png))
    return payload


if __name__ == "__main__":
    main()
