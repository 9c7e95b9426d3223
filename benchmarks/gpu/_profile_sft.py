"""One twinseq SFT run under ``torch.profiler``: where a step's time goes on the GPU and on the host.

The run is ``sft_gpu.py``'s twinseq row (same model, rows, loss and attention), through the Python API
(``SFTTrainer``) with a callback that steps the profiler at every optimizer step: ``--wait`` steps unprofiled
(compilation, autotuning, allocator growth), then ``--active`` steps recorded. Prints, for the recorded steps, the
wall time per step, the GPU busy time (the union of kernel intervals) and the top operators by GPU and by host time,
and writes ``DIR/profile_sft.txt`` and a gzipped Chrome trace ``DIR/profile_sft.json.gz``.

    python benchmarks/gpu/_profile_sft.py --out DIR [--model llama-3.2-3b] [--max-length 4096] [--rows 2]
    python benchmarks/gpu/_profile_sft.py --out DIR --set loss_type=liger --set attn_implementation=sdpa

A helper for tuning, not one of the README's benchmarks (``run_all.sh`` skips ``_*.py``).
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent.parent))


def _value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def busy_seconds(events: list[tuple[float, float]]) -> float:
    """The length of the union of ``[start, end)`` intervals (seconds of any kernel running)."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted(events):
        if start >= end:
            total += stop - start
            end = stop
        elif stop > end:
            total += stop - end
            end = stop
    return total


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--model", default=None, help="default: sft_gpu.py's model")
    p.add_argument("--max-length", type=int, default=4096)
    p.add_argument("--rows", type=int, default=2)
    p.add_argument("--wait", type=int, default=3, help="optimizer steps before recording")
    p.add_argument("--active", type=int, default=2, help="optimizer steps recorded")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="override one config field of the twinseq row (JSON values)",
    )
    args = p.parse_args(argv)

    import sft_gpu
    import torch
    from torch.profiler import ProfilerActivity, profile, schedule

    from twinseq.common.api import SFTConfig, SFTTrainer
    from twinseq.common.run.callbacks import TrainerCallback

    ns = sft_gpu._parse(
        ["--max-length", str(args.max_length), "--rows", str(args.rows)]
        + (["--model", args.model] if args.model else [])
    )
    ns.device = "cuda" if torch.cuda.is_available() else "cpu"
    values = sft_gpu.twinseq_values(ns, offload=False)
    cuda = ns.device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for item in args.set:
        field, _, text = item.partition("=")
        values[field] = _value(text)
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="twinseq-profile-"))
    steps = args.wait + args.active + 1
    prof = profile(
        activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []),
        schedule=schedule(wait=args.wait - 1, warmup=1, active=args.active, repeat=1),
    )
    marks: list[float] = []

    class Step(TrainerCallback):
        def on_train_begin(self, a: Any, state: Any, control: Any, **kw: Any) -> None:
            prof.start()
            sync()
            marks.append(time.perf_counter())

        def on_step_end(self, a: Any, state: Any, control: Any, **kw: Any) -> None:
            sync()
            marks.append(time.perf_counter())
            prof.step()

    cfg = SFTConfig(
        **values, output_dir=str(work / "run"), max_steps=steps, disable_tqdm=True, save_final_checkpoint=False
    )
    print(f"profile: {json.dumps(values, default=str)}", flush=True)
    SFTTrainer(args=cfg, callbacks=[Step()]).train()
    prof.stop()
    shutil.rmtree(work, ignore_errors=True)

    step_s = [b - a for a, b in zip(marks, marks[1:])]
    recorded = step_s[args.wait : args.wait + args.active]
    trace = args.out / "profile_sft.json"
    prof.export_chrome_trace(str(trace))
    events = json.loads(trace.read_text()).get("traceEvents", [])
    # GPU work: kernels, copies and memsets (annotations such as ProfilerStep span the whole step)
    kernels = [
        (e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6)
        for e in events
        if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
    ]
    busy = busy_seconds(kernels) / max(1, args.active)
    wall = sum(recorded) / max(1, len(recorded))
    lines = [
        f"config: {json.dumps(values, default=str)}",
        f"device: {torch.cuda.get_device_name() if cuda else 'cpu'}; torch {torch.__version__}",
        "step seconds (all): " + ", ".join(f"{s:.3f}" for s in step_s),
        f"recorded steps: {args.active}; wall {wall:.3f} s/step; GPU busy {busy:.3f} s/step "
        f"({100 * busy / max(1e-9, wall):.0f} %)",
        f"peak allocated {torch.cuda.max_memory_allocated() / 2**20 if cuda else 0:,.0f} MiB",
        "",
    ]
    averages = prof.key_averages()
    for key, title in [("self_cuda_time_total", "by GPU self time")] * cuda + [
        ("self_cpu_time_total", "by host self time"),
        ("cpu_time_total", "by host total time"),
    ]:
        lines += [f"## top 40 {title}", averages.table(sort_by=key, row_limit=40, max_name_column_width=70), ""]
    text = "\n".join(lines)
    print(text)
    (args.out / "profile_sft.txt").write_text(text)
    with open(trace, "rb") as src, gzip.open(str(trace) + ".gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    trace.unlink()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
