"""The memory staircase (torchtune's "memory optimizations" table, on CPU): each technique added to the previous.

Steps, cumulative: baseline (padded batches, ``nll``, ``sdpa``) -> + packing/padding-free -> + fused loss ->
+ gradient checkpointing -> + LoRA -> + bf16 base (``--dtype bfloat16``: the frozen base stored in bfloat16, the
adapters float32, bfloat16 compute) -> + QLoRA (an NF4 base, which computes in float32: this step goes back to
``--dtype float32``, so it follows "+ LoRA"). Each step is a real ``twinseq train`` run of a few steps in a
fresh subprocess, on both backends, for ``small`` and a ~100M-parameter Llama written by this script as a
``config.json`` (random init, the embedded 8192-token vocabulary). Peak memory as
``benchmarks/memory_planner_check.py`` measures it (torch: peak RSS over the steps above the RSS before the
model is built; jax: the compiled step's ``memory_analysis()`` + optimizer state); tokens/s of the last step
(the first compiles/warms up); the planner's prediction next to each.

On jax the packing step packs rows but stays padded (``padding_free`` would make one row of every token,
which jax's dense attention pays for as a ``(B T)^2`` mask and scores); on torch it is packing +
padding-free + ``varlen`` attention.

    .venv/bin/python benchmarks/peft_staircase.py                      # both models, both backends
    .venv/bin/python benchmarks/peft_staircase.py --models small --backends torch
    .venv/bin/python benchmarks/peft_staircase.py --reuse benchmarks/results/<file>.json --remeasure jax
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional, Sequence

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _report import MIB, add_output_args, grouped_bars, markdown_table, pyplot, save_figure, start_run  # noqa: E402
from _train_peak import measure  # noqa: E402

LLAMA_100M = dict(model_type="llama", vocab_size=8192, hidden_size=768, intermediate_size=2560, num_hidden_layers=12,
                  num_attention_heads=12, num_key_value_heads=4)
"""~96M parameters: a GPT-2-small-sized Llama with grouped-query attention and the embedded vocabulary."""
SHAPES = {"small": dict(per_device_train_batch_size=4, max_length=512),
          "llama-100m": dict(per_device_train_batch_size=2, max_length=512)}
STEPS = ("baseline", "+ packing/padding-free", "+ fused loss", "+ checkpointing", "+ LoRA", "+ bf16 base", "+ QLoRA")


def step_configs(backend: str) -> dict[str, dict[str, Any]]:
    """The flat config changes of each step, cumulative."""
    pack = dict(packing=True, packing_strategy="bfd_split")
    if backend == "torch":
        pack.update(padding_free=True, attn_implementation="varlen")
    changes = [dict(loss_type="nll"), pack, dict(loss_type="fused_linear"), dict(gradient_checkpointing=True),
               dict(use_peft=True), dict(dtype="bfloat16"), dict(load_in_4bit=True, dtype="float32")]
    out, acc = {}, {}
    for name, change in zip(STEPS, changes):
        acc = {**acc, **change}
        out[name] = dict(acc)
    return out


def write_model(folder: Path) -> str:
    from twinseq.common.models.configs import ModelConfig, to_hf_config

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(to_hf_config(ModelConfig(**LLAMA_100M)), indent=1))
    return str(folder)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="small,llama-100m")
    parser.add_argument("--backends", default="torch,jax")
    parser.add_argument("--steps", default=",".join(STEPS), help="which staircase steps to run")
    parser.add_argument("--max-steps", type=int, default=2, help="optimizer steps per run")
    parser.add_argument("--reuse", type=Path, default=None,
                        help="a previous result .json: keep its measured cells (re-planned with the current "
                             "formula) and measure only the cells it lacks")
    parser.add_argument("--remeasure", default="",
                        help="comma-separated backends whose cells are measured again even if --reuse has them "
                             "(e.g. --reuse <json> --remeasure jax keeps the torch cells and re-runs the jax ones)")
    add_output_args(parser)
    return parser.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> None:
    from tqdm import tqdm

    from twinseq.common.config import TrainConfig
    from twinseq.common.run.memory_plan import plan_memory

    run = start_run(parse_args, argv, __file__, device="cpu")
    args = run.args
    models, backends = args.models.split(","), args.backends.split(",")
    wanted = [s.strip() for s in args.steps.split(",")]
    tmp = Path(tempfile.mkdtemp(prefix="twinseq-staircase-"))
    model_paths = {"small": "small", "llama-100m": write_model(tmp / "llama-100m")}
    jobs = [(m, b, s, c) for m in models for b in backends for s, c in step_configs(b).items() if s in wanted]
    results: list[dict[str, Any]] = []
    old = {}
    if args.reuse is not None:
        remeasure = {b.strip() for b in args.remeasure.split(",") if b.strip()}
        old = {(r["model"], r["backend"], r["step"]): r for r in json.loads(args.reuse.read_text())["results"]
               if "peak_bytes" in r and r["backend"] not in remeasure}
    for model, backend, step, change in tqdm(jobs, desc="staircase", unit="run"):
        values = dict(backend=backend, model_config=model_paths[model], init_weights="random", learning_rate=1e-3,
                      **SHAPES[model], **change)
        row: dict[str, Any] = {"model": model, "backend": backend, "step": step, "config": values}
        if (model, backend, step) in old:
            row = {**old[(model, backend, step)], "config": values, "reused_from": args.reuse.name,
                   "planned_bytes": plan_memory(TrainConfig.from_flat(**values)).total}
            results.append(row)
            continue
        try:
            plan = plan_memory(TrainConfig.from_flat(**values))
            row["planned_bytes"] = plan.total
            got = measure(values, max_steps=args.max_steps, timeout=1200)
            if got.get("trainable_parameters") != plan.trainable_parameters:
                raise RuntimeError(f"the run trained {got.get('trainable_parameters')} parameters, the step asks for "
                                   f"{plan.trainable_parameters}: this checkout does not run it as configured")
            row.update(peak_bytes=got["peak_bytes"], tokens_per_second=got["tokens_per_second"],
                       seconds_per_step=got["seconds_per_step"], baseline_rss_bytes=got.get("baseline_rss_bytes"),
                       command=got["command"])
            tqdm.write(f"{model:>10} {backend:>5} {step:<24} peak {got['peak_bytes'] / MIB:8.1f} MiB (planned "
                       f"{row['planned_bytes'] / MIB:8.1f})  {got['tokens_per_second']:8.1f} tok/s")
        except Exception as err:  # noqa: BLE001 - a step this checkout cannot run is reported, not hidden
            row["error"] = str(err).strip().splitlines()[-1][:300]
            tqdm.write(f"{model:>10} {backend:>5} {step:<24} FAILED: {row['error']}")
        results.append(row)

    table = []
    for r in results:
        if "error" in r:
            table.append([r["model"], r["backend"], r["step"], "not run", "", "", "", r["error"][:120]])
            continue
        base = next(x for x in results if x["model"] == r["model"] and x["backend"] == r["backend"]
                    and x["step"] == STEPS[0] and "peak_bytes" in x)
        table.append([r["model"], r["backend"], r["step"], f"{r['peak_bytes'] / MIB:,.0f}",
                      f"{r['peak_bytes'] / base['peak_bytes']:.2f}", f"{r['planned_bytes'] / MIB:,.0f}",
                      f"{r['tokens_per_second']:,.0f}", "earlier run" if r.get("reused_from") else ""])
    shapes = "; ".join(f"`{m}`: {SHAPES[m]['per_device_train_batch_size']} x {SHAPES[m]['max_length']} tokens"
                       for m in models)
    body = [f"Each step adds one technique to the previous, as torchtune's memory table does; {args.max_steps} "
            f"optimizer steps of a real `twinseq train` per cell, float32 on CPU ({shapes} per micro-batch, the "
            f"embedded SFT data). `llama-100m`: {LLAMA_100M}. Peak: torch, peak RSS over the training steps above "
            "the RSS before the model is built; jax, the compiled step's `memory_analysis()` (argument + output + "
            "temp - alias) + optimizer state. tokens/s: the last step (timings are noisy: 2 shared cores). "
            "jax's packing step packs rows but stays padded (its dense attention would pay a (B T)^2 mask for "
            "padding-free). \"+ bf16 base\" is `--dtype bfloat16` on the LoRA run: its frozen base is stored in "
            "bfloat16 (adapters float32) and it computes in bfloat16 (on CPU, where bf16 matmuls are emulated); the "
            "planner's column still counts a float32 base plus bf16 copies there. \"+ QLoRA\" follows \"+ LoRA\" "
            "(float32: the NF4 layers compute in float32)." + (f" Cells measured by an earlier run ({args.reuse.name}, `--reuse`; note \"earlier run\") "
                                "are re-planned with the current formula." if args.reuse else ""), "",
            *markdown_table(["model", "backend", "step", "peak MiB", "vs baseline", "planned MiB", "tokens/s",
                             "note"], table, "lllrrrrl")]

    def plot(png: Path) -> None:
        plt = pyplot()
        fig, ax = plt.subplots(figsize=(12, 5))
        series = {}
        for model in models:
            for backend in backends:
                vals = []
                for step in wanted:
                    r = next((x for x in results if x["model"] == model and x["backend"] == backend
                              and x["step"] == step), None)
                    vals.append(r["peak_bytes"] / MIB if r and "peak_bytes" in r else 0.0)
                series[f"{model} {backend}"] = vals
        grouped_bars(ax, [s.replace("+ ", "+\n") for s in wanted], series, ylabel="peak memory (MiB)",
                     title="memory staircase on CPU: each technique added to the previous (0 = not run)")
        save_figure(fig, png)

    run.write({"steps": list(STEPS), "shapes": SHAPES, "llama_100m": LLAMA_100M, "results": results},
              title="PEFT memory staircase", body="\n".join(body), plot=plot)


if __name__ == "__main__":
    main()
