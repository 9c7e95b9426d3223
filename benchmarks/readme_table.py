"""The README's benchmark table, generated from the newest result ``.json`` of each benchmark.

    .venv/bin/python benchmarks/readme_table.py            # rewrite the table in README.md
    .venv/bin/python benchmarks/readme_table.py --check    # exit 1, with a diff, if README.md differs
    .venv/bin/python benchmarks/readme_table.py --print    # print the table only

The table sits between ``<!-- benchmarks:start -->`` and ``<!-- benchmarks:end -->`` in
README.md. Every figure in a row is read from a field of the result's JSON (never from its
markdown), so the README cannot drift from its files; ``tests/test_benchmarks_report.py``
runs ``--check``. A row whose file has no ``"provenance"`` block (written before
``benchmarks/_report.py``) says so in its file column, as does a row from a run with
non-default (smaller) arguments or from a dirty tree.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import sys
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _report import MIB, REPO_ROOT, RESULTS_DIR, parse_stem  # noqa: E402

START = "<!-- benchmarks:start -->"
END = "<!-- benchmarks:end -->"
NO_PROVENANCE = "**no provenance: re-run needed**"


# --- one row per benchmark: (what, baseline, twinseq) from the JSON fields ----------------------

def _x(ratio: float) -> str:
    """A ratio as the README writes it: ``0.40``, ``1.13``, ``0.039``, ``0.0056``."""
    return f"{ratio:.2f}" if ratio >= 0.1 else f"{ratio:.2g}"


def _mib(num_bytes: float) -> str:
    return f"{num_bytes / MIB:,.0f} MiB"


def _count(n: int) -> str:
    """``1_000_000`` -> ``1M``, ``100_000`` -> ``100k``, ``1500`` -> ``1,500``."""
    for size, suffix in ((1_000_000, "M"), (1_000, "k")):
        if n % size == 0:
            return f"{n // size:,}{suffix}"
    return f"{n:,}"


def _find(rows: list[dict], **match: Any) -> dict:
    found = [r for r in rows if all(r.get(k) == v for k, v in match.items())]
    if not found:
        raise KeyError(f"no row with {match}")
    return found[0]


def packing_row(d: dict) -> tuple[str, str, str]:
    cfg, bfd = d["config"], _find(d["results"], strategy="bfd")
    plan, mat = bfd["plan"], bfd["materialised"]
    baseline = (f"TRL {bfd['trl']['seconds']:.1f} s, +{bfd['trl']['rows_over_lower_bound_pct']:.2f} % rows"
                if "trl" in bfd else "TRL not run")
    vs_trl = f" ({bfd['speedup_vs_trl']:.0f}× TRL)" if "speedup_vs_trl" in bfd else ""
    return (f"packing {_count(cfg['num_sequences'])} sequences (bfd), plan / materialised", baseline,
            f"{plan['seconds']:.3f} s / {mat['seconds']:.2f} s{vs_trl}, +{plan['rows_over_lower_bound_pct']:.4f} % rows")


def loss_memory_row(d: dict) -> tuple[str, str, str]:
    s, nll, fused = d["shape"], _find(d["results"], loss_type="nll"), _find(d["results"], loss_type="fused_linear")
    return (f"SFT loss, {s['tokens']} tok × H {s['hidden']} × V {s['vocab']}, fwd+bwd", f"`nll` {_mib(nll['peak_bytes'])}",
            f"`fused_linear` {_mib(fused['peak_bytes'])} ({_x(fused['memory_ratio_vs_nll'])}×), "
            f"{fused['time_ratio_vs_nll']:.2f}× the time")


def jax_loss_memory_row(d: dict) -> tuple[str, str, str]:
    shape = next((s for s in d["shapes"] if s["name"] == "torch"), d["shapes"][0])
    s, nll, fused = (shape["shape"], _find(shape["results"], loss_type="nll"),
                     _find(shape["results"], loss_type="fused_linear"))
    return (f"JAX loss temp memory, {s['tokens']} tok × H {s['hidden']} × V {s['vocab']}",
            f"`nll` {_mib(nll['temp_bytes'])}",
            f"`fused_linear` {_mib(fused['temp_bytes'])} ({_x(fused['temp_ratio_vs_nll'])}×)")


def memory_techniques_row(d: dict) -> tuple[str, str, str]:
    a, rows = d["args"], d["rows"]
    base = _find(rows, technique="baseline (nll)")
    picked = [_find(rows, technique=t) for t in ("gradient checkpointing", "fused_linear loss",
                                                 "checkpointing + fused_linear")]
    return (f"one training step of `{a['preset']}`, {a['batch_size']} × {a['seq_len']} tokens: "
            "checkpointing / fused loss / both", f"`nll`, no checkpointing: {base['peak_mib']:,.0f} MiB",
            " / ".join(f"{_x(r['memory_ratio'])}×" for r in picked) + " the memory at "
            + " / ".join(f"{r['time_ratio']:.2f}×" for r in picked) + " the time")


def padding_free_row(d: dict) -> tuple[str, str, str]:
    rows = d["summary"]
    memory = {f"{r['memory_ratio']:.2f}×" for r in rows}
    memory_text = memory.pop() if len(memory) == 1 else " / ".join(f"{r['memory_ratio']:.2f}×" for r in rows)
    return ("padding-free vs padded training, embedded data",
            "padded: " + ", ".join(f"{r['padded_tokens_per_second']:,.0f} tok/s (`{r['preset']}`)" for r in rows),
            ", ".join(f"{r['speedup_median']:.2f}× (`{r['preset']}`)" for r in rows) + f", {memory_text} the memory")


def torch_vs_jax_row(d: dict) -> tuple[str, str, str]:
    r, threads = d["summary"][-1], d["settings"]["num_threads"]
    cores = "1 core each" if threads == 1 else f"{threads} threads"
    return (f"torch vs JAX optimizer step, `{r['preset']}`, fp32, {cores}", f"torch {r['torch_best_step_seconds']:.2f} s",
            f"JAX {r['jax_best_step_seconds']:.2f} s ({_x(r['jax_over_torch_best_time'])}×)")


def dpo_memory_row(d: dict) -> tuple[str, str, str]:
    s = d["shape"]
    nll = _find(d["results"], layout="padded", kernel="nll")
    fused = _find(d["results"], layout="padded", kernel="fused_linear")
    return (f"DPO log-probs, {2 * s['pairs'] * s['row']} positions × V {s['vocab']}, H {s['hidden']}",
            f"full logits {_mib(nll['peak_bytes'])}",
            f"fused {_mib(fused['peak_bytes'])} ({_x(fused['memory_vs_full_same_layout'])}×)")


def ring_attention_row(d: dict) -> tuple[str, str, str]:
    a = d["args"]
    dense = next(r for r in d["memory"] if r["name"].startswith("dense"))
    ring = next(r for r in d["memory"] if r["name"].startswith("ring"))
    block = a["seq_len"] // (2 * a["cp"])
    balance = {r["load_balance"]: r["max_over_mean"] for r in d["blocks"]
               if r["workload"].startswith("causal") and r["block_size"] == block}
    return (f"JAX ring attention fwd+bwd, T = {a['seq_len']}, {a['cp']} devices",
            f"dense {dense['temp_bytes_per_device'] / MIB:,.0f} MiB/device",
            f"ring {ring['temp_bytes_per_device'] / MIB:,.1f} MiB ({_x(ring['ratio_vs_dense'])}×); "
            f"zigzag balance max/mean {balance[True]:.3f} vs {balance[False]:.3f}")


def memory_planner_check_row(d: dict) -> tuple[str, str, str]:
    errors = [abs(r["error"]) for r in d["results"].values()]
    within = sum(e <= d["tolerance"] for e in errors)
    return (f"memory planner vs measured peak of `twinseq train`, {len(errors)} configurations (torch, jax)",
            "measured: torch peak RSS, jax compiled memory_analysis",
            f"{within}/{len(errors)} within {d['tolerance']:.0%}; median error {100 * sorted(errors)[len(errors) // 2]:.1f} %, "
            f"worst {100 * max(errors):.1f} %"
            + (f"; GPU runs re-planned for cuda: {sum(abs(r['error']) <= d['tolerance'] for r in gpu.values())}/"
               f"{len(gpu)} within {d['tolerance']:.0%}, worst {100 * max(abs(r['error']) for r in gpu.values()):.1f} %"
               if (gpu := d.get("gpu_replanned")) else ""))


def peft_staircase_row(d: dict) -> tuple[str, str, str]:
    done = [r for r in d["results"] if "peak_bytes" in r]
    model = "llama-100m" if any(r["model"] == "llama-100m" for r in done) else done[0]["model"]
    mine = [r for r in done if r["model"] == model and r["backend"] == "torch"]
    base, last = mine[0], mine[-1]
    text = f"{_mib(last['peak_bytes'])} ({_x(last['peak_bytes'] / base['peak_bytes'])}×)"
    what = f"memory staircase, `{model}` torch: baseline -> {last['step'].lstrip('+ ')} (the techniques up to it)"
    state = {r["step"]: r for r in mine}
    fp32, inbwd = state.get("+ checkpointing"), state.get("+ optimizer in backward")
    if fp32 and inbwd:
        what += "; full fine-tune: float32 state -> bf16 + 8-bit AdamW + optimizer in backward"
        text += f"; {_mib(fp32['peak_bytes'])} -> {_mib(inbwd['peak_bytes'])} ({_x(inbwd['peak_bytes'] / fp32['peak_bytes'])}×)"
    return what, f"{base['step']}: {_mib(base['peak_bytes'])}", text


def max_length_row(d: dict) -> tuple[str, str, str]:
    rows = d["results"]
    trl = next((r for r in rows if r["setup"] == "trl"), None)
    best = max((r for r in rows if r["setup"] != "trl"), key=lambda r: r["max_length"])
    bound = "" if best["bound"] == "memory" else ">= "
    where = "bf16 GPU" if d.get("device") == "cuda" else "fp32 CPU"
    return (f"longest single document that trains one step, `{d['model']}` {where}, cap {_mib(d['cap_bytes'])}",
            f"TRL SFTTrainer: {trl['max_length']:,} tokens" if trl else "TRL not run",
            f"{best['setup']} ({best['row']}): {bound}{best['max_length']:,} tokens"
            + (f" ({_x(best['max_length'] / trl['max_length'])}×)" if trl and trl["max_length"] else ""))


def cp_memory_row(d: dict) -> tuple[str, str, str]:
    return (f"torch allgather CP={d['cp']} (gloo), one step at T = {d['seq_len']:,}, blocked attention",
            f"1 process: {_mib(d['single']['peak_bytes'])}",
            f"largest rank {_mib(max(d['cp_run']['per_rank_peak_bytes']))} ({_x(d['ratio'])}×)")


def dpo_context_parallel_row(d: dict) -> tuple[str, str, str]:
    single, sharded = d["results"]
    return (f"DPO, longest trainable document under {_mib(d['cap_bytes'])} per process, torch allgather "
            f"CP={d['cp']} (gloo)",
            f"1 process: {single['max_length']:,} tokens",
            f"CP={d['cp']}: {sharded['max_length']:,} tokens ({_x(d['ratio'])}×)")


def grpo_memory_row(d: dict) -> tuple[str, str, str]:
    rows = {r["variant"]: r for r in d["rows"]}
    trl, best = rows["trl"], min((r for r in d["rows"] if r["variant"] != "trl"), key=lambda r: r["peak_bytes"])
    a = d["arguments"]
    method = a.get("method", "grpo")  # rloo_memory.py: the same measurement of RLOO
    return (f"{method.upper()} step vs TRL {method.upper()}Trainer, {a['generations']} generations x "
            f"{a['completion']} completion tokens",
            f"TRL: {_mib(trl['peak_bytes'])}, {trl['step_seconds']:.1f} s/step",
            f"{best['variant']}: {_mib(best['peak_bytes'])} ({_x(best['peak_bytes'] / trl['peak_bytes'])}×), "
            f"{best['step_seconds'] / trl['step_seconds']:.2f}× the step time")


def kto_memory_row(d: dict) -> tuple[str, str, str]:
    rows = {r["variant"]: r for r in d["rows"]}
    trl, best = rows["trl"], min((r for r in d["rows"] if r["variant"] != "trl"), key=lambda r: r["peak_bytes"])
    a = d["arguments"]
    return (f"KTO step vs TRL KTOTrainer, {a['batch']} rows x {a['max_length']} tokens + KL pairs, live reference",
            f"TRL: {_mib(trl['peak_bytes'])}, {trl['step_seconds']:.1f} s/step",
            f"{best['variant']}: {_mib(best['peak_bytes'])} ({_x(best['peak_bytes'] / trl['peak_bytes'])}×), "
            f"{best['step_seconds'] / trl['step_seconds']:.2f}× the step time")


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.1f} ms"


def _mib_or_dash(num_bytes) -> str:
    return "-" if num_bytes is None else _mib(num_bytes)


def loss_kernels_row(d: dict) -> tuple[str, str, str]:
    """Per vocabulary: ``nll`` and Cut Cross-Entropy, then twinseq's fastest loss that agrees with ``nll``."""
    baseline, mine = [], []
    for shape in d["shapes"]:
        ok = {r["kernel"]: r for r in shape["results"] if r["status"] == "ok"}
        v = f"V {shape['vocab']:,}: "
        if "twinseq nll" not in ok:  # the CUDA context was lost before this table, or nll ran out of memory
            lost = shape.get("context_lost_by")
            baseline.append(v + ("not measured" if lost else "`nll` did not run"))
            mine.append(f"not measured (CUDA context lost by `{lost}`)" if lost else "unchecked (no `nll` to compare)")
            continue
        nll, cce = ok["twinseq nll"], ok.get("cce linear_cross_entropy")
        baseline.append(v + f"`nll` {_mib_or_dash(nll['peak_bytes'])}, {_ms(nll['median_seconds'])}"
                        + (f"; CCE {_mib_or_dash(cce['peak_bytes'])}, {_ms(cce['median_seconds'])}" if cce else ""))
        ours = [r for name, r in ok.items() if name.startswith("twinseq ") and name != "twinseq nll"
                and r.get("check", {}).get("agrees")]
        if not ours:
            mine.append("no twinseq loss agreed with `nll`")
            continue
        best = min(ours, key=lambda r: r["median_seconds"])
        ref, key = (cce, "cce") if cce else (nll, "nll")
        memory = (f" ({_x(best[f'memory_ratio_vs_{key}'])}× {key.upper()})"
                  if f"memory_ratio_vs_{key}" in best else "")
        mine.append(f"`{best['kernel'].split(' ', 1)[1]}` {_mib_or_dash(best['peak_bytes'])}{memory}, "
                    f"{_ms(best['median_seconds'])} ({best[f'time_ratio_vs_{key}']:.2f}× {key.upper()})")
    return (f"{d['tokens']:,} tok × H {d['hidden']:,}, {d['dtype']}", "<br>".join(baseline), "<br>".join(mine))


