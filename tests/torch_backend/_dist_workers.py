"""Helpers of the distributed tests: synthetic data, the single-process reference, and the worker
that every spawned rank runs (job kinds: ``attention``, ``cp_parity``, ``train`` = the trainer's
steps on synthetic rows, ``run`` = ``twinseq.torch_backend.recipes.train`` end to end) (``python _dist_workers.py SPEC.json OUT_DIR`` with torchrun's
environment: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT).

The worker writes ``OUT_DIR/rank{r}.json``; the tests compare it with the reference computed in
the pytest process. Synthetic token rows (no tokenizer, no dataset files) keep a run to seconds.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

import numpy as np

TINY = "tiny"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def synthetic_rows(num_docs: int = 96, seed: int = 0) -> dict[str, list]:
    """Documents of 4..40 tokens; every third has a masked prompt (completion_mask), like SFT data.

    A document counts up from a random start with a random stride (mod 200), so the next token
    is learnable from the context and the loss falls within a few steps.
    """
    rng = np.random.default_rng(seed)
    rows: dict[str, list] = {"input_ids": [], "completion_mask": []}
    for i in range(num_docs):
        n = int(rng.integers(4, 41))
        start, stride = rng.integers(0, 200), rng.integers(1, 4)
        rows["input_ids"].append((3 + (start + stride * np.arange(n)) % 200).tolist())
        prompt = int(rng.integers(1, n)) if i % 3 == 0 else 0
        rows["completion_mask"].append([0] * prompt + [1] * (n - prompt))
    return rows


def make_config(**overrides: Any):
    from twinseq.common.config import TrainConfig

    base = dict(model_config=TINY, max_length=64, per_device_train_batch_size=2, gradient_accumulation_steps=1,
                learning_rate=3e-3, lr_scheduler_type="cosine", max_steps=10, seed=0, disable_tqdm=True,
                output_dir="/nonexistent", dataset_name="synthetic")
    return TrainConfig.from_flat(**{**base, **overrides})


def _model(cfg):
    from twinseq.common.config import ModelConfig
    from twinseq.common.models.init import init_weights
    from twinseq.torch_backend.model import build_model

    model_cfg = ModelConfig.preset(cfg.model.model_config)
    return build_model(model_cfg, init_weights(model_cfg, seed=cfg.seed),
                       attn_implementation=cfg.model.attn_implementation)


def _trainer(cfg, runtime=None):
    """The trainer ``twinseq.torch_backend.recipes.train`` steps, on synthetic rows instead of a dataset."""
    import torch

    from twinseq.torch_backend.parallel import parallelize
    from twinseq.torch_backend.trainer import SFTTrainer

    torch.manual_seed(cfg.seed)
    device = torch.device("cpu") if runtime is None else runtime.device
    model = _model(cfg)
    if cfg.peft.use_peft:  # LoRA: adapters on the plain model before parallelize, as train() adds them
        from twinseq.torch_backend.trainer import add_peft

        model = add_peft(cfg, model)
    return SFTTrainer(cfg, parallelize(model, runtime, cfg), device, runtime)


def reference_losses(cfg, rows, *, return_batches: bool = False):
    """Per-step losses of the single-process trainer."""
    from twinseq.common.data.sft_steps import StepIterator

    trainer = _trainer(cfg)
    iterator = StepIterator(rows, cfg, pad_token_id=0)
    losses, steps = [], []
    for _ in range(cfg.max_steps):
        batches = iterator.next_step()
        steps.append(batches)
        losses.append(trainer.step(batches)["loss"])
    return (losses, steps) if return_batches else losses


def _parallel_setup(cfg, rows):
    from twinseq.common.data.sft_steps import StepIterator
    from twinseq.torch_backend.distributed import init_runtime

    runtime = init_runtime(cfg)
    trainer = _trainer(cfg, runtime)
    iterator = StepIterator(rows, cfg, pad_token_id=0, world_size=runtime.mesh_cfg.dp, rank=runtime.dp_rank)
    return trainer, iterator


def distributed_losses(cfg, rows) -> list[float]:
    """Per-step losses (summed over ranks) of FSDP2 (+ CP), as this rank logs them."""
    trainer, iterator = _parallel_setup(cfg, rows)
    return [trainer.step(iterator.next_step())["loss"] for _ in range(cfg.max_steps)]


def distributed_grads(cfg, rows) -> dict[str, np.ndarray]:
    """The full (unsharded) gradients of the first step, HF names (PeftModel names of the adapters under LoRA),
    after FSDP2's reduce-scatter."""
    trainer, iterator = _parallel_setup(cfg, rows)
    for micro in trainer.prepare(iterator.next_step()):
        trainer.micro_step(micro)
    return {n.removeprefix("causal_lm."): p.grad.full_tensor().cpu().numpy()
            for n, p in trainer.module.named_parameters() if p.requires_grad}


