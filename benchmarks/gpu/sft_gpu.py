"""SFT steps on one GPU: twinseq against TRL's SFTTrainer, same weights and data, bf16, packed 4,096-token rows;
and activation offloading on and off.

Every setup is a fresh subprocess that trains ``--steps`` optimizer steps of the same model (built from its
config, weights drawn by ``common.models.init.init_weights`` with the run's seed: no download), on the same rows: the
embedded SFT data, tokenised by ``common.data.prepare.prepare_sft_dataset`` (prompt-completion, loss on the completion).

- ``twinseq``: ``twinseq train`` with its best settings: packing (bfd) + padding-free rows, the document-masked
  ``--twinseq-attn`` attention, the fused loss (``--twinseq-loss auto``: ``triton`` when this commit has it, else
  ``liger`` when liger-kernel imports on CUDA, else ``fused_linear``), gradient checkpointing, bf16 autocast over
  fp32 parameters. Measured in the run's own code path by ``benchmarks/_train_peak.py`` (on CUDA its peak is
  ``torch.cuda.max_memory_allocated`` over the steps minus the bytes allocated before the model was built).
- ``twinseq-bf16``: the same with ``optimizer="adamw_bf16"``: bfloat16 weights, gradients and AdamW moments with
  stochastically rounded writes (8 bytes of training state per parameter instead of 16; ``torch_backend/bf16_adamw.py``).
- ``twinseq-offload``: the same with ``activation_offloading`` (checkpointing stays on): peak memory and step time
  against ``twinseq``. CUDA only (twinseq refuses it on a CPU).
- ``twinseq-bf16-offload``: ``twinseq-bf16`` with ``activation_offloading``, against ``twinseq-bf16``. With float32
  state the step's peak is in the optimizer step, where no activation is alive; with the bfloat16 state the
  activations are a larger share of it. Offloading is reported (memory and step time), not held to a bar.
- ``trl``: ``SFTTrainer`` with its best memory settings: ``packing=True, packing_strategy="bfd"``,
  ``padding_free=True``, ``gradient_checkpointing=True``, ``bf16=True``, ``use_liger_kernel`` when liger-kernel
  is installed, ``--trl-attn`` attention; the same fp32 model, the same pre-tokenised rows (TRL packs them itself),
  the same rows per step and learning rate. Peak: the same ``max_memory_allocated`` rule, from a callback.

Throughput: tokens fed per second over the steps after ``--warmup-steps`` (compilation, autotuning, allocator
growth happen there), from each step's own timer (``torch.cuda.synchronize`` before and after); the tokens are
the non-padding input tokens of the step. Ratios are twinseq over TRL.

    python benchmarks/gpu/sft_gpu.py --out DIR                      # llama-3.2-3b config, 4,096-token rows
    python benchmarks/gpu/sft_gpu.py --smoke --no-write             # tiny model, short rows, CPU or GPU
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional, Sequence

HERE = Path(__file__).resolve().parent
BENCH = HERE.parent
sys.path.insert(0, str(BENCH))

from _report import MIB, acceptance_line, add_output_args, markdown_table, start_run  # noqa: E402
from _train_peak import _MARKER, measure  # noqa: E402

DEFAULT_MODEL = str(BENCH / "models" / "llama-3.2-3b")
SETUPS = ("twinseq", "twinseq-bf16", "twinseq-offload", "twinseq-bf16-offload", "trl")
# each offloading setup and the setup it is measured against, with the key prefix of its ratios
OFFLOAD_PAIRS = (("twinseq-offload", "twinseq", "offload"), ("twinseq-bf16-offload", "twinseq-bf16", "bf16_offload"))
SMOKE = dict(model="tiny", max_length=128, rows=2, steps=3, warmup_steps=1)
PACKAGES = ("torch", "transformers", "trl", "liger-kernel", "accelerate", "datasets")


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _liger_usable(device: str) -> bool:
    return device == "cuda" and importlib.util.find_spec("liger_kernel") is not None


def twinseq_loss(choice: str, device: str) -> str:
    """``auto``: ``triton`` if this commit's LOSS_TYPES has it (CUDA), else ``liger`` (CUDA + liger-kernel), else
    ``fused_linear``; any other value is used as given."""
    from twinseq.common.config import LOSS_TYPES

    if choice != "auto":
        return choice
    if device == "cuda" and "triton" in LOSS_TYPES and importlib.util.find_spec("triton") is not None:
        return "triton"
    if _liger_usable(device) and "liger" in LOSS_TYPES:
        return "liger"
    return "fused_linear"


def data_values(args: argparse.Namespace) -> dict[str, Any]:
    """The data flags both sides share (twinseq train's flat config names)."""
    return dict(model_config=args.model, dataset_name="embedded", max_length=args.max_length, packing=True,
                packing_strategy="bfd", padding_free=True, per_device_train_batch_size=args.rows,
                learning_rate=args.learning_rate, lr_scheduler_type="constant", seed=args.seed)


def twinseq_values(args: argparse.Namespace, offload: bool, bf16_state: bool = False) -> dict[str, Any]:
    return dict(data_values(args), init_weights="random", backend="torch",
                dtype="bfloat16" if args.device == "cuda" else "float32",
                attn_implementation=args.twinseq_attn, loss_type=twinseq_loss(args.twinseq_loss, args.device),
                gradient_checkpointing=True, activation_offloading=offload,
                **({"optimizer": "adamw_bf16"} if bf16_state else {}))


def _summary(step_seconds: list[float], step_tokens: list[int], peak: int, warmup: int) -> dict[str, Any]:
    """Tokens/s over the steps after the warmup (all steps when there are no more)."""
    keep = slice(warmup, None) if len(step_seconds) > warmup else slice(None)
    seconds, tokens = step_seconds[keep], step_tokens[keep]
    ordered = sorted(seconds)
    return {"peak_bytes": int(peak), "step_seconds": step_seconds, "step_tokens": step_tokens,
            "median_step_seconds": ordered[len(ordered) // 2], "tokens_per_second": sum(tokens) / sum(seconds),
            "measured_steps": len(seconds)}


def run_twinseq(args: argparse.Namespace, offload: bool, bf16_state: bool = False) -> dict[str, Any]:
    values = twinseq_values(args, offload, bf16_state)
    rec = measure(values, max_steps=args.steps, timeout=args.timeout, threads=args.threads, skip_saves=True)
    out = _summary(rec["step_seconds"], rec["num_tokens"], rec["peak_bytes"], args.warmup_steps)
    out.update(config=values, command=rec["command"], measured_on=rec.get("device", "cpu"),
               build_peak_bytes=rec.get("build_peak_bytes"),
               resident_before_steps_bytes=rec.get("resident_before_steps_bytes"))
    return out


def run_trl(args: argparse.Namespace) -> dict[str, Any]:
    spec = {**data_values(args), "steps": args.steps, "attn": args.trl_attn,
            "liger": {"auto": _liger_usable(args.device), "on": True, "off": False}[args.trl_liger],
            "device": args.device}
    env = dict(os.environ)
    env["TWINSEQ_MEASURE_THREADS"] = str(args.threads)
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child-trl", json.dumps(spec)],
                          capture_output=True, text=True, timeout=args.timeout, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(_MARKER)]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"TRL run failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    rec = json.loads(lines[-1][len(_MARKER):])
    out = _summary(rec["step_seconds"], rec["step_tokens"], rec["peak_bytes"], args.warmup_steps)
    out.update(config=rec["config"], command=rec["command"], measured_on=rec["device"])
    return out


def _child_trl(spec: dict[str, Any]) -> None:
    """``SFTTrainer`` on the same model and rows; per step: seconds, tokens fed, peak memory (see the docstring)."""
    import gc

    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    from twinseq.common.config import TrainConfig
    from twinseq.common.data.prepare import prepare_sft_dataset
    from twinseq.common.models.init import init_weights
    from twinseq.common.models.configs import resolve_model_config
    from twinseq.common.data.tokenizer import embedded_tokenizer_dir
    from twinseq.torch_backend.model import build_model

    torch.set_num_threads(int(os.environ.get("TWINSEQ_MEASURE_THREADS", "2")))
    cuda = spec["device"] == "cuda"
    flat = {k: spec[k] for k in ("model_config", "dataset_name", "max_length", "packing", "packing_strategy",
                                 "padding_free", "per_device_train_batch_size", "seed")}
    cfg = TrainConfig.from_flat(**flat, disable_tqdm=True)
    rows, _, _ = prepare_sft_dataset(cfg)  # the rows twinseq trains on, before packing
    dataset = rows if isinstance(rows, Dataset) else Dataset.from_list(list(rows))
    tokenizer = AutoTokenizer.from_pretrained(str(embedded_tokenizer_dir()))
    model_cfg = resolve_model_config(spec["model_config"])
    gc.collect()
    if cuda:
        torch.cuda.synchronize()
        baseline = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    model = build_model(model_cfg, init_weights(model_cfg, seed=spec["seed"]), attn_implementation=spec["attn"])
    model = model.to("cuda" if cuda else "cpu")
    rec: dict[str, Any] = {"step_seconds": [], "step_tokens": [], "peaks": [], "device": spec["device"]}

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    class Steps(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            sync()
            rec["t0"], rec["seen0"] = time.perf_counter(), int(state.num_input_tokens_seen)

        def on_step_end(self, args, state, control, **kwargs):
            sync()
            rec["step_seconds"].append(time.perf_counter() - rec["t0"])
            rec["step_tokens"].append(int(state.num_input_tokens_seen) - rec["seen0"])
            if cuda:
                rec["peaks"].append(int(torch.cuda.max_memory_allocated()) - baseline)

    config = dict(output_dir=tempfile.mkdtemp(prefix="twinseq-trl-sft-"), max_steps=spec["steps"],
                  per_device_train_batch_size=spec["per_device_train_batch_size"], max_length=spec["max_length"],
                  packing=True, packing_strategy="bfd", padding_free=True, completion_only_loss=True,
                  gradient_checkpointing=True, bf16=cuda, use_cpu=not cuda, use_liger_kernel=spec["liger"],
                  learning_rate=spec["learning_rate"], lr_scheduler_type="constant", seed=spec["seed"],
                  include_num_input_tokens_seen="non_padding", report_to=[], save_strategy="no", disable_tqdm=True,
                  dataloader_num_workers=0)
    SFTTrainer(model=model, args=SFTConfig(**config), train_dataset=dataset, processing_class=tokenizer,
               callbacks=[Steps()]).train()
    if cuda:
        rec["peak_bytes"] = max(rec["peaks"])
    else:  # memory is compared on the GPU only; the CPU smoke run checks the plumbing
        rec["peak_bytes"] = 0
    rec["config"] = {k: v for k, v in config.items() if k != "output_dir"} | {"attn_implementation": spec["attn"],
                                                                              "model": spec["model_config"]}
    rec["command"] = "trl SFTTrainer(model, SFTConfig(" + ", ".join(f"{k}={v!r}" for k, v in rec["config"].items()
                                                                    if k != "model") + "))"
    print(_MARKER + json.dumps(rec), flush=True)


# --- the driver ---------------------------------------------------------------------------------------------

def measure_setup(name: str, args: argparse.Namespace) -> dict[str, Any]:
    row: dict[str, Any] = {"setup": name}
    if name.endswith("-offload") and args.device != "cuda":
        row.update(status="skipped", reason="activation offloading moves activations from the GPU to the host; "
                                            "twinseq refuses it on a CPU")
    elif name == "trl" and importlib.util.find_spec("trl") is None:
        row.update(status="skipped", reason="trl is not installed")
    else:
        t0 = time.perf_counter()
        try:
            got = (run_trl(args) if name == "trl"
                   else run_twinseq(args, offload=name.endswith("-offload"), bf16_state=name.startswith("twinseq-bf16")))
            row.update(status="ok", **got)
        except Exception as err:  # noqa: BLE001 - an out-of-memory or a failed run is a row, not the end
            row.update(status="failed", reason=str(err).strip()[-1500:])
        row["wall_seconds"] = time.perf_counter() - t0
    if row["status"] == "ok":
        print(f"{name:>16}: {row['tokens_per_second']:10,.0f} tok/s  step {row['median_step_seconds']:.3f} s  "
              f"peak {row['peak_bytes'] / MIB:10,.0f} MiB  ({row['wall_seconds']:.0f} s)", flush=True)
    else:
        print(f"{name:>16}: {row['status']}: {row['reason'][-600:]}", flush=True)
    return row


def ratios(rows: list[dict]) -> dict[str, float]:
    ok = {r["setup"]: r for r in rows if r["status"] == "ok"}
    out: dict[str, float] = {}
    for mine in ("twinseq", "twinseq-bf16"):
        key = mine.replace("-", "_")
        if mine in ok and "trl" in ok:
            out[f"{key}_over_trl_tokens_per_second"] = ok[mine]["tokens_per_second"] / ok["trl"]["tokens_per_second"]
            if ok["trl"]["peak_bytes"]:
                out[f"{key}_over_trl_peak"] = ok[mine]["peak_bytes"] / ok["trl"]["peak_bytes"]
    for on, off, key in OFFLOAD_PAIRS:
        if on in ok and off in ok and ok[off]["peak_bytes"]:
            out[f"{key}_over_no_offload_peak"] = ok[on]["peak_bytes"] / ok[off]["peak_bytes"]
            out[f"{key}_over_no_offload_step_time"] = ok[on]["median_step_seconds"] / ok[off]["median_step_seconds"]
    return out


def acceptance(r: dict[str, float], device: str) -> dict[str, bool]:
    """Issue 16's bars, checked on a GPU run only (CPU smoke figures mean nothing for them)."""
    if device != "cuda":
        return {}
    checks = {}
    for mine in ("twinseq", "twinseq-bf16"):
        key = mine.replace("-", "_")
        if f"{key}_over_trl_tokens_per_second" in r and f"{key}_over_trl_peak" in r:
            checks[f"{mine} >= 1.3x TRL tokens/s"] = r[f"{key}_over_trl_tokens_per_second"] >= 1.3
            checks[f"{mine} peak <= 0.7x TRL"] = r[f"{key}_over_trl_peak"] <= 0.7
    return checks


def markdown(meta: dict, rows: list[dict]) -> str:
    lines = [f"`{meta['model']}` ({meta['parameters'] / 1e6:,.1f} M parameters, random init), "
             f"{meta['rows']} packed row(s) of {meta['max_length']:,} tokens per step, {meta['steps']} steps, "
             f"tokens/s over the steps after the first {meta['warmup_steps']}; {meta['device']}. Peak: "
             f"{meta['memory_method']}.", ""]
    table = []
    for r in rows:
        if r["status"] != "ok":
            table.append([r["setup"], r["status"], "-", "-", "-", "-", r["reason"].splitlines()[-1][:200]
                          .replace("|", "\\|")])
            continue
        c = r["config"]
        if r["setup"] == "trl":  # TRL >= 1.x: its chunked LM head; use_liger_kernel adds Liger's layer kernels
            how = (f"attn {c.get('attn_implementation')}, loss TRL chunked log-probs"
                   + (", Liger layer kernels" if c.get("use_liger_kernel") else "")
                   + ", float32 weights + AdamW state")
        else:
            how = (f"attn {c.get('attn_implementation')}, loss {c.get('loss_type')}, checkpointing"
                   + (", offloading" if c.get("activation_offloading") else "")
                   + (", bfloat16 weights + AdamW state (adamw_bf16)" if c.get("optimizer") == "adamw_bf16"
                      else ", float32 weights + AdamW state"))
        table.append([r["setup"], "ok", f"{r['tokens_per_second']:,.0f}", f"{r['median_step_seconds']:.3f}",
                      f"{r['peak_bytes'] / MIB:,.0f}" if r["peak_bytes"] else "-", r["measured_steps"], how])
    lines += markdown_table(["setup", "status", "tokens/s", "step s (median)", "peak MiB", "steps measured",
                             "settings"], table, "llrrrrl")
    r = meta["ratios"]
    if r:
        lines += ["", "Ratios: " + ", ".join(f"{k.replace('_', ' ')} **{v:.2f}**" for k, v in r.items())]
    if meta["acceptance"]:
        lines += ["", acceptance_line(meta["acceptance"])]
    lines += ["", "Commands:", ""] + [f"- {r['setup']}: `{r['command']}`" for r in rows if r["status"] == "ok"]
    return "\n".join(lines) + "\n"


def _parse(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL, help="a preset or a folder with a config.json (random init)")
    p.add_argument("--max-length", type=int, default=4096, help="tokens per packed row")
    p.add_argument("--rows", type=int, default=2, help="packed rows per optimizer step")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup-steps", type=int, default=3, help="steps left out of tokens/s")
    p.add_argument("--learning-rate", type=float, default=1e-5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--setups", default=",".join(SETUPS))
    p.add_argument("--twinseq-attn", default="varlen", help="attn_implementation of the twinseq runs")
    p.add_argument("--twinseq-loss", default="auto", help="loss_type of the twinseq runs (auto: see the docstring)")
    p.add_argument("--trl-attn", default="sdpa", help="attn_implementation of the TRL model")
    p.add_argument("--trl-liger", choices=("auto", "on", "off"), default="auto")
    p.add_argument("--threads", type=int, default=min(os.cpu_count() or 1, 16))
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per setup")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--smoke", action="store_true", help=f"a tiny run that works anywhere ({SMOKE})")
    add_output_args(p)
    return p.parse_args(argv)


def _resolve(args: argparse.Namespace) -> str:
    import torch

    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cpu" and torch.cuda.is_available():
        raise SystemExit("--device cpu on a machine with a GPU: the twinseq trainer would still pick the GPU; "
                         "hide it with CUDA_VISIBLE_DEVICES= instead")
    if args.smoke:
        for key, value in SMOKE.items():
            setattr(args, key, value)
    unknown = [s for s in args.setups.split(",") if s and s not in SETUPS]
    if unknown:
        raise SystemExit(f"--setups: unknown {unknown}; choose from {SETUPS}")
    return args.device


def main(argv: Optional[Sequence[str]] = None) -> dict:
    from twinseq.common.models.init import parameter_shapes
    from twinseq.common.models.configs import resolve_model_config

    run = start_run(_parse, argv, __file__, device=_resolve)
    args = run.args
    model_cfg = resolve_model_config(args.model)
    parameters = sum(math.prod(s) for s in parameter_shapes(model_cfg).values())
    rows: list[dict] = []
    payload = _payload(run, args, parameters, rows) if not args.setups.strip(",") else {}
    for name in (n for n in args.setups.split(",") if n):
        rows.append(measure_setup(name, args))
        payload = _payload(run, args, parameters, rows)  # written after every setup: a cut run keeps its rows
    return payload


def _payload(run: Any, args: argparse.Namespace, parameters: int, rows: list[dict]) -> dict:
    r = ratios(rows)
    meta = {"model": Path(args.model).name, "parameters": parameters, "rows": args.rows,
            "max_length": args.max_length, "steps": args.steps, "warmup_steps": args.warmup_steps,
            "device": args.device, "ratios": r, "acceptance": acceptance(r, args.device),
            "memory_method": ("torch.cuda.max_memory_allocated over the steps minus the bytes allocated before the "
                              "model was built (parameters, gradients, optimizer state, activations)"
                              if args.device == "cuda" else "twinseq: peak RSS above the pre-model RSS; TRL: not "
                              "measured on CPU"),
            "packages": {p: _version(p) for p in PACKAGES}}
    payload = {**meta, "arguments": run.arguments(), "results": rows}
    run.provenance.pop("finished_utc", None)  # each write stamps the end anew: the last one is the run's end
    run.write(payload, title="SFT on one GPU: twinseq vs TRL, activation offloading", body=markdown(meta, rows))
    return payload


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--child-trl":
        _child_trl(json.loads(sys.argv[2]))
    else:
        main()