def sft_gpu_row(d: dict) -> tuple[str, str, str]:
    rows = {r["setup"]: r for r in d["results"] if r["status"] == "ok"}
    r, ours, trl = d["ratios"], rows["twinseq"], rows.get("trl")
    text = f"{ours['tokens_per_second']:,.0f} tok/s"
    if "twinseq_over_trl_tokens_per_second" in r:
        text += f" ({r['twinseq_over_trl_tokens_per_second']:.2f}× TRL)"
    if ours["peak_bytes"]:
        text += f", {_mib(ours['peak_bytes'])}"
        text += f" ({_x(r['twinseq_over_trl_peak'])}× TRL)" if "twinseq_over_trl_peak" in r else ""
    bf16 = rows.get("twinseq-bf16")
    if bf16 is not None:
        text += f"; `adamw_bf16`: {bf16['tokens_per_second']:,.0f} tok/s"
        if "twinseq_bf16_over_trl_tokens_per_second" in r:
            text += f" ({r['twinseq_bf16_over_trl_tokens_per_second']:.2f}× TRL)"
        if bf16["peak_bytes"]:
            text += f", {_mib(bf16['peak_bytes'])}"
            text += f" ({_x(r['twinseq_bf16_over_trl_peak'])}× TRL)" if "twinseq_bf16_over_trl_peak" in r else ""
    for key, label in (("offload", "offloading"), ("bf16_offload", "offloading with `adamw_bf16`")):
        if f"{key}_over_no_offload_peak" in r:
            text += (f"; {label}: {_x(r[f'{key}_over_no_offload_peak'])}× the memory at "
                     f"{r[f'{key}_over_no_offload_step_time']:.2f}× the step time")
    baseline = "TRL not run" if trl is None else (
        f"TRL SFTTrainer: {trl['tokens_per_second']:,.0f} tok/s" + (f", {_mib(trl['peak_bytes'])}"
                                                                    if trl["peak_bytes"] else ""))
    return f"`{d['model']}`, {d['rows']} × {d['max_length']:,} packed tokens per step", baseline, text


