"""Peak memory of a real ``twinseq train`` run, measured in the run's own code path (a subprocess per run).

- torch (CPU): the child runs ``twinseq.common.cli.main(["train", ...])`` unchanged, with two hooks:
  just before ``build_causal_lm`` it takes the RSS (framework imports + tokenizer + data already built: the
  *baseline*, reported separately) and resets the kernel's high-water mark (``/proc/self/clear_refs``);
  right before the first optimizer step it reads the high-water mark (the *build* peak: model
  construction, e.g. numpy weights copied into torch) and resets it again; after every step it reads it.
  The *training* peak is the largest high-water mark over the steps, minus the baseline; the final save
  (numpy copies for the checkpoint) comes after the last step and is not part of it.
- jax: the child runs the same ``twinseq train --backend jax`` with ``grads_jit`` and ``apply_updates``
  wrapped: each call is first lowered and compiled with the call's own arguments and its
  ``compiled.memory_analysis()`` recorded (argument + output + temp - alias bytes). The training peak is
  ``max(grads phase + optimizer-state bytes (live, not an argument), update phase)``.

- torch on CUDA (the trainer picks the GPU when torch sees one): the same hooks read
  ``torch.cuda.max_memory_allocated`` instead; ``peak_bytes`` is the largest value over the steps minus the bytes
  allocated at the baseline (parameters, gradients, optimizer state and activations are inside it), and the step
  times are taken after ``torch.cuda.synchronize()``. The RSS figures are kept under ``rss_*`` keys.

Used by ``memory_planner_check.py``, ``peft_staircase.py``, ``gpu/sft_gpu.py`` and the tests. ``measure(flags)`` returns a
dict (``peak_bytes``, ``baseline_rss_bytes``, ``build_peak_bytes``, ``seconds_per_step``, ...).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional, Sequence

HERE = Path(__file__).resolve().parent
_MARKER = "__TRAIN_PEAK__ "
_NO_SAVE = "TWINSEQ_MEASURE_NO_SAVE"


def flags_of(values: dict[str, Any]) -> list[str]:
    """``{"max_length": 512, "packing": True}`` -> ``["--max-length", "512", "--packing"]``; a None value is passed as
    ``None`` when the field's default is not None (``max_grad_norm=None`` turns clipping off), else left out."""
    from twinseq.common.config import TrainConfig

    defaults = TrainConfig().to_flat_dict()
    out: list[str] = []
    for key, value in values.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            out.append(flag if value else "--no-" + key.replace("_", "-"))
        elif isinstance(value, (list, tuple)):
            out += [flag, *map(str, value)]
        elif value is not None:
            out += [flag, str(value)]
        elif defaults.get(key) is not None:
            out += [flag, "None"]
    return out


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_hwm() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _child_torch(argv: list[str]) -> dict[str, Any]:
    import gc
    import time

    import torch

    from twinseq.common.cli import main
    from twinseq.torch_backend import trainer as tt

    rec: dict[str, Any] = {"step_hwm": [], "step_seconds": [], "device": "cpu"}
    build = tt.build_causal_lm
    cuda = torch.cuda.is_available()

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def build_hooked(*args, **kwargs):
        # framework code the build imports lazily belongs to the baseline, not to the model
        import transformers  # noqa: F401
        from transformers import AutoConfig, AutoModelForCausalLM  # noqa: F401
        import transformers.models.llama.modeling_llama  # noqa: F401
        for optional in ("peft", "bitsandbytes", "twinseq.torch_backend.peft"):  # PEFT runs import them lazily
            try:
                __import__(optional)
            except ImportError:
                pass
        gc.collect()
        rec["baseline_rss_bytes"] = _status("VmRSS")
        _reset_hwm()
        if cuda:
            sync()
            rec["device"] = "cuda"
            rec["cuda_baseline_bytes"] = int(torch.cuda.memory_allocated())
            torch.cuda.reset_peak_memory_stats()
        return build(*args, **kwargs)

    step = tt.TorchTrainer.step

    def step_hooked(self, micro_batches):
        if "build_hwm" not in rec:
            rec["trainable_parameters"] = int(sum(p.numel() for p in self.module.parameters() if p.requires_grad))
            gc.collect()
            rec["build_hwm"] = _status("VmHWM")
            rec["before_steps_rss_bytes"] = _status("VmRSS")
            _reset_hwm()
            if cuda:
                sync()
                rec["cuda_build_peak_bytes"] = int(torch.cuda.max_memory_allocated())
                rec["cuda_before_steps_bytes"] = int(torch.cuda.memory_allocated())
                rec["cuda_step_peak"] = []
                torch.cuda.reset_peak_memory_stats()
        sync()
        t0 = time.perf_counter()
        out = step(self, micro_batches)
        sync()
        rec["step_seconds"].append(time.perf_counter() - t0)
        rec["step_hwm"].append(_status("VmHWM"))
        if cuda:
            rec["cuda_step_peak"].append(int(torch.cuda.max_memory_allocated()))
        rec.setdefault("num_tokens", []).append(int(out.get("num_tokens", 0)))
        rec.setdefault("loss", []).append(float(out.get("loss", float("nan"))))
        return out

    tt.build_causal_lm, tt.TorchTrainer.step = build_hooked, step_hooked
    if os.environ.get(_NO_SAVE) == "1":  # the end-of-run checkpoint and final model come after every measured step
        from twinseq.common.run import runner

        runner._save = lambda *args, **kwargs: None
        tt.TorchTrainer.save_final = lambda self, path: None
    torch.set_num_threads(int(os.environ.get("TWINSEQ_MEASURE_THREADS", "2")))
    code = main(["train", *argv])
    if code != 0:
        raise SystemExit(code)
    base = rec["baseline_rss_bytes"]
    rec["peak_bytes"] = max(rec["step_hwm"]) - base
    rec["build_peak_bytes"] = rec["build_hwm"] - base
    rec["resident_before_steps_bytes"] = rec["before_steps_rss_bytes"] - base
    if cuda:
        for key in ("peak_bytes", "build_peak_bytes", "resident_before_steps_bytes"):
            rec["rss_" + key] = rec[key]
        base = rec["cuda_baseline_bytes"]
        rec["peak_bytes"] = max(rec["cuda_step_peak"]) - base
        rec["build_peak_bytes"] = rec["cuda_build_peak_bytes"] - base
        rec["resident_before_steps_bytes"] = rec["cuda_before_steps_bytes"] - base
    return rec


