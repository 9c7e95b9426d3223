"""Helpers of the DPO context-parallel tests: synthetic preference rows, the DPO trainer built as
``trainer.build_dpo`` builds it (one process, or FSDP2 + CP on every rank), and the worker every spawned rank runs
(``python _dpo_cp_workers.py SPEC.json OUT_DIR`` with torchrun's environment, launched by
``_dist_workers.launch_script``).

A job trains ``max_steps`` DPO steps and writes, per step, the logged metrics and the pre-clip gradient norm, plus
(rank 0) the first step's full gradients and the final full weights to ``OUT_DIR/{name}_grads.npz`` and
``{name}_weights.npz``; the tests compare them with the single-process trainer on the same rows.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
import _dist_workers as W  # noqa: E402

METRICS = ("loss", "grad_norm", "rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected")


def preference_rows(num_pairs: int = 16, seed: int = 0) -> dict[str, list]:
    """Tokenised pairs: a prompt of 3..12 tokens, chosen and rejected completions of 2..14 tokens (counting up with a
    stride, so the chosen continuation is learnable; the rejected one is random)."""
    rng = np.random.default_rng(seed)
    rows: dict[str, list] = {"prompt_input_ids": [], "chosen_input_ids": [], "rejected_input_ids": []}
    for _ in range(num_pairs):
        p, c, r = (int(rng.integers(lo, hi)) for lo, hi in ((3, 13), (2, 15), (2, 15)))
        start, stride = int(rng.integers(0, 200)), int(rng.integers(1, 4))
        seq = (3 + (start + stride * np.arange(p + c)) % 200).tolist()
        rows["prompt_input_ids"].append(seq[:p])
        rows["chosen_input_ids"].append(seq[p:])
        rows["rejected_input_ids"].append(rng.integers(3, 203, size=r).tolist())
    return rows


def short_rows(num_pairs: int = 8, seed: int = 0) -> dict[str, list]:
    """Pairs of at most 5 tokens: padded to 16 tokens (``pad_to_multiple_of=16``), every target lies in the first
    of the 4 zigzag chunks, so rank 1 of 2 holds no target at all (its backward must still run)."""
    rng = np.random.default_rng(seed)
    return {
        "prompt_input_ids": [rng.integers(3, 203, size=int(rng.integers(2, 4))).tolist() for _ in range(num_pairs)],
        "chosen_input_ids": [rng.integers(3, 203, size=int(rng.integers(1, 3))).tolist() for _ in range(num_pairs)],
        "rejected_input_ids": [rng.integers(3, 203, size=int(rng.integers(1, 3))).tolist() for _ in range(num_pairs)],
    }


def job_rows(job: dict) -> dict[str, list]:
    return short_rows(seed=job["data_seed"]) if job.get("rows") == "short" else preference_rows(seed=job["data_seed"])


def make_config(**overrides: Any):
    from twinseq.common.config import TrainConfig

    base = dict(task="dpo", model_config=W.TINY, max_length=64, per_device_train_batch_size=2,
                gradient_accumulation_steps=2, learning_rate=1e-3, max_steps=4, seed=0, beta=0.5,
                disable_tqdm=True, output_dir="/nonexistent", dataset_name="synthetic",
                share_prefix=False)  # context parallelism does not share prompts: the one-process runs lay rows alike
    return TrainConfig.from_flat(**{**base, **overrides})


def build_trainer(cfg, runtime=None):
    """``build_dpo``'s trainer (frozen reference copy, or the adapters off under LoRA) on synthetic rows."""
    import torch

    from twinseq.common.objectives.dpo import validate_dpo_config
    from twinseq.torch_backend.dpo import frozen_reference
    from twinseq.torch_backend.parallel import parallelize
    from twinseq.torch_backend.trainer import DPOTrainer, add_peft, cp_reference

    torch.manual_seed(cfg.seed)
    device = torch.device("cpu") if runtime is None else runtime.device
    model = W._model(cfg)
    ref_model = None
    if cfg.peft.use_peft:
        model = add_peft(cfg, model)
    else:
        ref_model = frozen_reference(model)
        if runtime is not None:
            ref_model = cp_reference(ref_model, cfg, runtime)
    d = cfg.dpo
    config = validate_dpo_config(d.dpo_loss_type, d.loss_weights, d.beta, d.label_smoothing, d.discopop_tau)
    pairs = cfg.data.per_device_train_batch_size * cfg.data.gradient_accumulation_steps
    return DPOTrainer(cfg, parallelize(model, runtime, cfg), device, ref_model=ref_model, config=config,
                      examples_per_step=pairs, runtime=runtime)


def full_grads(trainer) -> dict[str, np.ndarray]:
    """The full (unsharded under FSDP2) gradients of the parameters that train, HF names."""
    from torch.distributed.tensor import DTensor

    out = {}
    for name, p in trainer.module.named_parameters():
        if p.requires_grad and p.grad is not None:
            g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            out[name.removeprefix("causal_lm.")] = g.detach().double().cpu().numpy()
    return out


def full_weights(trainer) -> dict[str, np.ndarray]:
    from torch.distributed.tensor import DTensor

    return {name.removeprefix("causal_lm."): (p.full_tensor() if isinstance(p, DTensor) else p).detach().double()
            .cpu().numpy() for name, p in trainer.module.named_parameters() if p.requires_grad}


def train(cfg, rows, runtime=None) -> tuple[list[dict], dict, dict]:
    """(per-step metrics, the first step's gradients, the final weights) of ``max_steps`` DPO steps."""
    from twinseq.common.data.preference_steps import PreferenceStepIterator

    trainer = build_trainer(cfg, runtime)
    iterator = PreferenceStepIterator(rows, cfg, pad_token_id=0)
    records, grads = [], {}
    for step in range(cfg.max_steps):
        batches = iterator.next_step()
        if step == 0:  # the first step's gradients, before clipping and the update (micro-steps run twice)
            for pbatch in trainer.prepare(batches):
                trainer.micro_step(pbatch)
            grads = full_grads(trainer)
            trainer.discard_gradients()
        out = trainer.step(batches)
        records.append({k: float(out[k]) for k in METRICS})
    return records, grads, full_weights(trainer)


def run_spec(spec: dict, out_dir: str) -> dict:
    import torch.distributed as dist

    from twinseq.common.config import TrainConfig
    from twinseq.torch_backend.distributed import init_runtime

    out: dict[str, Any] = {}
    for job in spec["jobs"]:
        cfg = TrainConfig.from_dict(job["config"])
        runtime = init_runtime(cfg)
        if job.get("control") == "autograd_all_reduce":
            # negative control: torch's differentiable all-reduce, whose backward SUMS the gradient over the cp ranks
            # (each rank then back-propagates cp times its share): the first-step gradients must come out cp times
            # too large, which the tests' comparison must see
            import torch.distributed.nn.functional as dist_fn

            from twinseq.torch_backend import dpo

            dpo.sum_over_ranks = lambda x, group: dist_fn.all_reduce(x, group=group)
        records, grads, weights = train(cfg, job_rows(job), runtime)
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
