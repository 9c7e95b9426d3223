"""Helpers of the GRPO context-parallel tests: the GRPO trainer built by ``grpo.build_grpo`` (one process, or FSDP2 +
CP on every rank) on the embedded prompts, and the worker every spawned rank runs (``python _grpo_cp_workers.py
SPEC.json OUT_DIR`` with torchrun's environment, launched by ``_dist_workers.launch_script``).

A job trains ``max_steps`` GRPO steps, the global RNG seeded alike before each (so that one process and the cp ranks
sample the same completions), and writes per step the logged metrics, plus (rank 0) the first step's full gradients
(no clipping: ``max_grad_norm=None``) and the final full weights to ``OUT_DIR/{name}_grads.npz`` and
``{name}_weights.npz``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
import _dpo_cp_workers as D  # noqa: E402

METRICS = ("loss", "grad_norm", "kl", "reward", "completions/mean_length", "entropy")


def make_config(**overrides: Any):
    from twinseq.common.config import TrainConfig

    base = dict(
        task="grpo",
        model_config="tiny",
        max_steps=3,
        per_device_train_batch_size=4,
        num_generations=4,
        gradient_accumulation_steps=2,
        max_prompt_length=32,
        max_completion_length=8,
        num_iterations=2,
        grpo_beta=0.1,
        learning_rate=1e-3,
        max_grad_norm=None,
        seed=0,
        temperature=0.9,
        disable_tqdm=True,
        output_dir="/nonexistent",
        share_prefix=False,
    )
    return TrainConfig.from_flat(**{**base, **overrides})


def train(cfg, runtime=None) -> tuple[list[dict], dict, dict]:
    """(per-step metrics, the first step's gradients, the final weights) of ``max_steps`` GRPO steps."""
    import torch

    from twinseq.torch_backend.grpo import build_grpo

    device = torch.device("cpu") if runtime is None else runtime.device
    trainer, source, _, _ = build_grpo(cfg, device, runtime)
    grads: dict = {}
    apply_update = trainer.apply_update

    def first_grads_then_update(grad_norm):  # the first step's gradients, before the update
        if not grads:
            grads.update(D.full_grads(trainer))
        return apply_update(grad_norm)

    trainer.apply_update = first_grads_then_update
    records = []
    for step in range(cfg.max_steps):
        torch.manual_seed(1000 + step)
        out = trainer.step(source.next_step())
        records.append({k: float(out[k]) for k in METRICS if k in out})
    return records, grads, D.full_weights(trainer)


def run_spec(spec: dict, out_dir: str) -> dict:
    import torch.distributed as dist

    from twinseq.common.config import TrainConfig
    from twinseq.torch_backend.distributed import init_runtime

    out: dict[str, Any] = {}
    for job in spec["jobs"]:
        cfg = TrainConfig.from_dict(job["config"])
        runtime = init_runtime(cfg)
        if job.get("control") == "autograd_all_reduce":
            # negative control: torch's differentiable all-reduce in place of sum_over_ranks, whose backward SUMS the
            # gradient over the cp ranks (each rank then back-propagates cp times its share)
            import torch.distributed.nn.functional as dist_fn

            from twinseq.torch_backend import grpo_context_parallel

            grpo_context_parallel.sum_over_ranks = lambda x, group: dist_fn.all_reduce(x, group=group)
        records, grads, weights = train(cfg, runtime)
        out[job["name"]] = records
        if dist.get_rank() == 0:
            np.savez(Path(out_dir, f"{job['name']}_grads.npz"), **grads)
            np.savez(Path(out_dir, f"{job['name']}_weights.npz"), **weights)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return out


def main(argv: list[str]) -> int:
    spec = json.loads(Path(argv[0]).read_text())
    result = run_spec(spec, argv[1])
    Path(argv[1], f"rank{os.environ['RANK']}.json").write_text(json.dumps(result))
    sys.stdout.flush()
    os._exit(0)  # as _dist_workers.main: skip gloo's racy static destructors


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