def _tree_bytes(tree) -> int:
    import jax

    return int(sum(getattr(x, "nbytes", 0) for x in jax.tree.leaves(tree)))


def _analysis_bytes(compiled) -> dict[str, int]:
    ma = compiled.memory_analysis()
    out = {k: int(getattr(ma, k + "_size_in_bytes")) for k in ("argument", "output", "temp", "alias")}
    out["total"] = out["argument"] + out["output"] + out["temp"] - out["alias"]
    return out


def _child_jax(argv: list[str]) -> dict[str, Any]:
    import time

    import jax

    from twinseq.common.cli import main
    from twinseq.jax_backend import trainer as jt

    rec: dict[str, Any] = {"grads": [], "update": [], "step_seconds": []}
    grads_jit, apply_updates = jt.grads_jit, jt.apply_updates

    def grads_hooked(graphdef, state, inputs, num_items, **kwargs):
        compiled = grads_jit.lower(graphdef, state, inputs, num_items, **kwargs).compile()
        rec["grads"].append(_analysis_bytes(compiled))
        return grads_jit(graphdef, state, inputs, num_items, **kwargs)

    def update_hooked(optimizer, params, opt_state, grads):
        compiled = apply_updates.lower(optimizer, params, opt_state, grads).compile()
        rec["update"].append(_analysis_bytes(compiled))
        return apply_updates(optimizer, params, opt_state, grads)

    step = jt.JaxTrainer.step

    def step_hooked(self, micro_batches):
        rec["opt_state_bytes"] = _tree_bytes(self.opt_state)
        rec["params_bytes"] = _tree_bytes(self.params)
        rec["trainable_parameters"] = int(sum(x.size for x in jax.tree.leaves(self.params)))
        t0 = time.perf_counter()
        out = step(self, micro_batches)
        rec["step_seconds"].append(time.perf_counter() - t0)
        rec.setdefault("num_tokens", []).append(int(out.get("num_tokens", 0)))
        rec.setdefault("loss", []).append(float(out.get("loss", float("nan"))))
        return out

    jt.grads_jit, jt.apply_updates, jt.JaxTrainer.step = grads_hooked, update_hooked, step_hooked
    code = main(["train", *argv])
    if code != 0:
        raise SystemExit(code)
    grads_phase = max(g["total"] for g in rec["grads"]) + rec["opt_state_bytes"]
    update_phase = max(u["total"] for u in rec["update"]) if rec["update"] else 0
    rec["peak_bytes"] = max(grads_phase, update_phase)
    rec["baseline_rss_bytes"] = None
    return rec


def child_main(argv: Sequence[str]) -> None:
    backend, flags = argv[0], json.loads(argv[1])
    rec = (_child_jax if backend == "jax" else _child_torch)(flags)
    print(_MARKER + json.dumps(rec), flush=True)


def measure(values: dict[str, Any], *, max_steps: int = 2, timeout: float = 900.0,
            threads: int = 2, extra_env: Optional[dict] = None, skip_saves: bool = False) -> dict[str, Any]:
    """Run ``twinseq train`` with ``values`` (flat config fields; ``backend`` among them) for ``max_steps`` steps
    in a fresh subprocess and return its measured peak (see the module docstring).

    ``skip_saves`` (torch): the run writes no end-of-run checkpoint or final model, which come after the last
    measured step (for a 3B model they are ~50 GB of disk and minutes)."""
    values = dict(values)
    backend = values.get("backend", "torch")
    with tempfile.TemporaryDirectory(prefix="twinseq-peak-") as tmp:
        values.setdefault("output_dir", str(Path(tmp) / "run"))
        values.setdefault("max_steps", max_steps)
        values.setdefault("disable_tqdm", True)
        env = dict(os.environ)
        env.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 20))  # freed big blocks leave RSS (see _memory.py)
        env["TWINSEQ_MEASURE_THREADS"] = str(threads)
        env[_NO_SAVE] = "1" if skip_saves else "0"
        for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
            env[var] = str(threads)
        env.setdefault("JAX_PLATFORMS", "cpu")
        env.update(extra_env or {})
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", backend, json.dumps(flags_of(values))]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(_MARKER)]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"measured twinseq train failed (exit {proc.returncode}) for {values}:\n"
                           f"{proc.stderr[-3000:]}")
    rec = json.loads(lines[-1][len(_MARKER):])
    steps = rec["step_seconds"][1:] or rec["step_seconds"]  # the first step compiles / warms up
    rec["seconds_per_step"] = sorted(steps)[len(steps) // 2]
    tokens = rec.get("num_tokens", [0])[-1]
    rec["tokens_per_second"] = tokens / rec["seconds_per_step"] if rec["seconds_per_step"] else None
    rec["command"] = "twinseq train " + " ".join(flags_of(values))
    return rec


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child_main(sys.argv[2:])
    else:
        print(json.dumps(measure(json.loads(sys.argv[1])), indent=1))
