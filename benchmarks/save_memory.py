"""Peak memory of saving: a full fine-tune's checkpoint and final model against its training steps.

A save used to hold a second copy of everything it wrote: the trainer's state as numpy copies, then
safetensors' writer building the whole file's bytes, then transformers' ``save_pretrained`` doing the same for
the model. twinseq now streams (``common.models.safetensors_stream``): one tensor in memory at a time, views of
the live parameters and optimizer state where they are already host float32.

Each row is a real ``twinseq train`` of a ~109M-parameter Llama (random init, the embedded vocabulary), full
fine-tune with AdamW, in a fresh subprocess, with a resumable checkpoint in the middle (``--save-steps``) and at
the end, and the final model folder. The child reads the kernel's high-water mark of its RSS
(``/proc/self/status`` VmHWM, reset through ``/proc/self/clear_refs`` after the model is built): the *training
peak* is the largest over the optimizer steps, the *save peak* the largest over each save (reset before it).
Both are whole-process RSS, what a user's ``top`` shows. ``eager`` re-creates the previous writer in the child
(numpy copies of the full state, ``safetensors.numpy.save_file``, transformers' ``save_pretrained``) as the
baseline; ``streamed`` is the library as it is.

    .venv/bin/python benchmarks/save_memory.py                 # torch eager + streamed, jax streamed
    .venv/bin/python benchmarks/save_memory.py --modes streamed --backends torch
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional, Sequence

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _report import MIB, add_output_args, markdown_table, start_run  # noqa: E402
from _train_peak import _reset_hwm, _status, flags_of  # noqa: E402

LLAMA_109M = dict(
    model_type="llama",
    vocab_size=8192,
    hidden_size=1024,
    intermediate_size=2816,
    num_hidden_layers=9,
    num_attention_heads=16,
    num_key_value_heads=4,
    tie_word_embeddings=True,
)
RUN = dict(
    max_steps=4,
    save_steps=2,
    per_device_train_batch_size=1,
    max_length=256,
    learning_rate=1e-4,
    disable_tqdm=True,
    init_weights="random",
    logging_steps=1,
)
LIMIT = 1.05
_MARKER = "__SAVE_MEMORY__ "


def _eager_patches() -> None:
    """The writer as it was before streaming (commit 5567e61): the whole state as numpy copies, safetensors'
    ``save_file`` (which builds the file's bytes in memory), transformers' ``save_pretrained`` for the model."""
    import numpy as np
    from safetensors.numpy import save_file

    from twinseq.common.run import checkpoint, runner
    from twinseq.torch_backend import trainer as tt
    from twinseq.torch_backend.checkpoint import rng_state, to_numpy_tree
    from twinseq.torch_backend.distributed import full_model_state, full_optimizer_state

    def state_dict(self):
        weights = full_model_state(self.module, tt._PREFIX)
        optimizer = full_optimizer_state(self.module, self.optimizer)
        return {
            "model": {k: to_numpy_tree(weights[k]) for k in self._weight_names()},
            "optimizer": to_numpy_tree(optimizer),
            "scheduler": to_numpy_tree(self.scheduler.state_dict()),
            "rng": rng_state(),
        }

    def save_training_checkpoint(output_dir, step, state, meta, *, write=True):
        arrays, skeleton = checkpoint.flatten_state(state)
        arrays = {k: np.array(v, order="C") for k, v in arrays.items()}
        final = checkpoint.checkpoint_dir(output_dir, step)
        final.mkdir(parents=True, exist_ok=True)
        save_file(arrays, str(final / checkpoint.ARRAYS_FILE))
        record = {
            "format_version": checkpoint.FORMAT_VERSION,
            "step": int(step),
            **meta,
            "state": skeleton,
            "complete": True,
        }
        (final / checkpoint.STATE_FILE).write_text(json.dumps(record) + "\n")
        return final

    def save_final(self, path):
        self.causal_lm.save_pretrained(str(path), safe_serialization=True)

    tt.TorchTrainer.state_dict, tt.TorchTrainer.save_final = state_dict, save_final
    runner.save_training_checkpoint = save_training_checkpoint


def child(mode: str, backend: str, argv: list[str]) -> dict[str, Any]:
    import gc

    from twinseq.common.cli import main
    from twinseq.common.run import runner
    from twinseq.common.run.trainer import TrainerTemplate

    if mode == "eager":
        _eager_patches()
    rec: dict[str, Any] = {"step_hwm": [], "saves": []}
    step = TrainerTemplate.step

    def measured(label: str, fn):
        def wrapped(*args, **kwargs):
            gc.collect()
            before = _status("VmRSS")
            _reset_hwm()
            out = fn(*args, **kwargs)
            rec["saves"].append({"what": label, "rss_before": before, "hwm": _status("VmHWM")})
            _reset_hwm()
            return out

        return wrapped

    def step_hooked(self, micro_batches):
        if not rec["step_hwm"]:
            cls = type(self)
            cls.save_final = measured("final model", cls.save_final)
            gc.collect()
            rec["build_peak"] = _status("VmHWM")  # imports, data, model and optimizer built: the run so far
            rec["after_build_rss"] = _status("VmRSS")
            _reset_hwm()
        out = step(self, micro_batches)
        rec["step_hwm"].append(_status("VmHWM"))
        return out

    TrainerTemplate.step = step_hooked
    runner._save = measured("checkpoint", runner._save)
    code = main(["train", "--backend", backend, *argv])
    if code != 0:
        raise SystemExit(code)
    rec["training_peak"] = max(rec["step_hwm"])
    rec["save_peak"] = max(s["hwm"] for s in rec["saves"])
    rec["whole_run_peak"] = max(rec["build_peak"], rec["training_peak"], rec["save_peak"])
    return rec


def measure(mode: str, backend: str, model_dir: Path, threads: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as out:
        flags = flags_of({**RUN, "model_config": str(model_dir), "output_dir": out})
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        proc = subprocess.run(
            [sys.executable, __file__, "--child", mode, backend, "--", *flags], env=env, capture_output=True, text=True
        )
        if proc.returncode != 0:
            raise RuntimeError(f"{mode}/{backend} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        line = next(x for x in proc.stdout.splitlines() if x.startswith(_MARKER))
        return json.loads(line[len(_MARKER) :])


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--modes", nargs="+", default=["eager", "streamed"], choices=["eager", "streamed"])
    p.add_argument("--backends", nargs="+", default=["torch", "jax"], choices=["torch", "jax"])
    p.add_argument("--threads", type=int, default=2)
    add_output_args(p)
    return p.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    run = start_run(parse_args, argv, __file__, device="cpu")
    args = run.args
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "llama-109m"
        model_dir.mkdir()
        from twinseq.common.config import ModelConfig
        from twinseq.common.models.configs import to_hf_config
        from twinseq.common.models.init import parameter_shapes

        cfg = ModelConfig(**LLAMA_109M)
        (model_dir / "config.json").write_text(json.dumps(to_hf_config(cfg, "float32")))
        parameters = sum(int(__import__("numpy").prod(s)) for s in parameter_shapes(cfg).values())
        for backend in args.backends:
            for mode in args.modes:
                if mode == "eager" and backend != "torch":
                    continue  # the eager re-creation patches the torch trainer; jax's old writer was the same kind
                r = measure(mode, backend, model_dir, args.threads)
                ratio = r["save_peak"] / r["training_peak"]
                whole = r["whole_run_peak"] / r["training_peak"]
                keys = ("build_peak", "after_build_rss", "training_peak", "save_peak", "whole_run_peak", "saves")
                rows.append(
                    dict(
                        backend=backend,
                        mode=mode,
                        parameters=parameters,
                        **{k: r[k] for k in keys},
                        save_over_training=ratio,
                        whole_over_training=whole,
                        within_limit=whole <= LIMIT,
                    )
                )
                print(
                    f"{backend:5s} {mode:8s} training peak {r['training_peak'] / MIB:8.1f} MiB, save peak "
                    f"{r['save_peak'] / MIB:8.1f} MiB ({ratio:.3f}x), whole run {r['whole_run_peak'] / MIB:8.1f} MiB "
                    f"({whole:.3f}x)",
                    flush=True,
                )
    header = ["backend", "writer", "parameters", "build peak MiB", "training peak MiB", "save peak MiB"]
    header += ["whole run MiB", "save / training", "whole run / training", f"<= {LIMIT}x"]
    table = markdown_table(
        header,
        [
            [
                r["backend"],
                r["mode"],
                f"{r['parameters'] / 1e6:.1f}M",
                f"{r['build_peak'] / MIB:.0f}",
                f"{r['training_peak'] / MIB:.0f}",
                f"{r['save_peak'] / MIB:.0f}",
                f"{r['whole_run_peak'] / MIB:.0f}",
                f"{r['save_over_training']:.3f}",
                f"{r['whole_over_training']:.3f}",
                "yes" if r["within_limit"] else "no",
            ]
            for r in rows
        ],
    )
    body = "\n".join(
        [
            f"Full fine-tune (AdamW, float32) of a {LLAMA_109M['num_hidden_layers']}-layer Llama, "
            f"{RUN['max_steps']} steps of {RUN['per_device_train_batch_size']} x {RUN['max_length']} tokens, a "
            f"checkpoint at step {RUN['save_steps']} and at the end, then the final model folder. Peaks are "
            "whole-process RSS high-water marks (VmHWM): the build peak covers imports, data and model construction; "
            "the whole run is the largest of the three phases. `eager` is the previous writer, re-created in the "
            "child.",
            "",
            *table,
        ]
    )
    run.write({"model": LLAMA_109M, "run": RUN, "limit": LIMIT, "rows": rows}, title="Save memory", body=body)
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        mode, backend = sys.argv[2], sys.argv[3]
        result = child(mode, backend, sys.argv[5:])
        print(_MARKER + json.dumps(result), flush=True)
        sys.exit(0)
    sys.exit(main())
