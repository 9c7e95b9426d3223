"""KTO memory and time: twinseq's torch KTO trainer (``--task kto``) vs TRL 1.16's ``KTOTrainer``, same run, same
inputs.

What is measured, per trainer: ``--steps`` optimizer steps of KTO (loss ``kto``, beta 0.1, weights 1) from the same
``tiny`` weights (``common.models.init``, seed 0, saved as a Hugging Face folder that both load, with the embedded
tokenizer), the same rows, ``per_device_train_batch_size``, ``max_length``, learning rate (constant) and optimizer
(AdamW), and a live frozen reference model on both sides (``precompute_ref_log_probs`` off: TRL loads a second copy
from the folder, twinseq copies the policy). Each step scores the rows and, for the KL estimate, as many mismatched
(prompt, another row's completion) pairs, under the policy and the reference.

- twinseq ``padded/nll``: padded batch, full ``[positions, V]`` logits (completions and mismatched pairs in one
  ``[2B, T]`` batch);
- twinseq ``padded/fused_linear``: the padded batch with chunked log-probs (256 target rows at a time, no
  ``[positions, V]``);
- twinseq ``padding_free/fused_linear``: one packed row, the same kernel (on this CPU the one 8192-token row makes
  the decoder's attention slower than the padded batch's 64 rows);
- TRL ``KTOTrainer`` (``use_cpu`` on CPU, no bf16 there), its own fused LM head. ``gradient_checkpointing`` (TRL's
  default is on) is off, as on twinseq's side, so both trainers keep the same activations.

Data: a fixed unpaired set built from the embedded preference data (``embedded-preference``): the first pairs, in
the data set's order, whose prompt takes at most ``max_length // 4`` tokens and whose chosen and rejected each
overflow ``max_length`` on their own; each pair gives a desirable row (its chosen) then an undesirable one (its
rejected), ``batch * steps`` rows in all. Every row is then cut to exactly ``max_length`` tokens on both sides, and
so is every mismatched pair on TRL's side (checked on TRL's prepared rows), so each step has the same shape for
every trainer whatever its order of rows (TRL reads them in order, twinseq shuffles), and the padded layout has no
padding: this row measures the log-prob kernels, not padding. Both sides cut a mismatched pair for its own prompt
(the tokens per step are recorded for every trainer).

Why this shape (32 rows of 128 tokens): the ``tiny`` preset's vocabulary is fixed (V 8192, its tokenizer's) and its
decoder is small (H 96, 2 layers), so what grows with the tokens of a step is the LM head. TRL's fused LM head
scores every position on CPU (it keeps only the completion positions on Triton devices) in tiles of up to 4096
positions x the whole vocabulary (its vocabulary chunk is 32768 > V), and folds each tile with several full-size
float32 temporaries; 32 x 127 = 4064 positions is one full tile, so its logits-sized buffers are as large as they
get (32 KiB per position each), while the decoder's tensors take a few hundred bytes per token (H 96, intermediate
256): the logits dominate. More rows or tokens would only add decoder activations on TRL's side (its tile does not
grow past 4096 positions) and time on this 2-core machine; fewer would shrink TRL's tile.

Memory: peak RSS above the RSS once the trainer is built (CPU; data prepared, both models loaded), or
``torch.cuda.max_memory_allocated`` above the bytes allocated then (CUDA), over the whole run
(``benchmarks/_memory.py``), each trainer in a fresh subprocess. Step time: the median over the steps after the
first (twinseq: its ``step_seconds`` metric; TRL: a callback's time from ``on_step_begin`` to ``on_step_end``).

    .venv/bin/python benchmarks/kto_memory.py                          # tiny, 32 rows of 128 tokens, 6 steps
    .venv/bin/python benchmarks/kto_memory.py --steps 2 --batch 8 --max-length 64 --no-write   # quick
    .venv/bin/python benchmarks/kto_memory.py --variants twinseq:padded:fused_linear --no-write  # any layout:kernel

Acceptance: twinseq's padding-free ``fused_linear`` peak <= 0.5x TRL's (the target where the logits dominate).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional, Sequence

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _memory import (  # noqa: E402
    add_measure_args,
    cuda_peak_above_baseline,
    measure_in_subprocess,
    measured_settings,
    peak_bytes,
    resolve_device,
)
from _report import MIB, acceptance_line, add_output_args, markdown_table, start_run  # noqa: E402

VARIANTS = ("trl", "twinseq:padded:nll", "twinseq:padded:fused_linear", "twinseq:padding_free:fused_linear")
BETA = 0.1
OVERFLOW = 8  # tokens past max_length a kept pair's sequences have at least: a margin for tokenisation differences


# --- the data, built by the driver ----------------------------------------------------------


def unpaired_rows(model_dir: str, rows: int, max_length: int) -> list[dict[str, Any]]:
    """``rows`` unpaired rows (desirable, undesirable, ... from consecutive pairs) of ``embedded-preference`` pairs
    whose prompt fits ``max_length // 4`` tokens and whose chosen and rejected each overflow ``max_length``: any
    prompt followed by any of these completions (a row, or a mismatched pair) is cut to exactly ``max_length``."""
    from twinseq.common.data.corpus import load_embedded
    from twinseq.common.data.tokenizer import load_tokenizer

    pairs = load_embedded("embedded-preference")
    tok = load_tokenizer(model_dir)
    out: list[dict[str, Any]] = []
    for start in range(0, len(pairs), 512):
        block = pairs[start : start + 512]
        lengths = [[len(ids) for ids in tok.encode_batch(block[c])] for c in ("prompt", "chosen", "rejected")]
        for i, (p, c, r) in enumerate(zip(*lengths)):
            if p <= max_length // 4 and min(c, r) >= max_length + OVERFLOW:
                out += [
                    {"prompt": block["prompt"][i], "completion": block[side][i], "label": side == "chosen"}
                    for side in ("chosen", "rejected")
                ]
                if len(out) >= rows:
                    return out[:rows]
    raise SystemExit(
        f"embedded-preference holds only {len(out)} rows that fill max_length={max_length}; "
        f"ask for fewer rows (--batch x --steps) or a shorter --max-length."
    )


# --- run inside the measured subprocess ----------------------------------------------------


def setup(
    variant: str,
    model_dir: str,
    data_file: str,
    out_dir: str,
    steps: int,
    batch: int,
    max_length: int,
    learning_rate: float,
    device: str,
) -> dict[str, Any]:
    import torch
    from datasets import Dataset

    torch.manual_seed(0)
    data = Dataset.from_list(json.loads(Path(data_file).read_text()))
    if variant == "trl":
        return _setup_trl(model_dir, data, out_dir, steps, batch, max_length, learning_rate, device)
    _, layout, kernel = variant.split(":")
    from twinseq.common.config import TrainConfig
    from twinseq.common.run.inputs import RunInputs
    from twinseq.torch_backend.kto import build_kto

    cfg = TrainConfig.from_flat(
        task="kto",
        model_config=model_dir,
        output_dir=out_dir,
        max_steps=steps,
        per_device_train_batch_size=batch,
        max_length=max_length,
        learning_rate=learning_rate,
        lr_scheduler_type="constant",
        kto_loss_type="kto",
        beta=BETA,
        precompute_ref_log_probs=False,
        padding_free=layout == "padding_free",
        loss_type=kernel,
        save_final_checkpoint=False,
        disable_tqdm=True,
        dtype="bfloat16" if device == "cuda" else "float32",
    )
    trainer, source, tokenizer, _ = build_kto(cfg, torch.device(device), None, RunInputs(train_dataset=data))
    return {
        "variant": variant,
        "cfg": cfg,
        "trainer": trainer,
        "source": source,
        "tokenizer": tokenizer,
        "device": device,
    }


def _setup_trl(model_dir, data, out_dir, steps, batch, max_length, learning_rate, device):
    import time

    import trl
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.seconds: list[float] = []

        def on_step_begin(self, args, state, control, **kwargs):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.seconds.append(time.perf_counter() - self.t0)

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32")
    args = trl.KTOConfig(
        output_dir=out_dir,
        per_device_train_batch_size=batch,
        max_length=max_length,
        max_steps=steps,
        learning_rate=learning_rate,
        lr_scheduler_type="constant",
        loss_type="kto",
        beta=BETA,
        precompute_ref_log_probs=False,
        gradient_checkpointing=False,
        report_to="none",
        use_cpu=device == "cpu",
        bf16=device == "cuda",
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
    )
    timer = StepTimer()
    trainer = trl.KTOTrainer(model=model, args=args, train_dataset=data, processing_class=tokenizer, callbacks=[timer])
    if trainer.ref_model is None:
        raise RuntimeError("expected TRL's KTOTrainer to hold a live reference model")
    prepared = trainer.train_dataset
    shortest = min(
        len(p) + len(c)
        for key in ("completion_ids", "KL_completion_ids")
        for p, c in zip(prepared["prompt_ids"], prepared[key])
    )
    if len(prepared) != len(data) or shortest < max_length:
        raise RuntimeError(
            f"TRL kept {len(prepared)} of {len(data)} rows, the shortest of {shortest} tokens: "
            f"not every sequence fills max_length={max_length}"
        )
    collate, tokens = trainer.data_collator, []

    def counting_collator(examples):  # the tokens of each step: rows and mismatched pairs, padding left out
        batch = collate(examples)
        tokens.append(int(batch["attention_mask"].sum() + batch["KL_attention_mask"].sum()))
        return batch

    trainer.data_collator = counting_collator
    return {"variant": "trl", "trainer": trainer, "timer": timer, "tokens": tokens, "device": device}


def run(state: dict[str, Any]) -> dict[str, Any]:
    extra: dict[str, Any] = {}
    with cuda_peak_above_baseline(extra, enabled=state["device"] == "cuda"):
        if state["variant"] == "trl":
            state["trainer"].train()
            logs = [h for h in state["trainer"].state.log_history if "loss" in h and "kl" in h]
            extra["step_seconds"] = state["timer"].seconds
            extra["loss"] = [h["loss"] for h in logs]
            extra["kl"] = [h["kl"] for h in logs]
            extra["num_tokens"] = state["tokens"]
        else:
            from twinseq.common.run.report import read_metrics
            from twinseq.common.run.runner import run as run_steps

            cfg = state["cfg"]
            run_steps(cfg, state["trainer"], state["source"], tokenizer=state["tokenizer"], desc="kto-bench")
            rows = read_metrics(cfg.output_dir)
            extra["step_seconds"] = [r["step_seconds"] for r in rows]
            extra["loss"] = [r["loss"] for r in rows]
            extra["kl"] = [r["kl"] for r in rows]
            extra["num_tokens"] = [r["num_tokens"] for r in rows]
    return extra


# --- the driver ----------------------------------------------------------------------------


def parse(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--batch", type=int, default=32, help="rows per step (per_device_train_batch_size)")
    p.add_argument("--max-length", type=int, default=128, help="max_length: every sequence is cut to it")
    p.add_argument("--learning-rate", type=float, default=1e-4)
    p.add_argument("--variants", default=",".join(VARIANTS))
    add_measure_args(p, timeout=1800.0)
    add_output_args(p)
    return p.parse_args(argv)


def _save_model(folder: Path) -> Any:
    """The ``tiny`` preset, seed-0 weights and the embedded tokenizer, as a Hugging Face folder; its config."""
    from twinseq.common.config import ModelConfig
    from twinseq.common.data.tokenizer import load_tokenizer
    from twinseq.common.models.init import init_weights
    from twinseq.torch_backend.checkpoint import save_pretrained
    from twinseq.torch_backend.model import build_model

    cfg = ModelConfig.preset("tiny")
    save_pretrained(build_model(cfg, init_weights(cfg, seed=0)), folder)
    load_tokenizer("embedded").save_pretrained(folder)
    return cfg


def _row(variant: str, res: dict[str, Any]) -> dict[str, Any]:
    extra = res["records"][0]["extra"]
    steps = extra["step_seconds"]
    return {
        "variant": variant,
        "peak_bytes": peak_bytes(res),
        "step_seconds": statistics.median(steps[1:] or steps),
        "step_seconds_each": steps,
        "run_seconds": res["median_seconds"],
        "steps_run": len(steps),
        "tokens_per_step": extra["num_tokens"],  # rows and mismatched pairs, without padding
        "first_loss": extra["loss"][0],
        "last_loss": extra["loss"][-1],
        "last_kl": extra["kl"][-1],
    }


def _span(values: Sequence[int]) -> str:
    """``8192`` or ``8091-8160``."""
    return f"{min(values)}" if min(values) == max(values) else f"{min(values)}-{max(values)}"


def main(argv: Optional[Sequence[str]] = None) -> int:
    bench = start_run(parse, argv, __file__, device=resolve_device)
    a = bench.args
    rows = []
    variants = a.variants.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "tiny"
        model = _save_model(model_dir)
        data = unpaired_rows(str(model_dir), a.batch * a.steps, a.max_length)
        data_file = Path(tmp) / "rows.json"
        data_file.write_text(json.dumps(data))
        for variant in variants:
            kwargs = dict(
                variant=variant,
                model_dir=str(model_dir),
                data_file=str(data_file),
                out_dir=str(Path(tmp) / variant.replace(":", "_")),
                steps=a.steps,
                batch=a.batch,
                max_length=a.max_length,
                learning_rate=a.learning_rate,
                device=a.device,
            )
            res = measure_in_subprocess(
                __file__,
                "setup",
                "run",
                kwargs,
                repeats=a.repeats,
                warmup=a.warmup,
                num_threads=a.threads,
                timeout=a.timeout,
            )
            rows.append(_row(variant, res))
            r = rows[-1]
            print(
                f"{variant:>36}: peak {r['peak_bytes'] / MIB:8.1f} MiB  step {r['step_seconds']:6.2f} s  "
                f"loss {r['first_loss']:.4f} -> {r['last_loss']:.4f}",
                flush=True,
            )
    base = next((r for r in rows if r["variant"] == "trl"), rows[0])
    for r in rows:
        r["peak_vs_trl"] = r["peak_bytes"] / max(base["peak_bytes"], 1)
        r["step_time_vs_trl"] = r["step_seconds"] / base["step_seconds"]
    table = markdown_table(
        ["trainer", "peak MiB", "x TRL", "step s", "x TRL", "tokens / step", "loss (first -> last)", "KL (last)"],
        [
            [
                r["variant"],
                f"{r['peak_bytes'] / MIB:.1f}",
                f"{r['peak_vs_trl']:.2f}",
                f"{r['step_seconds']:.2f}",
                f"{r['step_time_vs_trl']:.2f}",
                _span(r["tokens_per_step"]),
                f"{r['first_loss']:.4f} -> {r['last_loss']:.4f}",
                f"{r['last_kl']:.4f}",
            ]
            for r in rows
        ],
        "lrrrrrrr",
    )
    checks = {
        "every trainer ran": len(rows) == len(variants) and all(r["steps_run"] == a.steps for r in rows),
        # policy = reference at step 1: every log-ratio and the KL are 0, so each row's loss is 1 - sigmoid(0)
        "first-step loss 0.5 on every side": all(abs(r["first_loss"] - 0.5) < 1e-4 for r in rows),
    }
    fused = next((r for r in rows if r["variant"] == "twinseq:padding_free:fused_linear"), None)
    if fused is not None and base["variant"] == "trl":
        checks["padding-free fused peak <= 0.5x TRL's"] = fused["peak_bytes"] <= 0.5 * base["peak_bytes"]
    positions = a.batch * (a.max_length - 1)
    scored = f"{positions} positions" if a.device == "cpu" else "the completion positions"
    body = "\n".join(
        [
            f"KTO (loss `kto`, beta {BETA}, live frozen reference), model `tiny` (same seed-0 weights for all, "
            f"V {model.vocab_size}, H {model.hidden_size}), {a.batch} unpaired rows per step (desirable and "
            f"undesirable from `embedded-preference` pairs, every row cut to max_length {a.max_length}) plus as "
            f"many mismatched pairs for the KL estimate, learning rate {a.learning_rate:g} (constant), {a.steps} "
            f"steps, {a.dtype} on {a.device}. TRL's fused LM head scores {scored} per forward, in tiles of up to "
            f"4096 positions x V; twinseq's `nll` holds [{2 * a.batch * a.max_length}, V] logits (rows and "
            f"mismatched pairs in one batch), its `fused_linear` 256 target rows x V at a time. Memory: "
            f"{measured_settings(a)['memory_method']}, over the whole run. Times: median over steps after the first; "
            f"the machine may be shared (load average in the provenance).",
            "",
            f"Tokens per step: the rows' and the mismatched pairs', padding left out ({2 * a.batch * a.max_length} "
            f"when every sequence fills max_length). Both sides build a mismatched pair from another row's uncut "
            f"completion and cut it to max_length with its own prompt.",
            "",
            *table,
            "",
            acceptance_line(checks),
        ]
    )
    bench.write(
        {
            "arguments": bench.arguments(),
            "settings": measured_settings(a),
            "shape": {
                "rows_per_step": a.batch,
                "max_length": a.max_length,
                "trl_positions_per_forward": positions,
                "vocab": model.vocab_size,
                "hidden": model.hidden_size,
            },
            "rows": rows,
            "acceptance": checks,
        },
        title="KTO: twinseq torch vs TRL KTOTrainer",
        body=body,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
