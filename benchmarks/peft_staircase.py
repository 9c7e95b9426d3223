"""The memory staircase (torchtune's "memory optimizations" table, on CPU): each technique added to the previous.

Steps, cumulative: baseline (padded batches, ``nll``, ``sdpa``) -> + packing/padding-free -> + fused loss ->
+ gradient checkpointing; then two branches from there. The full fine-tune's training state: + bf16 state
(``adamw_bf16``) -> + 8-bit AdamW (``adamw_bf16_8bit``; jax: ``adamw_bnb_8bit``) -> + optimizer in backward (torch).
The adapters: + LoRA -> + bf16 base (``--dtype bfloat16``: the frozen base stored in bfloat16, the
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
    .venv/bin/python benchmarks/peft_staircase.py --reuse <file>.json --remeasure "+ checkpointing"  # new rungs
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
SHARED_STEPS = ("baseline", "+ packing/padding-free", "+ fused loss", "+ checkpointing")
STATE_STEPS = ("+ bf16 state", "+ 8-bit AdamW", "+ optimizer in backward")
"""The full fine-tune's training-state rungs, each added to the previous, from "+ checkpointing"."""
PEFT_STEPS = ("+ LoRA", "+ bf16 base", "+ QLoRA")
"""The adapters' rungs, each added to the previous, from "+ checkpointing"."""
STEPS = SHARED_STEPS + STATE_STEPS + PEFT_STEPS
STATE_BASE = SHARED_STEPS[-1]
"""The float32 weights + float32 AdamW run the state rungs are compared with."""
NOT_ON_JAX = {
    "+ bf16 state": "torch only: the jax backend keeps float32 master weights (AdamWBF16's stochastic rounding is "
                    "torch's)",
    "+ optimizer in backward": "torch only: jax's step is one compiled program whose parameter and optimizer "
                               "buffers are donated",
}


def step_configs(backend: str) -> dict[str, dict[str, Any]]:
    """The flat config changes of each step, cumulative within its branch (the state rungs and the adapters' rungs
    both start from "+ checkpointing"). On jax the state branch is its one rung, 8-bit moments on float32 weights."""
    pack = dict(packing=True, packing_strategy="bfd_split")
    if backend == "torch":
        pack.update(padding_free=True, attn_implementation="varlen")
    shared = [dict(loss_type="nll"), pack, dict(loss_type="fused_linear"), dict(gradient_checkpointing=True)]
    if backend == "torch":
        state = [dict(optimizer="adamw_bf16"), dict(optimizer="adamw_bf16_8bit"),
                 dict(optimizer_in_backward=True, max_grad_norm=None)]
    else:
        state = [None, dict(optimizer="adamw_bnb_8bit"), None]
    peft = [dict(use_peft=True), dict(dtype="bfloat16"), dict(load_in_4bit=True, dtype="float32")]
    out, acc = {}, {}
    for name, change in zip(SHARED_STEPS, shared):
        acc = {**acc, **change}
        out[name] = dict(acc)
    for names, changes in ((STATE_STEPS, state), (PEFT_STEPS, peft)):
        branch = dict(out[STATE_BASE])
        for name, change in zip(names, changes):
            if change is not None:
                branch = {**branch, **change}
                out[name] = dict(branch)
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
                        help="comma-separated backends or steps whose cells are measured again even if --reuse has "
                             "them (e.g. --reuse <json> --remeasure jax keeps the torch cells and re-runs the jax "
                             "ones; --remeasure '+ checkpointing' re-runs the state rungs' float32 base)")
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
               if "peak_bytes" in r and r["backend"] not in remeasure and r["step"] not in remeasure}
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

    def peak_of(model: str, backend: str, step: str) -> Optional[int]:
        r = next((x for x in results if (x["model"], x["backend"], x["step"]) == (model, backend, step)), None)
        return r["peak_bytes"] if r and "peak_bytes" in r else None

    table, state_ratios = [], []
    for model in models:
        for backend in backends:
            for step in [s for s in STEPS if s in wanted]:
                r = next((x for x in results if (x["model"], x["backend"], x["step"]) == (model, backend, step)),
                         None)
                if r is None:
                    if step in NOT_ON_JAX and backend == "jax":
                        table.append([model, backend, step, "n/a", "", "", "", "", NOT_ON_JAX[step]])
                    continue
                if "error" in r:
                    table.append([model, backend, step, "not run", "", "", "", "", r["error"][:120]])
                    continue
                base, fp32 = peak_of(model, backend, STEPS[0]), peak_of(model, backend, STATE_BASE)
                vs_state = f"{r['peak_bytes'] / fp32:.2f}" if fp32 and step in STATE_STEPS else ""
                if vs_state and step == STATE_STEPS[-1] or (backend == "jax" and step == "+ 8-bit AdamW" and vs_state):
                    state_ratios.append(f"{model} {backend} {step}: {vs_state}x")
                table.append([model, backend, step, f"{r['peak_bytes'] / MIB:,.0f}",
                              f"{r['peak_bytes'] / base:.2f}" if base else "", vs_state,
                              f"{r['planned_bytes'] / MIB:,.0f}", f"{r['tokens_per_second']:,.0f}",
                              "earlier run" if r.get("reused_from") else ""])
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
            "",
            "The full fine-tune's training-state rungs branch from \"+ checkpointing\" (float32 weights and "
            "gradients, float32 AdamW: 16 bytes per parameter), each added to the previous: \"+ bf16 state\" "
            "(`--optimizer adamw_bf16`: bfloat16 weights, gradients and moments, stochastically rounded), \"+ 8-bit "
            "AdamW\" (`--optimizer adamw_bf16_8bit`: those weights with 8-bit blockwise moments; on jax "
            "`--optimizer adamw_bnb_8bit`, 8-bit moments on float32 weights), \"+ optimizer in backward\" "
            "(`--optimizer-in-backward --max-grad-norm None`: each parameter steps in its gradient's hook). "
            "\"vs float32 state\" is the rung's peak over \"+ checkpointing\"'s. The adapters' rungs "
            "(\"+ LoRA\" on) branch from \"+ checkpointing\" too."
            + (f" Full state staircase: {'; '.join(state_ratios)}." if state_ratios else ""), "",
            *markdown_table(["model", "backend", "step", "peak MiB", "vs baseline", "vs float32 state",
                             "planned MiB", "tokens/s", "note"], table, "lllrrrrrl")]

    def plot(png: Path) -> None:
        plt = pyplot()
        fig, ax = plt.subplots(figsize=(12, 5))
        series = {}
        for model in models:
            for backend in backends:
                vals = []
                for step in [s for s in STEPS if s in wanted]:
                    r = next((x for x in results if x["model"] == model and x["backend"] == backend
                              and x["step"] == step), None)
                    vals.append(r["peak_bytes"] / MIB if r and "peak_bytes" in r else 0.0)
                series[f"{model} {backend}"] = vals
        grouped_bars(ax, [s.replace("+ ", "+\n") for s in STEPS if s in wanted], series, ylabel="peak memory (MiB)",
                     title="memory staircase on CPU: each technique added to the previous (0 = not run)")
        save_figure(fig, png)

    run.write({"steps": list(STEPS), "shapes": SHAPES, "llama_100m": LLAMA_100M, "results": results},
              title="PEFT memory staircase", body="\n".join(body), plot=plot)


if __name__ == "__main__":
    main()