def state_staircase_gpu_row(d: dict) -> tuple[str, str, str]:
    rows = {r["rung"]: r for r in d["results"] if r["status"] == "ok"}
    base = rows["float32"]
    steps = [f"{name}: {_mib(r['peak_bytes'])} ({_x(r['peak_bytes'] / base['peak_bytes'])}×, loss "
             f"{100 * (r['last_loss'] / base['last_loss'] - 1):+.2f} %)" for name, r in rows.items() if name != "float32"]
    return (f"`{d['model']}` full fine-tune, {d['rows']} × {d['max_length']:,} packed tokens, {d['steps']} steps a rung",
            f"float32 weights + AdamW: {_mib(base['peak_bytes'])}", "; ".join(steps))


def save_memory_row(d: dict) -> tuple[str, str, str]:
    rows = d["rows"]
    eager = next((r for r in rows if r["mode"] == "eager"), None)
    ours = [r for r in rows if r["mode"] == "streamed"]
    model = f"{rows[0]['parameters'] / 1e6:.0f}M"
    return (f"whole-run peak RSS / training peak, full fine-tune of a {model}-parameter Llama with checkpoints and "
            f"the final model",
            "—" if eager is None else f"previous writer: {_x(eager['whole_over_training'])}×",
            ", ".join(f"{r['backend']}: {_x(r['whole_over_training'])}×" for r in ours))


