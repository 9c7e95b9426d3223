"""GRPO (or RLOO) memory and time: twinseq's torch trainer vs TRL 1.16's ``GRPOTrainer`` (``RLOOTrainer``), same
run, same inputs. ``benchmarks/rloo_memory.py`` runs it with ``method="rloo"`` (RLOO's advantage and loss, beta 0).

What is measured, per trainer: ``--steps`` optimizer steps of GRPO on the embedded last-word
task (``common.data.prompts``), from the same ``tiny`` weights (``common.models.init``, seed 0, saved as
a Hugging Face folder that both load), the same prompts, ``num_generations``, completion
length, learning rate and loss (``dapo``, beta 0: no reference model), one ``format`` reward.

- twinseq ``padded/nll``: padded batch, full logits (the layout TRL uses);
- twinseq ``padding_free/fused_linear``: one packed row, chunked log-probs (no ``[tokens, V]``);
- TRL ``GRPOTrainer`` (``use_cpu`` on CPU), its default kernels.

Both generate with Hugging Face ``generate`` on the training model with a KV cache. Each
trainer runs in a fresh subprocess (``benchmarks/_memory.py``): memory is the peak RSS above
the RSS once the trainer is built (CPU), or ``torch.cuda.max_memory_allocated`` above the
bytes allocated then (CUDA), over the whole run (generation and update). Step time is the
median over steps after the first (TRL: its ``step_time`` metric, which includes generation);
generation time is the median time inside ``generate`` over the steps after the first (twinseq:
its ``generation_seconds`` metric; TRL: a timer around the model's ``generate``, called once per
step), and update time is the step time minus generation (and twinseq's reward) time. Note that
twinseq's ``nll`` kernel computes logits at every position, prompts included, as Hugging Face's
plain forward does, where TRL keeps only the completion positions (``logits_to_keep``).

    .venv/bin/python benchmarks/grpo_memory.py                         # tiny, 16 completions of 32 tokens
    .venv/bin/python benchmarks/grpo_memory.py --steps 2 --completion 8 --no-write   # quick
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional, Sequence

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _memory import (add_measure_args, cuda_peak_above_baseline, measure_in_subprocess,  # noqa: E402
                     measured_settings, peak_bytes, resolve_device)
from _report import MIB, acceptance_line, add_output_args, markdown_table, start_run  # noqa: E402

VARIANTS = ("trl", "twinseq:padded:nll", "twinseq:padding_free:fused_linear")


def _format_reward(prompts, completions, **kwargs):
    from twinseq.common.data.prompts import format_reward

    return format_reward(prompts, completions)


# --- run inside the measured subprocess ----------------------------------------------------

def setup(variant: str, model_dir: str, out_dir: str, steps: int, batch: int, generations: int, completion: int,
          prompt: int, learning_rate: float, device: str, method: str = "grpo",
          dataset_file: Optional[str] = None) -> dict[str, Any]:
    """``variant``: ``trl`` or ``twinseq:<padded|padding_free>:<kernel>[:unshared][:gc]`` (``unshared``: prefix
    sharing off; ``gc``: gradient checkpointing, which TRL's ``GRPOConfig`` turns on by default). ``dataset_file``: a
    ``.jsonl`` of ``{"prompt"}`` rows, else the embedded last-word task."""
    import torch

    torch.manual_seed(0)
    if variant == "trl":
        return _setup_trl(model_dir, out_dir, steps, batch, generations, completion, prompt, learning_rate, device,
                          method, dataset_file)
    _, layout, kernel, *flags = variant.split(":")
    data = {} if dataset_file is None else dict(dataset_name=dataset_file)
    from twinseq.common.config import TrainConfig
    from twinseq.torch_backend.grpo import build_grpo

    loss = dict(grpo_loss_type="dapo") if method == "grpo" else dict(rloo_beta=0.0)
    cfg = TrainConfig.from_flat(task=method, model_config=model_dir, output_dir=out_dir, max_steps=steps,
                                per_device_train_batch_size=batch, num_generations=generations,
                                max_completion_length=completion, max_prompt_length=prompt,
                                learning_rate=learning_rate, lr_scheduler_type="constant", **loss,
                                reward_funcs=["format"], padding_free=layout == "padding_free", loss_type=kernel,
                                disable_tqdm=True, dtype="bfloat16" if device == "cuda" else "float32",
                                share_prefix="unshared" not in flags, gradient_checkpointing="gc" in flags,
                                **data)
    trainer, source, tokenizer, _ = build_grpo(cfg, torch.device(device), None, reward_funcs=[_format_reward])
    return {"variant": variant, "cfg": cfg, "trainer": trainer, "source": source, "tokenizer": tokenizer,
            "device": device}


def _setup_trl(model_dir, out_dir, steps, batch, generations, completion, prompt, learning_rate, device, method,
               dataset_file=None):
    import time

    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from twinseq.common.data.prompts import build_last_word_task

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32")
    timer: dict[str, list] = {"calls": []}
    inner = model.generate

    def timed_generate(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            timer["calls"].append(time.perf_counter() - t0)

    model.generate = timed_generate
    rows = build_last_word_task() if dataset_file is None else Dataset.from_json(dataset_file).to_list()
    config, trainer_class = (trl.GRPOConfig, trl.GRPOTrainer) if method == "grpo" else (trl.RLOOConfig, trl.RLOOTrainer)
    loss = dict(loss_type="dapo") if method == "grpo" else {}
    args = config(output_dir=out_dir, per_device_train_batch_size=batch, num_generations=generations,
                  max_completion_length=completion, max_steps=steps, learning_rate=learning_rate,
                  lr_scheduler_type="constant", beta=0.0, **loss, report_to="none",
                  use_cpu=device == "cpu", bf16=device == "cuda", logging_steps=1, save_strategy="no",
                  disable_tqdm=True, temperature=1.0, seed=0)
    trainer = trainer_class(model=model, reward_funcs=[_format_reward], args=args,
                          train_dataset=Dataset.from_list(rows), processing_class=tokenizer)
    return {"variant": "trl", "trainer": trainer, "timer": timer, "device": device}


def run(state: dict[str, Any]) -> dict[str, Any]:
    extra: dict[str, Any] = {}
    with cuda_peak_above_baseline(extra, enabled=state["device"] == "cuda"):
        if state["variant"] == "trl":
            state["trainer"].train()
            logs = [h for h in state["trainer"].state.log_history if "step_time" in h]
            extra["step_seconds"] = [h["step_time"] for h in logs]
            extra["generation_seconds"] = state["timer"]["calls"]  # one call per step (steps_per_generation 1)
            extra["reward_seconds"] = [0.0]
            extra["reward"] = [h["reward"] for h in logs]
        else:
            from twinseq.common.run.report import read_metrics
            from twinseq.common.run.runner import run as run_steps

            cfg = state["cfg"]
            run_steps(cfg, state["trainer"], state["source"], tokenizer=state["tokenizer"], desc=f"{cfg.task}-bench")
            rows = read_metrics(cfg.output_dir)
            extra["step_seconds"] = [r["step_seconds"] for r in rows]
            extra["generation_seconds"] = [r["generation_seconds"] for r in rows]
            extra["reward_seconds"] = [r["reward_seconds"] for r in rows]
            extra["reward"] = [r["reward"] for r in rows]
    return extra


# --- the driver ----------------------------------------------------------------------------

def parse(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--batch", type=int, default=16, help="completions per step (per_device_train_batch_size)")
    p.add_argument("--generations", type=int, default=8, help="num_generations")
    p.add_argument("--completion", type=int, default=32, help="max_completion_length")
    p.add_argument("--prompt", type=int, default=64, help="max_prompt_length")
    p.add_argument("--learning-rate", type=float, default=1e-4)
    p.add_argument("--variants", default=",".join(VARIANTS))
    add_measure_args(p, timeout=1800.0)
    add_output_args(p)
    return p.parse_args(argv)


def _save_model(folder: Path, preset: str = "tiny") -> None:
    from twinseq.common.config import ModelConfig
    from twinseq.common.models.init import init_weights
    from twinseq.common.data.tokenizer import load_tokenizer
    from twinseq.torch_backend.checkpoint import save_pretrained
    from twinseq.torch_backend.model import build_model

    cfg = ModelConfig.preset(preset)
    save_pretrained(build_model(cfg, init_weights(cfg, seed=0)), folder)
    load_tokenizer("embedded").save_pretrained(folder)


def _row(variant: str, res: dict[str, Any]) -> dict[str, Any]:
    extra = res["records"][0]["extra"]
    steps = extra["step_seconds"]
    later = steps[1:] or steps
    generation = statistics.median(extra["generation_seconds"][1:] or extra["generation_seconds"])
    reward = statistics.median(extra["reward_seconds"])  # TRL's is inside its step: counted as update
    step = statistics.median(later)
    return {"variant": variant, "peak_bytes": peak_bytes(res), "step_seconds": step,
            "generation_seconds": generation, "update_seconds": max(step - generation - reward, 0.0),
            "run_seconds": res["median_seconds"], "first_reward": extra["reward"][0]}


def main(argv: Optional[Sequence[str]] = None, method: str = "grpo", script: str = __file__) -> int:
    """``method``: ``grpo`` (this script) or ``rloo`` (``benchmarks/rloo_memory.py``, which passes its ``script``)."""
    bench = start_run(parse, argv, script, device=resolve_device)
    a = bench.args
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "tiny"
        _save_model(model_dir)
        for variant in a.variants.split(","):
            kwargs = dict(variant=variant, model_dir=str(model_dir), out_dir=str(Path(tmp) / variant.replace(":", "_")),
                          steps=a.steps, batch=a.batch, generations=a.generations, completion=a.completion,
                          prompt=a.prompt, learning_rate=a.learning_rate, device=a.device, method=method)
            res = measure_in_subprocess(__file__, "setup", "run", kwargs, repeats=a.repeats, warmup=a.warmup,
                                        num_threads=a.threads, timeout=a.timeout)
            rows.append(_row(variant, res))
            r = rows[-1]
            print(f"{variant:>36}: peak {r['peak_bytes'] / MIB:8.1f} MiB  step {r['step_seconds']:6.2f} s "
                  f"(generation {r['generation_seconds']:5.2f} s, update {r['update_seconds']:5.2f} s)", flush=True)
    base = next((r for r in rows if r["variant"] == "trl"), rows[0])
    table = markdown_table(
        ["trainer", "peak MiB", "x TRL", "step s", "x TRL", "generation s", "update s", "x TRL (update)"],
        [[r["variant"], f"{r['peak_bytes'] / MIB:.1f}", f"{r['peak_bytes'] / max(base['peak_bytes'], 1):.2f}",
          f"{r['step_seconds']:.2f}", f"{r['step_seconds'] / base['step_seconds']:.2f}",
          f"{r['generation_seconds']:.2f}", f"{r['update_seconds']:.2f}",
          f"{r['update_seconds'] / max(base['update_seconds'], 1e-9):.2f}"] for r in rows], "lrrrrrrr")
    checks = {"every trainer ran": len(rows) == len(a.variants.split(","))}
    fused = next((r for r in rows if r["variant"] == "twinseq:padding_free:fused_linear"), None)
    if fused is not None and base["variant"] == "trl":  # the logits dominate at this shape (V 8192, tiny model)
        checks["padding-free fused peak <= 0.5x TRL's"] = fused["peak_bytes"] <= 0.5 * base["peak_bytes"]
    body = "\n".join([
        f"{method.upper()}, model `tiny` (same seed-0 weights for all), {a.batch} completions per step = "
        f"{a.batch // a.generations} prompts x {a.generations} generations, max_completion_length {a.completion}, "
        f"{a.steps} steps, {'dapo loss' if method == 'grpo' else 'RLOO loss'}, beta 0. Memory: {measured_settings(a)['memory_method']}, over the whole run "
        f"(generation + update). Times: median over steps after the first.", "", *table, "",
        acceptance_line(checks)])
    trainer = "GRPOTrainer" if method == "grpo" else "RLOOTrainer"
    bench.write({"arguments": {**bench.arguments(), "method": method}, "settings": measured_settings(a), "rows": rows},
                title=f"{method.upper()}: twinseq torch vs TRL {trainer}", body=body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
