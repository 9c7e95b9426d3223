"""The full fine-tune's training-state staircase on one GPU: float32 AdamW, then bfloat16 state, 8-bit moments and
optimizer-in-backward, each added to the previous; peak memory, tokens/s and the loss after ``--steps`` steps.

Every rung is a fresh ``twinseq train`` subprocess (``benchmarks/_train_peak.py``) of the same model (built from its
config, weights drawn by ``common.models.init.init_weights`` with the run's seed) on the same packed rows of the
embedded SFT data, with ``benchmarks/gpu/sft_gpu.py``'s twinseq settings (packing + padding-free, ``varlen``
attention, the fused loss, gradient checkpointing, bfloat16 autocast):

- ``float32``: float32 weights and gradients, ``torch.optim.AdamW`` (fused): 16 bytes per parameter;
- ``bf16-state``: ``--optimizer adamw_bf16``: bfloat16 weights, gradients and moments, stochastically rounded (8);
- ``bf16-8bit``: ``--optimizer adamw_bf16_8bit``: those weights with 8-bit blockwise moments (about 6);
- ``bf16-8bit-in-backward``: ``--optimizer-in-backward``: each parameter steps in its gradient's hook, so one
  gradient is alive at a time (about 4).

Every rung runs without gradient clipping (``--max-grad-norm None``, which optimizer-in-backward needs), so the rungs
differ in their training state only. Peak: ``torch.cuda.max_memory_allocated`` over the steps minus the bytes
allocated before the model was built. tokens/s: over the steps after ``--warmup-steps``. Loss: the mean of the last 5
steps, against the float32 rung's.

    python benchmarks/gpu/state_staircase_gpu.py --out DIR                # llama-3.2-3b config, 50 steps a rung
    python benchmarks/gpu/state_staircase_gpu.py --smoke --no-write       # tiny model, a few steps, CPU or GPU
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from _report import MIB, acceptance_line, add_output_args, markdown_table, start_run  # noqa: E402
from _train_peak import measure  # noqa: E402
from sft_gpu import DEFAULT_MODEL, _resolve, _summary, _version, twinseq_values  # noqa: E402

RUNGS = {
    "float32": {},
    "bf16-state": dict(optimizer="adamw_bf16"),
    "bf16-8bit": dict(optimizer="adamw_bf16_8bit"),
    "bf16-8bit-in-backward": dict(optimizer="adamw_bf16_8bit", optimizer_in_backward=True),
}
SMOKE = dict(model="tiny", max_length=128, rows=2, steps=6, warmup_steps=1)
LAST = 5
"""Steps whose mean loss is compared."""


def run_rung(name: str, args: argparse.Namespace) -> dict[str, Any]:
    args.twinseq_attn, args.twinseq_loss = args.attn, args.loss
    values = dict(twinseq_values(args, offload=False), max_grad_norm=None, **RUNGS[name])
    try:
        rec = measure(values, max_steps=args.steps, timeout=args.timeout, threads=args.threads, skip_saves=True)
    except Exception as err:  # noqa: BLE001 - a rung that fails is reported with its reason
        return {"rung": name, "status": "failed", "error": str(err).strip().splitlines()[-1][:300], "config": values}
    out = _summary(rec["step_seconds"], rec["num_tokens"], rec["peak_bytes"], args.warmup_steps)
    losses = rec.get("loss", [])
    out.update(rung=name, status="ok", config=values, command=rec["command"], measured_on=rec.get("device", "cpu"),
               losses=losses, first_loss=losses[0] if losses else None,
               last_loss=sum(losses[-LAST:]) / len(losses[-LAST:]) if losses else None)
    return out


def markdown(meta: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    base = next((r for r in rows if r["rung"] == "float32" and r["status"] == "ok"), None)
    table = []
    for r in rows:
        if r["status"] != "ok":
            table.append([r["rung"], "failed", "", "", "", "", r["error"]])
            continue
        vs = f"{r['peak_bytes'] / base['peak_bytes']:.2f}" if base else ""
        loss_vs = f"{100 * (r['last_loss'] / base['last_loss'] - 1):+.2f} %" if base else ""
        table.append([r["rung"], f"{r['peak_bytes'] / MIB:,.0f}", vs, f"{r['tokens_per_second']:,.0f}",
                      f"{r['first_loss']:.4f} -> {r['last_loss']:.4f}", loss_vs, ""])
    lines = [
        f"Model `{meta['model']}` ({meta['parameters'] / 1e9:.2f}B parameters, random init), {meta['rows']} packed "
        f"rows x {meta['max_length']:,} tokens a step, {meta['steps']} steps a rung, learning rate "
        f"{meta['learning_rate']:g} (constant), no gradient clipping, device `{meta['device']}`. "
        f"Memory: {meta['memory_method']}. Loss: first step -> mean of the last {LAST}.",
        "",
        *markdown_table(["rung", "peak MiB", "vs float32", "tokens/s", "loss", "last loss vs float32", "note"],
                        table, "lrrrrrl"),
    ]
    if meta["acceptance"]:
        lines += ["", acceptance_line(meta["acceptance"])]
    lines += ["", "Commands:", ""] + [f"- {r['rung']}: `{r['command']}`" for r in rows if r["status"] == "ok"]
    return "\n".join(lines) + "\n"


def acceptance(rows: list[dict[str, Any]]) -> dict[str, bool]:
    ok = {r["rung"]: r for r in rows if r["status"] == "ok"}
    last, base = ok.get("bf16-8bit-in-backward"), ok.get("float32")
    if not (last and base):
        return {}
    return {
        "bf16 + 8-bit + in-backward peak <= 0.5x float32": last["peak_bytes"] <= 0.5 * base["peak_bytes"],
        "its loss within 2 % of float32's": abs(last["last_loss"] / base["last_loss"] - 1) <= 0.02,
    }


def _parse(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL, help="a preset or a folder with a config.json (random init)")
    p.add_argument("--max-length", type=int, default=4096, help="tokens per packed row")
    p.add_argument("--rows", type=int, default=2, help="packed rows per optimizer step")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--warmup-steps", type=int, default=3, help="steps left out of tokens/s")
    p.add_argument("--learning-rate", type=float, default=3e-5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rungs", default=",".join(RUNGS))
    p.add_argument("--attn", default="varlen", help="attn_implementation")
    p.add_argument("--loss", default="auto", help="loss_type (auto: as sft_gpu.py)")
    p.add_argument("--threads", type=int, default=min(os.cpu_count() or 1, 16))
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per rung")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--smoke", action="store_true", help=f"a tiny run that works anywhere ({SMOKE})")
    add_output_args(p)
    return p.parse_args(argv)


def _resolve_rungs(args: argparse.Namespace) -> str:
    unknown = [r for r in args.rungs.split(",") if r and r not in RUNGS]
    if unknown:
        raise SystemExit(f"--rungs: unknown {unknown}; choose from {tuple(RUNGS)}")
    args.setups = ""  # (sft_gpu's _resolve checks its own setups)
    device = _resolve(args)  # --device auto -> cuda or cpu; with --smoke it sets sft_gpu's smoke sizes
    if args.smoke:
        for key, value in SMOKE.items():
            setattr(args, key, value)
    return device


def main(argv: Optional[Sequence[str]] = None) -> dict:
    from twinseq.common.models.configs import resolve_model_config
    from twinseq.common.models.init import parameter_shapes

    run = start_run(_parse, argv, __file__, device=_resolve_rungs)
    args = run.args
    parameters = sum(math.prod(s) for s in parameter_shapes(resolve_model_config(args.model)).values())
    rows: list[dict[str, Any]] = []
    payload: dict[str, Any] = {}
    for name in (r for r in args.rungs.split(",") if r):
        rows.append(run_rung(name, args))
        meta = {"model": Path(args.model).name, "parameters": parameters, "rows": args.rows,
                "max_length": args.max_length, "steps": args.steps, "learning_rate": args.learning_rate,
                "device": args.device, "acceptance": acceptance(rows),
                "memory_method": ("torch.cuda.max_memory_allocated over the steps minus the bytes allocated before "
                                  "the model was built" if args.device == "cuda"
                                  else "peak RSS over the steps above the RSS before the model was built"),
                "packages": {p: _version(p) for p in ("torch", "transformers", "triton")}}
        payload = {**meta, "arguments": run.arguments(), "results": rows}
        run.provenance.pop("finished_utc", None)  # each write stamps the end anew: the last one is the run's end
        run.write(payload, title="Training-state staircase on one GPU: float32, bf16 state, 8-bit AdamW, "
                  "optimizer-in-backward", body=markdown(meta, rows))
    return payload


if __name__ == "__main__":
    main()