def moe_grouped_row(d: dict) -> tuple[str, str, str]:
    rows = {(r["backend"], r["variant"], r["train_weights"]): r for r in d["rows"]}
    a, r = d["arguments"], d["ratios"]
    eager, dense, grouped = (rows[("torch", v, True)] for v in ("eager", "dense", "grouped"))
    return (f"MoE block fwd+bwd, H {a['hidden']:,}, {a['experts']} experts × {a['expert_intermediate']}, "
            f"top-{a['top_k']}, {a['tokens']:,} tokens",
            f"per-expert loop: {_mib(eager['peak_bytes'])}, {eager['median_seconds']:.2f} s; dense MLP (same active "
            f"parameters): {_mib(dense['peak_bytes'])}",
            f"twinseq's grouped kernel: activations {_x(r['torch_activation_memory_vs_dense'])}× dense "
            f"(transformers' grouped_mm {_x(r['torch_hf_grouped_mm_activation_memory_vs_dense'])}×), with the "
            f"{a['experts'] // a['top_k']}× larger expert weight gradients {_mib(grouped['peak_bytes'])} ({_x(r['torch_memory_vs_dense'])}×); "
            f"{r['torch_speedup_vs_eager']:.2f}× faster than the loop; jax's kernel: activations "
            f"{_x(r['jax_activation_memory_vs_dense'])}× dense (per-projection grouped matmuls "
            f"{_x(r['jax_per_projection_activation_memory_vs_dense'])}×), {_x(r['jax_memory_vs_dense'])}× with its "
            f"weight gradients, {r['jax_speedup_vs_eager']:.2f}× faster than the loop")


