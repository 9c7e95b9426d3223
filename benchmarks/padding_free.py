"""Padded vs padding-free training throughput and memory (torch backend, CPU or CUDA).

The same examples, in the same micro-batches, go through forward + backward twice:

- **padded**: ``collate(examples)``, each row padded to the longest example, attention
  ``sdpa`` with twinseq's dense document mask (the usual HF setup);
- **padding-free**: ``collate(examples, padding_free=True)``, one row of real tokens,
  attention ``varlen`` (documents cut out and bucketed, no work on padding).

Both steps hold exactly the same real tokens, labels and loss (``nll``). Throughput is real
(non-padding) tokens per second of forward + backward. It is measured with both models in
one fresh process, the two modes alternating step by step (padded first on even steps,
padding-free first on odd ones), so that a busy machine slows both alike; the ratio
padding-free / padded is taken per round and its median reported. Memory is measured
separately, one fresh subprocess per mode: peak RSS above the baseline after setup
(``benchmarks/_memory.py``), or ``torch.cuda.max_memory_allocated`` on CUDA.

    .venv/bin/python benchmarks/padding_free.py                      # tiny and small, 3 rounds of 20 steps
    .venv/bin/python benchmarks/padding_free.py --presets tiny --rounds 1 --steps 2 --warmup 1 --batch-size 2
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _report import Run, add_output_args, grouped_bars, markdown_table, pyplot, save_figure, start_run  # noqa: E402

MODES = {"padded": ("sdpa", False), "padding_free": ("varlen", True)}


# --------------------------------------------------------------------------------------
# Measured in the subprocess
# --------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=2)
def _sft_rows(max_length: int):
    from twinseq.common.config import TrainConfig
    from twinseq.common.data.prepare import prepare_sft_dataset

    return prepare_sft_dataset(TrainConfig.from_flat(max_length=max_length, disable_tqdm=True))[0]


def load_examples(num_examples: int, max_length: int, seed: int) -> list[dict]:
    """``num_examples`` tokenised examples of the embedded SFT dataset, in a seeded random order."""
    rows = _sft_rows(max_length)
    order = np.random.default_rng(seed).permutation(len(rows))[:num_examples]
    return [{"input_ids": rows[int(i)]["input_ids"], "completion_mask": rows[int(i)]["completion_mask"]}
            for i in order]


def _build(preset: str, mode: str, batch_size: int, steps: int, warmup: int, max_length: int, seed: int,
           device: str) -> tuple[Any, list]:
    import torch

    from twinseq.common.data.batching import collate
    from twinseq.common.config import ModelConfig
    from twinseq.common.models.init import init_weights
    from twinseq.torch_backend.model import build_model

    torch.manual_seed(seed)
    attn, padding_free = MODES[mode]
    examples = load_examples(batch_size * (warmup + steps), max_length, seed)
    batches = [collate(examples[i:i + batch_size], padding_free=padding_free)
               for i in range(0, len(examples), batch_size)]
    cfg = ModelConfig.preset(preset)
    return build_model(cfg, init_weights(cfg, seed=seed), attn_implementation=attn, device=device), batches


def setup(modes: list[str], num_threads: int, warmup: int, device: str, **kwargs) -> dict:
    """Models and batches of each mode in ``modes`` (same weights, same examples)."""
    import torch

    torch.set_num_threads(num_threads)
    built = {mode: _build(mode=mode, warmup=warmup, device=device, **kwargs) for mode in modes}
    return {"built": built, "warmup": warmup, "device": device}


def _train_step(model, batch, device) -> float:
    from twinseq.torch_backend.model import compute_loss

    _sync(device)
    t0 = time.perf_counter()
    compute_loss(model, batch, "nll").backward()
    model.zero_grad(set_to_none=True)
    _sync(device)
    return time.perf_counter() - t0


def run(state: dict) -> dict:
    """Forward + backward of every batch; with two modes they alternate step by step."""
    import torch

    device, built = torch.device(state["device"]), state["built"]
    modes = list(built)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    out = {m: {"step_seconds": [], "real_tokens": [], "batch_tokens": []} for m in modes}
    for i in range(len(built[modes[0]][1])):
        for mode in (modes if i % 2 == 0 else modes[::-1]):
            model, batches = built[mode]
            seconds = _train_step(model, batches[i], device)
            if i >= state["warmup"]:
                out[mode]["step_seconds"].append(seconds)
                out[mode]["real_tokens"].append(batches[i].num_tokens)
                out[mode]["batch_tokens"].append(int(np.prod(batches[i].shape)))
    if device.type == "cuda":
        out["cuda_max_memory_allocated"] = int(torch.cuda.max_memory_allocated(device))
    return out


def _sync(device) -> None:
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)


# --------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------


def _kwargs(preset: str, modes: list[str], args: argparse.Namespace) -> dict:
    return dict(preset=preset, modes=modes, batch_size=args.batch_size, steps=args.steps, warmup=args.warmup,
                max_length=args.max_length, seed=args.seed, num_threads=args.num_threads, device=args.device)


def measure_throughput(preset: str, args: argparse.Namespace) -> dict:
    """One round: both modes interleaved in one fresh process."""
    from _memory import measure_in_subprocess

    res = measure_in_subprocess(__file__, "setup", "run", _kwargs(preset, list(MODES), args),
                                num_threads=args.num_threads, timeout=3600)
    extra = res["records"][0]["extra"]
    out = {"preset": preset}
    for mode in MODES:
        steps = extra[mode]
        out[mode] = {"tokens_per_second": sum(steps["real_tokens"]) / sum(steps["step_seconds"]),
                     "real_tokens": sum(steps["real_tokens"]), "batch_tokens": sum(steps["batch_tokens"]),
                     "step_seconds": steps["step_seconds"]}
    assert out["padded"]["real_tokens"] == out["padding_free"]["real_tokens"], "same real tokens in both modes"
    out["speedup"] = out["padding_free"]["tokens_per_second"] / out["padded"]["tokens_per_second"]
    return out


def measure_memory(preset: str, mode: str, args: argparse.Namespace) -> int:
    """Peak memory of one mode alone, in a fresh process."""
    from _memory import measure_in_subprocess, peak_bytes

    res = measure_in_subprocess(__file__, "setup", "run", _kwargs(preset, [mode], args),
                                num_threads=args.num_threads, timeout=3600)
    return peak_bytes(res, "cuda_max_memory_allocated")


def summarize(rounds: list[dict], memory: dict, presets: list[str]) -> list[dict]:
    rows = []
    for preset in presets:
        runs = [r for r in rounds if r["preset"] == preset]
        row = {"preset": preset, "speedup_median": statistics.median(r["speedup"] for r in runs),
               "speedup_per_round": [r["speedup"] for r in runs], "real_tokens": runs[0]["padded"]["real_tokens"]}
        for mode in MODES:
            row[f"{mode}_tokens_per_second"] = statistics.median(r[mode]["tokens_per_second"] for r in runs)
            row[f"{mode}_batch_tokens"] = runs[0][mode]["batch_tokens"]
            row[f"{mode}_peak_memory_bytes"] = memory[(preset, mode)]
        row["memory_ratio"] = row["padding_free_peak_memory_bytes"] / max(row["padded_peak_memory_bytes"], 1)
        rows.append(row)
    return rows


def markdown(rows: list[dict], args: argparse.Namespace) -> str:
    mib = 1 / 2 ** 20
    lines = [f"Data: embedded SFT dataset (max_length {args.max_length}), {args.batch_size} examples per step, "
             f"{args.steps} timed steps after {args.warmup} warm-up steps, {args.rounds} rounds, "
             f"{args.num_threads} torch threads on {args.device}. "
             "Forward + backward, `nll` loss, fp32. Padded: rows padded to the longest example, `sdpa` with the "
             "dense document mask. Padding-free: one row, `varlen` attention. Both modes see exactly the same "
             "real tokens; throughput counts real tokens only. Each round runs both models in one fresh process, "
             "alternating step by step, so machine load hits both alike; speedup = median over rounds of "
             "padding-free/padded tokens/s.", ""]
    lines += markdown_table(
        ["preset", "real tokens", "padded tok/s", "padding-free tok/s", "**speedup**", "per round", "padded peak MiB",
         "padding-free peak MiB", "memory ratio", "padded batch tokens"],
        [[r["preset"], r["real_tokens"], f"{r['padded_tokens_per_second']:.0f}",
          f"{r['padding_free_tokens_per_second']:.0f}", f"**{r['speedup_median']:.2f}x**",
          ", ".join(f"{x:.2f}" for x in r["speedup_per_round"]), f"{r['padded_peak_memory_bytes'] * mib:.0f}",
          f"{r['padding_free_peak_memory_bytes'] * mib:.0f}", f"{r['memory_ratio']:.2f}", r["padded_batch_tokens"]]
         for r in rows])
    lines += ["", "Acceptance: padding-free >= 1.3x the tokens/s of padded on CPU: "
              + ", ".join(f"{r['preset']} {'PASS' if r['speedup_median'] >= 1.3 else 'FAIL'}" for r in rows), "",
              "Memory: peak RSS of a fresh subprocess above its baseline taken after setup (model, weights and "
              "batches already allocated), so it is what the timed steps themselves need.", "",
              "Absolute tokens/s depend on the machine's load (other jobs may share the cores; load average in the "
              "provenance); the paired per-round ratio is the figure to compare. Padded batch tokens: real plus "
              "padding positions the padded mode computes."]
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    presets = [r["preset"] for r in rows]
    modes = {"padded (sdpa + mask)": "padded", "padding-free (varlen)": "padding_free"}
    fig, (ax_t, ax_m) = pyplot().subplots(1, 2, figsize=(9, 3.5))
    grouped_bars(ax_t, presets, {label: [r[f"{m}_tokens_per_second"] for r in rows] for label, m in modes.items()},
                 title="real tokens / s (fwd+bwd)",
                 labels={"padding-free (varlen)": [f"{r['speedup_median']:.2f}x" for r in rows]})
    grouped_bars(ax_m, presets, {label: [r[f"{m}_peak_memory_bytes"] / 2 ** 20 for r in rows]
                                 for label, m in modes.items()},
                 title="peak memory above baseline (MiB)", legend=False)
    save_figure(fig, path)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--presets", nargs="+", default=["tiny", "small"])
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-length", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-threads", type=int, default=2)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--from-json", default=None,
                        help="re-render the .md and .png of a results .json without measuring again")
    add_output_args(parser)
    return parser.parse_args(argv)


def _write(run: Run, rows: list[dict], rounds: list[dict]) -> Path:
    return run.write({"settings": run.arguments(), "summary": rows, "rounds": rounds},
                     title="Padding-free vs padded training throughput", body=markdown(rows, run.args),
                     plot=lambda png: plot(rows, png))


def rerender(path: str, no_write: bool = False) -> None:
    """The .md and .png of a results .json again, from its own figures and provenance."""
    data = json.loads(Path(path).read_text())
    if "provenance" not in data:
        raise SystemExit(f"{path} has no provenance block (written before benchmarks/_report.py): re-run the "
                         "benchmark instead.")
    args = argparse.Namespace(**data["settings"], output_dir=Path(path).parent, no_write=no_write)
    _write(Run("padding_free", args, data["provenance"]), data["summary"], data["rounds"])


def main(argv=None) -> None:
    given = parse_args(argv)
    if given.from_json:
        return rerender(given.from_json, given.no_write)
    run = start_run(parse_args, argv, __file__, device=lambda a: a.device)
    args, rounds, memory = run.args, [], {}
    for preset in args.presets:
        for mode in MODES:
            memory[(preset, mode)] = measure_memory(preset, mode, args)
            print(f"{preset:5s} {mode:12s} peak {memory[(preset, mode)] / 2 ** 20:7.1f} MiB", flush=True)
    for round_index in range(args.rounds):
        for preset in args.presets:
            r = measure_throughput(preset, args)
            rounds.append(r)
            print(f"round {round_index} {preset:5s} padded {r['padded']['tokens_per_second']:8.0f} tok/s  "
                  f"padding-free {r['padding_free']['tokens_per_second']:8.0f} tok/s  {r['speedup']:.2f}x",
                  flush=True)
    _write(run, summarize(rounds, memory, args.presets), rounds)


if __name__ == "__main__":
    main()