def reference_grads(cfg, rows) -> dict[str, np.ndarray]:
    """The gradients of the first step of the single-process trainer."""
    from twinseq.common.data.sft_steps import StepIterator

    trainer = _trainer(cfg)
    for batch in StepIterator(rows, cfg, pad_token_id=0).next_step():
        trainer.micro_step(batch)
    return {n.removeprefix("causal_lm."): p.grad.numpy() for n, p in trainer.module.named_parameters()
            if p.requires_grad}


def packed_batch(seed: int = 1, pad_to: int = 8):
    """Two padded rows, several documents each (lengths chosen so documents cross every shard edge)."""
    from twinseq.common.data.batching import collate

    rng = np.random.default_rng(seed)
    examples = []
    for lengths in ([5, 9, 7, 3], [13, 6, 4]):
        ids = rng.integers(3, 8192, size=sum(lengths)).tolist()
        examples.append({"input_ids": ids, "seq_lengths": lengths})
    return collate(examples, pad_to_multiple_of=pad_to)


def attention_check(seed: int = 0) -> dict[str, float]:
    """allgather CP attention on this rank vs dense document-masked attention of the whole row.

    Forward output and the gradients of q, k, v (k/v gradients arrive through the reduce-scatter
    backward of the gather) are compared on this rank's tokens; returns the max abs errors.
    """
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from twinseq.common.data.context_parallel import cp_permutation
    from twinseq.torch_backend import context_parallel as cpmod
    from twinseq.torch_backend.attention import document_mask

    if not dist.is_initialized():
        dist.init_process_group("gloo")  # rank and world size from the environment, as torchrun sets them
    cp, rank = dist.get_world_size(), dist.get_rank()
    batch = packed_batch()
    B, T = batch.input_ids.shape
    H, KV, D = 4, 2, 8
    gen = torch.Generator().manual_seed(seed)
    q, k, v, w = (torch.randn(B, n, T, D, generator=gen, dtype=torch.float64) for n in (H, KV, KV, H))
    # padding queries' outputs are don't-care (dense: the padding key itself; blocked: zero), so is their gradient
    w = w * torch.as_tensor(batch.segment_ids != 0)[:, None, :, None]
    seg = torch.as_tensor(batch.segment_ids, dtype=torch.long)
    pos = torch.as_tensor(batch.position_ids, dtype=torch.long)
    q_ref, k_ref, v_ref = (x.clone().requires_grad_() for x in (q, k, v))
    out_ref = F.scaled_dot_product_attention(q_ref, k_ref, v_ref, attn_mask=document_mask(seg, pos, torch.float64),
                                             enable_gqa=True)
    (out_ref * w).sum().backward()
    mine = torch.as_tensor(cp_permutation(T, cp)).reshape(cp, -1)[rank]
    q_loc, k_loc, v_loc = (x[:, :, mine].clone().requires_grad_() for x in (q, k, v))
    shard = cpmod.shard_for_rank(batch, cp, rank)
    ctx = cpmod.make_context(shard, dist.group.WORLD, "allgather")
    module = torch.nn.Module()
    out, _ = cpmod.allgather_attention_forward(module, q_loc, k_loc, v_loc, None, **{cpmod.CP_KWARG: ctx})
    (out.transpose(1, 2) * w[:, :, mine]).sum().backward()
    real = torch.as_tensor(batch.segment_ids != 0)[:, mine][:, None, :, None]  # padding outputs are don't-care
    return {"out": float(((out.transpose(1, 2) - out_ref[:, :, mine]).abs() * real).max()),
            "dq": float((q_loc.grad - q_ref.grad[:, :, mine]).abs().max()),
            "dk": float((k_loc.grad - k_ref.grad[:, :, mine]).abs().max()),
            "dv": float((v_loc.grad - v_ref.grad[:, :, mine]).abs().max())}


def attention_inputs(batch, num_heads: int = 4, num_kv_heads: int = 2, head_dim: int = 8, seed: int = 0):
    """float32 numpy q [B, H, T, D], k, v [B, KV, T, D] in token order (shared with the JAX side)."""
    rng = np.random.default_rng(seed)
    B, T = batch.input_ids.shape
    return tuple(rng.standard_normal((B, n, T, head_dim)).astype(np.float32)
                 for n in (num_heads, num_kv_heads, num_kv_heads))