def moe_gpu_row(d: dict) -> tuple[str, str, str]:
    rows = {(r["variant"], r["train_weights"]): r for r in d["results"] if r["status"] == "ok"}
    g, hf, eager = rows[("grouped", True)], rows[("hf_grouped_mm", True)], rows[("eager", True)]
    gf, hff, dense_f = rows[("grouped", False)], rows[("hf_grouped_mm", False)], rows[("dense", False)]
    return (f"MoE layer fwd+bwd, H {d['hidden']:,}, {d['experts']} experts × {d['expert_intermediate']}, "
            f"top-{d['top_k']}, {d['tokens']:,} tokens, {d['dtype']}",
            f"transformers' grouped_mm: {_mib(hf['peak_bytes'])}, {hf['median_seconds'] * 1e3:.1f} ms; per-expert "
            f"loop {eager['median_seconds'] * 1e3:.0f} ms",
            f"twinseq's kernel: {_mib(g['peak_bytes'])} ({_x(g['peak_bytes'] / hf['peak_bytes'])}× grouped_mm), "
            f"{g['median_seconds'] * 1e3:.1f} ms ({_x(g['median_seconds'] / hf['median_seconds'])}× its time, "
            f"{eager['median_seconds'] / g['median_seconds']:.1f}× faster than the loop); frozen weights "
            f"{_x(gf['peak_bytes'] / dense_f['peak_bytes'])}× the dense MLP (grouped_mm "
            f"{_x(hff['peak_bytes'] / dense_f['peak_bytes'])}×)")


