"""GRPO with long prompts and prefix sharing: twinseq (shared and unshared) vs TRL 1.16's ``GRPOTrainer``.

The memory-frontier issue's figure: at P = 512 prompt tokens, C = 64 completion tokens, G = 8 completions per
prompt, every peer runs the policy forward over G * (P + C) tokens per group; twinseq's shared row holds
P - 1 + G * (C + 1) (``common.data.prefix_sharing``).

1. Whole GRPO runs (``benchmarks/grpo_memory.py``'s trainers and measurement: a fresh subprocess per trainer, peak
   RSS above the RSS once the trainer is built, on CPU; ``torch.cuda.max_memory_allocated`` on CUDA), same model
   (``small``, seed-0 weights), same prompts (rows of about P tokens of the embedded task's words), dapo loss, beta 0.
2. The log-prob forward alone, in this process: ``torch_backend.grpo.completion_logps`` over the same G * prompts
   random completions of C tokens, shared vs unshared (``collate_completions(share_prefix=...)``), forward without
   gradient (the old-policy and reference pass) and forward + backward (the policy pass); medians of ``--repeats``.

    .venv/bin/python benchmarks/grpo_prefix_sharing.py                     # P 512, C 64, G 8, small
    .venv/bin/python benchmarks/grpo_prefix_sharing.py --prompt-tokens 64 --completion 8 --steps 2 --no-write
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional, Sequence

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import grpo_memory  # noqa: E402
from _memory import add_measure_args, measure_in_subprocess, measured_settings, resolve_device  # noqa: E402
from _report import MIB, acceptance_line, add_output_args, markdown_table, start_run  # noqa: E402

VARIANTS = (
    "trl",
    "twinseq:padding_free:fused_linear:unshared:gc",
    "twinseq:padding_free:fused_linear:gc",
    "twinseq:padding_free:fused_linear",
)
COMPARED = "twinseq:padding_free:fused_linear:gc"
"""The row held to the acceptance bound: prefix sharing with gradient checkpointing, as TRL's default runs (TRL 1.16's
``GRPOConfig`` sets ``gradient_checkpointing=True``)."""


def parse(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompt-tokens", type=int, default=512, help="P, tokens per prompt")
    p.add_argument("--completion", type=int, default=64, help="C, max_completion_length")
    p.add_argument("--generations", type=int, default=8, help="G, num_generations")
    p.add_argument("--prompts", type=int, default=2, help="prompts per step (per_device_train_batch_size = G x this)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--preset", default="small")
    p.add_argument("--learning-rate", type=float, default=1e-5)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--forward-repeats", type=int, default=3, help="timed log-prob forwards per layout")
    add_measure_args(p, timeout=3600.0)
    add_output_args(p)
    return p.parse_args(argv)


def write_prompts(path: Path, tokenizer: Any, prompt_tokens: int, num_rows: int) -> int:
    """``num_rows`` jsonl rows ``{"prompt"}`` of the embedded task's words, each about ``prompt_tokens`` tokens as
    ``tokenizer`` encodes it; returns the longest count (both trainers tokenise the same text)."""
    from twinseq.common.data.prompts import TASK_WORDS

    longest, rows = 0, []
    for r in range(num_rows):
        words: list[str] = []
        while len(tokenizer(" ".join(words))["input_ids"]) < prompt_tokens:
            words.append(TASK_WORDS[(len(words) * 7 + r) % len(TASK_WORDS)])
        text = " ".join(words)
        longest = max(longest, len(tokenizer(text)["input_ids"]))
        rows.append(json.dumps({"prompt": text}))
    path.write_text("\n".join(rows) + "\n")
    return longest


def _median_seconds(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def logprob_forward_times(a: argparse.Namespace) -> dict[str, Any]:
    """Seconds of the log-prob forward (no grad) and forward + backward, unshared and shared, and the token counts."""
    import numpy as np
    import torch

    from twinseq.common.config import ModelConfig
    from twinseq.common.models.init import init_weights
    from twinseq.common.objectives.grpo import collate_completions
    from twinseq.torch_backend.grpo import completion_logps
    from twinseq.torch_backend.model import build_model

    cfg = ModelConfig.preset(a.preset)
    model = build_model(cfg, init_weights(cfg, seed=0))
    rng = np.random.default_rng(0)
    prompts, completions = [], []
    for _ in range(a.prompts):
        prompt = rng.integers(1, cfg.vocab_size, a.prompt_tokens)
        for _ in range(a.generations):
            prompts.append(prompt)
            completions.append(rng.integers(1, cfg.vocab_size, a.completion))
    out: dict[str, Any] = {}
    for name, share in (("unshared", False), ("shared", True)):
        cb = collate_completions(prompts, completions, padding_free=True, share_prefix=share)

        def forward() -> None:
            with torch.no_grad():
                completion_logps(model, cb)

        def forward_backward() -> None:
            logps, _ = completion_logps(model, cb)
            logps.sum().backward()
            model.zero_grad(set_to_none=True)

        out[name] = {
            "tokens": cb.batch.num_tokens,
            "forward_seconds": _median_seconds(forward, a.forward_repeats),
            "forward_backward_seconds": _median_seconds(forward_backward, a.forward_repeats),
        }
        print(f"log-prob forward {name:>8}: {out[name]}", flush=True)
    return out


def _trainer_rows(a: argparse.Namespace, tmp: Path, model_dir: Path, dataset: Path) -> list[dict[str, Any]]:
    rows = []
    for variant in a.variants.split(","):
        kwargs = dict(variant=variant, model_dir=str(model_dir), out_dir=str(tmp / variant.replace(":", "_")),
                      steps=a.steps, batch=a.prompts * a.generations, generations=a.generations,
                      completion=a.completion, prompt=a.prompt_tokens + 16, learning_rate=a.learning_rate,
                      device=a.device, method="grpo", dataset_file=str(dataset))
        res = measure_in_subprocess(grpo_memory.__file__, "setup", "run", kwargs, repeats=a.repeats, warmup=a.warmup,
                                    num_threads=a.threads, timeout=a.timeout)
        rows.append(grpo_memory._row(variant, res))
        r = rows[-1]
        print(f"{variant:>44}: peak {r['peak_bytes'] / MIB:8.1f} MiB  step {r['step_seconds']:6.2f} s "
              f"(generation {r['generation_seconds']:5.2f} s, update {r['update_seconds']:5.2f} s)", flush=True)
    return rows


def main(argv: Optional[Sequence[str]] = None) -> int:
    bench = start_run(parse, argv, __file__, device=resolve_device)
    a = bench.args
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        model_dir, dataset = tmp / a.preset, tmp / "long_prompts.jsonl"
        grpo_memory._save_model(model_dir, a.preset)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        longest = write_prompts(dataset, tokenizer, a.prompt_tokens, 8 * a.prompts * a.steps)
        rows = _trainer_rows(a, tmp, model_dir, dataset)
    forward = logprob_forward_times(a)
    base = next((r for r in rows if r["variant"] == "trl"), rows[0])
    table = markdown_table(
        ["trainer", "peak MiB", "x TRL", "step s", "generation s", "update s", "x TRL (update)"],
        [[r["variant"], f"{r['peak_bytes'] / MIB:.1f}", f"{r['peak_bytes'] / max(base['peak_bytes'], 1):.2f}",
          f"{r['step_seconds']:.2f}", f"{r['generation_seconds']:.2f}", f"{r['update_seconds']:.2f}",
          f"{r['update_seconds'] / max(base['update_seconds'], 1e-9):.2f}"] for r in rows], "lrrrrrr")
    un, sh = forward["unshared"], forward["shared"]
    speed = {k: un[k] / sh[k] for k in ("forward_seconds", "forward_backward_seconds")}
    forward_table = markdown_table(
        ["layout", "tokens", "forward s", "forward + backward s"],
        [[name, f"{f['tokens']:,}", f"{f['forward_seconds']:.3f}", f"{f['forward_backward_seconds']:.3f}"]
         for name, f in forward.items()]
        + [["unshared / shared", f"{un['tokens'] / sh['tokens']:.2f}x", f"{speed['forward_seconds']:.2f}x",
            f"{speed['forward_backward_seconds']:.2f}x"]], "lrrr")
    shared = next((r for r in rows if r["variant"] == COMPARED), None)
    checks = {"every trainer ran": len(rows) == len(a.variants.split(",")),
              "log-prob forward >= 3x faster shared": speed["forward_seconds"] >= 3.0}
    if shared is not None and base["variant"] == "trl":
        checks[f"{COMPARED} peak <= 0.25x TRL's"] = shared["peak_bytes"] <= 0.25 * base["peak_bytes"]
    body = "\n".join([
        f"GRPO, model `{a.preset}` (seed-0 weights, the same for all), {a.prompts} prompts of about "
        f"{a.prompt_tokens} tokens (longest {longest}) x G = {a.generations} completions of up to {a.completion} "
        f"tokens per step, {a.steps} steps, dapo loss, beta 0, padding-free fused log-probs for twinseq. TRL runs "
        f"its defaults, which include gradient checkpointing; `:gc` rows turn twinseq's on too, `:unshared` turns "
        f"prefix sharing off. Memory: "
        f"{measured_settings(a)['memory_method']}, over the whole run (generation + update). Times: median over "
        f"steps after the first.", "", *table, "",
        f"The log-prob forward alone (`completion_logps`, {a.prompts} x {a.generations} random completions of exactly "
        f"{a.completion} tokens after prompts of {a.prompt_tokens}, median of {a.forward_repeats}):", "",
        *forward_table, "", acceptance_line(checks)])
    bench.write({"arguments": bench.arguments(), "settings": measured_settings(a), "rows": rows,
                 "logprob_forward": forward, "prompt_tokens_longest": longest},
                title="GRPO prefix sharing: twinseq torch vs TRL GRPOTrainer at long prompts", body=body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