def cp_parity(out_dir: str, cp: int) -> dict[str, float]:
    """For the cross-framework test: the FSDP2 + allgather-CP loss of ``packed_batch()`` summed over the
    ranks, and this rank's allgather attention output (written to ``attention_rank{r}.npy``)."""
    import torch
    import torch.distributed as dist

    from twinseq.common.data.context_parallel import cp_permutation
    from twinseq.torch_backend import context_parallel as cpmod
    from twinseq.torch_backend.distributed import init_runtime
    from twinseq.torch_backend.parallel import parallelize

    cfg = make_config(context_parallel_size=cp, pad_to_multiple_of=2 * cp)
    runtime = init_runtime(cfg)
    batch = packed_batch(pad_to=2 * cp)
    module = parallelize(_model(cfg), runtime, cfg)
    with torch.no_grad():
        loss, _ = module(cpmod.shard_for_rank(batch, cp, runtime.cp_rank))
    dist.all_reduce(loss, op=dist.ReduceOp.SUM)
    mine = cp_permutation(batch.input_ids.shape[1], cp).reshape(cp, -1)[runtime.cp_rank]
    q, k, v = (torch.from_numpy(np.ascontiguousarray(x[:, :, mine])) for x in attention_inputs(batch))
    ctx = cpmod.make_context(cpmod.shard_for_rank(batch, cp, runtime.cp_rank), runtime.cp_group, "allgather")
    with torch.no_grad():
        out, _ = cpmod.allgather_attention_forward(torch.nn.Module(), q, k, v, None, **{cpmod.CP_KWARG: ctx})
    np.save(Path(out_dir, f"attention_rank{runtime.rank}.npy"), out.numpy())
    return {"loss": float(loss)}


def run_spec(spec: dict, out_dir: str) -> dict:
    import torch.distributed as dist

    from twinseq.common.config import TrainConfig

    out: dict[str, Any] = {}
    for job in spec["jobs"]:
        if job["kind"] == "attention":
            out[job["name"]] = attention_check()
        elif job["kind"] == "cp_parity":
            out[job["name"]] = cp_parity(out_dir, job["cp"])
        elif job["kind"] == "run":  # the whole trainer, through the runner (data, checkpoints, resume)
            from twinseq.torch_backend.recipes import train

            train(TrainConfig.from_dict(job["config"]))
            out[job["name"]] = "done"
        else:
            cfg = TrainConfig.from_dict(job["config"])
            rows = synthetic_rows(num_docs=job.get("num_docs", 96), seed=job["data_seed"])
            out[job["name"]] = distributed_losses(cfg, rows)
            grads = distributed_grads(cfg, rows)
            if dist.get_rank() == 0:
                np.savez(Path(out_dir, f"grads_{job['name']}.npz"), **grads)
    if dist.is_initialized():
        # Every rank reaches teardown together: a rank that destroys the group while its peer
        # still has gloo traffic in flight can abort in gloo's destructor.
        dist.barrier()
        dist.destroy_process_group()
    return out


def launch(spec: dict, tmp_path: Path, world_size: int = 2, timeout: float = 240.0, cuda: bool = False) -> list[dict]:
    """Run ``spec`` on ``world_size`` local processes, as torchrun would; one result per rank.

    ``cuda=False`` hides the GPUs, so the ranks run on CPU with gloo; ``cuda=True`` gives rank r GPU r (NCCL).
    """
    return launch_script(__file__, spec, tmp_path, world_size, timeout=timeout,
                         env={"OMP_NUM_THREADS": "1", **({} if cuda else {"CUDA_VISIBLE_DEVICES": ""})})


LAUNCHER_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def launch_script(script: str, spec: dict, tmp_path: Path, world_size: int, *, timeout: float = 240.0,
                  env: Optional[dict] = None, launcher_for_one: bool = True) -> list[dict]:
    """``python script SPEC.json tmp_path`` on ``world_size`` local ranks with torchrun's environment (plus
    ``env`` and ``TWINSEQ_TEST_RANK``); each rank writes ``rank{r}.json`` there, returned in rank order.
    ``launcher_for_one=False``: a single rank runs with no launcher variables at all (a plain process)."""
    spec_path = tmp_path / "spec.json"
    spec_path.write_text(json.dumps(spec))
    port = free_port()
    base = {**{k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}, **(env or {})}
    procs = []
    for rank in range(world_size):
        rank_env = dict(base) if world_size == 1 and not launcher_for_one else {
            **base, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        rank_env["TWINSEQ_TEST_RANK"] = str(rank)
        procs.append(subprocess.Popen([sys.executable, script, str(spec_path), str(tmp_path)], env=rank_env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    failed = [(r, p.returncode) for r, p in enumerate(procs) if p.returncode != 0]
    assert not failed, f"ranks failed {failed}:\n" + "\n".join(log[-4000:] for log in logs)
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world_size)]


def main(argv: list[str]) -> int:
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False  # float32 parity on GPU ranks
    torch.backends.cudnn.allow_tf32 = False
    spec = json.loads(Path(argv[0]).read_text())
    result = run_spec(spec, argv[1])
    Path(argv[1], f"rank{os.environ['RANK']}.json").write_text(json.dumps(result))
    sys.stdout.flush()
    # The result is on disk; skip interpreter teardown, where gloo's and other libraries' C++
    # static destructors can race and abort ("terminate called without an active exception").
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