def grpo_prefix_sharing_row(d: dict) -> tuple[str, str, str]:
    rows = {r["variant"]: r for r in d["rows"]}
    a, f = d["arguments"], d["logprob_forward"]
    trl, shared = rows["trl"], rows["twinseq:padding_free:fused_linear:gc"]
    return (f"GRPO, prompts of {a['prompt_tokens']} tokens, G {a['generations']} x {a['completion']} completion "
            f"tokens: prefix sharing vs TRL GRPOTrainer (both checkpointing)",
            f"TRL: {_mib(trl['peak_bytes'])}; unshared log-prob forward {f['unshared']['forward_seconds']:.2f} s",
            f"shared: {_mib(shared['peak_bytes'])} ({_x(shared['peak_bytes'] / trl['peak_bytes'])}×), log-prob "
            f"forward {f['unshared']['forward_seconds'] / f['shared']['forward_seconds']:.1f}× faster")


# The README's rows, in its order; every benchmark script in benchmarks/ and benchmarks/gpu/ has one (a test checks).
ROWS: dict[str, Callable[[dict], tuple[str, str, str]]] = {
    "packing": packing_row, "loss_memory": loss_memory_row, "jax_loss_memory": jax_loss_memory_row,
    "memory_techniques": memory_techniques_row, "padding_free": padding_free_row, "torch_vs_jax": torch_vs_jax_row,
    "dpo_memory": dpo_memory_row, "ring_attention": ring_attention_row,
    "memory_planner_check": memory_planner_check_row, "peft_staircase": peft_staircase_row,
    "max_length": max_length_row, "cp_memory": cp_memory_row, "grpo_memory": grpo_memory_row,
    "rloo_memory": grpo_memory_row, "kto_memory": kto_memory_row,
    "loss_kernels": loss_kernels_row, "sft_gpu": sft_gpu_row, "state_staircase_gpu": state_staircase_gpu_row,
    "save_memory": save_memory_row, "dpo_context_parallel": dpo_context_parallel_row,
    "moe_grouped": moe_grouped_row, "moe_gpu": moe_gpu_row,
    "grpo_prefix_sharing": grpo_prefix_sharing_row,
}
# Scripts of benchmarks/gpu/: measured on a GPU only (their CPU smoke runs are tests, never README figures).
GPU_ONLY: dict[str, str] = {
    "loss_kernels": "LM-head loss kernels fwd+bwd: twinseq vs `nll`, TRL, Liger, Cut Cross-Entropy",
    "sft_gpu": "SFT steps: twinseq vs TRL SFTTrainer; activation offloading on/off",
    "state_staircase_gpu": "training state: float32 AdamW -> bf16 state -> 8-bit AdamW -> optimizer in backward",
    "moe_gpu": "one MoE layer fwd+bwd: twinseq's grouped kernel vs transformers' grouped_mm and loop, jax",
}
# Scripts of benchmarks/gpu/ that run a benchmark above in its CUDA mode: their results are that benchmark's files
# (``max_length_<gpu>_<date>.json``), shown in its row's GPU column.
GPU_WRAPPERS: dict[str, str] = {"max_length_gpu": "max_length"}
NOT_ON_GPU = "not yet measured on GPU"


# --- choosing files and rendering -------------------------------------------------------------

def is_gpu_hardware(hardware: str) -> bool:
    """A file's hardware tag names a GPU (``h100-80gb``) rather than a CPU (``cpu-2core``)."""
    return not hardware.startswith("cpu-")


def newest_results(results_dir: Path, gpu: bool = False) -> dict[str, tuple[Path, dict]]:
    """``what -> (path, data)`` of the newest ``<what>_<hardware>_<date>.json`` per benchmark, among the
    CPU files (``gpu=False``) or the GPU files (``gpu=True``, hardware tags other than ``cpu-*``).

    Newest: the later run date (``provenance.started_utc``, else the date in the file name);
    on the same date a file with provenance wins over one without.
    """
    best: dict[str, tuple[tuple, Path, dict]] = {}
    for path in sorted(results_dir.glob("*.json")):
        stem = parse_stem(path.stem)
        if stem is None or stem["what"] not in ROWS or is_gpu_hardware(stem["hardware"]) != gpu:
            continue
        if not gpu and stem["what"] in GPU_ONLY:
            continue
        data = json.loads(path.read_text())
        prov = data.get("provenance")
        key = (prov["date_utc"] if prov else stem["date"], prov is not None,
               prov["started_utc"] if prov else "", path.name)
        if stem["what"] not in best or key > best[stem["what"]][0]:
            best[stem["what"]] = (key, path, data)
    return {what: (path, data) for what, (_, path, data) in best.items()}


def file_cell(path: Path, data: dict, readme_dir: Path) -> str:
    """The result's .md as a link, then its commit, or the markers a reader must see."""
    md = path.with_suffix(".md")
    cell = f"[`{md.name}`]({Path(os.path.relpath(md, readme_dir)).as_posix()})"
    prov = data.get("provenance")
    if prov is None:
        return f"{cell} {NO_PROVENANCE}"
    commit = prov["git"]["commit"]
    notes = [f"commit `{commit[:10]}`" if commit else "**commit unknown**"]
    if prov["git"]["dirty"]:
        notes.append("**dirty tree**")
    if data.get("partial"):
        notes.append(f"**partial run**: {data['partial']}")
    if prov["non_default_arguments"]:
        notes.append("**non-default arguments**: "
                     + ", ".join(f"`{k}={v}`" for k, v in prov["non_default_arguments"].items()))
    return f"{cell} ({', '.join(notes)})"


def _cells(what: str, path: Path, data: dict) -> tuple[str, str, str]:
    try:
        return ROWS[what](data)
    except (KeyError, IndexError, StopIteration, ValueError) as err:
        raise SystemExit(f"{path}: a field the README row needs is missing ({err!r})") from err


def gpu_cell(what: str, cpu_what: str | None, found: dict[str, tuple[Path, dict]], readme_dir: Path) -> str:
    """The GPU column: the newest GPU file's baseline and twinseq figures and its file, or ``NOT_ON_GPU``."""
    if what not in found:
        return NOT_ON_GPU
    path, data = found[what]
    gpu_what, baseline, mine = _cells(what, path, data)
    hardware = parse_stem(path.stem)["hardware"]
    head = f"{gpu_what}: " if gpu_what != cpu_what else ""
    lines_b, lines_m = baseline.split("<br>"), mine.split("<br>")
    figures = ("<br>".join(f"{b} → {m}" for b, m in zip(lines_b, lines_m)) if len(lines_b) == len(lines_m)
               else f"{baseline} → {mine}")
    return f"**{hardware}**: {head}{'<br>' if len(lines_b) > 1 else ''}{figures}; {file_cell(path, data, readme_dir)}"


def render(results_dir: Path = RESULTS_DIR, readme_dir: Path = REPO_ROOT) -> str:
    """The markdown between the markers: the table and a note on where it comes from."""
    found, on_gpu = newest_results(results_dir), newest_results(results_dir, gpu=True)
    lines = ["| what | baseline | twinseq | file | on a GPU: baseline → twinseq |", "|---|---|---|---|---|"]
    for what in ROWS:
        if what in GPU_ONLY:
            cpu, cpu_what = [GPU_ONLY[what], "-", "-", f"GPU only: `benchmarks/gpu/{what}.py`"], None
        elif what not in found:
            cpu, cpu_what = [f"`{what}`", "-", "-", f"no result yet: run `benchmarks/{what}.py`"], None
        else:
            path, data = found[what]
            cells = _cells(what, path, data)
            cpu, cpu_what = [*cells, file_cell(path, data, readme_dir)], cells[0]
        lines.append("| " + " | ".join([*cpu, gpu_cell(what, cpu_what, on_gpu, readme_dir)]) + " |")
    lines += ["", "Generated by `benchmarks/readme_table.py` from the newest `.json` of each benchmark in "
              "`benchmarks/results/`; the hardware and date are in each file name, the commit, command, versions "
              "and hardware details in the file. The first columns come from CPU runs (`cpu-*` files), the last "
              "from GPU runs (any other hardware tag): "
              + (f"{len(on_gpu)} of {len(ROWS)} benchmarks have one." if on_gpu else
                 f"none has been measured on a GPU yet, so every row says \"{NOT_ON_GPU}\".")]
    if any("provenance" not in data for _, data in found.values()):
        lines += ["", "Rows marked *no provenance* come from files written before results recorded their commit, "
                  "command and detected hardware: their figures are as committed, and `make bench` replaces them."]
    return "\n".join(lines)


def splice(readme: str, table: str) -> str:
    """``readme`` with everything between the markers replaced by ``table``."""
    if readme.count(START) != 1 or readme.count(END) != 1 or readme.index(START) > readme.index(END):
        raise SystemExit(f"README must hold exactly one {START} ... {END} block.")
    head, rest = readme.split(START)
    _, tail = rest.split(END)
    return f"{head}{START}\n{table}\n{END}{tail}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="exit 1 if README.md differs from what would be written")
    p.add_argument("--print", dest="print_only", action="store_true", help="print the table, write nothing")
    p.add_argument("--readme", type=Path, default=REPO_ROOT / "README.md")
    p.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    args = p.parse_args(argv)
    table = render(args.results_dir, args.readme.resolve().parent)
    if args.print_only:
        print(table)
        return 0
    current = args.readme.read_text()
    wanted = splice(current, table)
    if args.check:
        if current == wanted:
            return 0
        sys.stdout.writelines(difflib.unified_diff(current.splitlines(True), wanted.splitlines(True),
                                                   str(args.readme), "generated"))
        print(f"\n{args.readme} differs from its results: run `python benchmarks/readme_table.py`.")
        return 1
    if wanted != current:
        args.readme.write_text(wanted)
        print(f"wrote the benchmark table into {args.readme}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
