"""The rank side of ``test_expert_parallel.py``: expert parallelism (``torch_backend.expert_parallel``) on gloo ranks
(``python _ep_workers.py SPEC.json OUT_DIR`` with torchrun's environment, as ``_dist_workers.launch_script`` starts
them).

Each job builds the tiny MoE preset with the same random weights on every rank, computes the unsharded model's loss
and gradients on all ranks' documents (the reference), then shards the experts and computes this rank's documents
only; losses and replicated gradients are summed over the ranks, expert gradients compared slice by slice. A job's
``control`` breaks one thing: ``no_backward_exchange`` (the exchange without its backward), ``misplaced_experts``
(this rank's experts in the wrong order). Each rank writes ``OUT_DIR/rank{r}.json``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np

VOCAB = 256
DOC_LENGTHS = (13, 7, 11, 9)  # two documents per rank on 2 ranks


def documents(seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"input_ids": rng.integers(3, VOCAB, n).tolist()} for n in DOC_LENGTHS]


def weights(cfg) -> dict[str, np.ndarray]:
    """``init_weights`` plus noise, so the router's choices and the experts differ clearly."""
    from twinseq.common.models.init import init_weights

    rng = np.random.default_rng(1)
    return {k: v + (rng.standard_normal(v.shape) * 0.05).astype(np.float32) for k, v in init_weights(cfg, 0).items()}


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _no_backward_exchange(module) -> None:
    """Control: the token exchange with no backward (the experts' outputs reach the loss as constants)."""

    class Detached:
        @staticmethod
        def apply(x, send, recv, group):
            return module._exchange(x.detach(), send, recv, group)

    module._AllToAll = Detached


def _ep_blocks(model) -> list:
    from twinseq.torch_backend.expert_parallel import ExpertParallelMoe

    return [layer.mlp for layer in model.model.layers if isinstance(layer.mlp, ExpertParallelMoe)]


def _misplace_experts(model) -> None:
    """Control: this rank's experts in reverse order (a token computed by a wrong expert)."""
    import torch

    for block in _ep_blocks(model):
        with torch.no_grad():
            for p in (block.experts.gate_up_proj, block.experts.down_proj):
                p.copy_(p.flip(0))


def _batches(world: int, rank: int):
    """(all documents, this rank's documents) as padding-free batches, both normalised by all ranks' labels."""
    import dataclasses

    from twinseq.common.data.batching import collate

    docs = documents()
    full = collate(docs, padding_free=True)
    mine = collate(docs[rank::world], padding_free=True)
    return full, dataclasses.replace(mine, num_items_in_batch=full.num_items_in_batch)


def _routing_check(model, world: int) -> dict:
    """Every token copy reaches its expert: per layer, the copies routed to each expert (summed over ranks) equal
    the copies the experts computed (gathered over ranks)."""
    import torch
    import torch.distributed as dist

    missing, received_total = 0, 0
    for block in _ep_blocks(model):
        routed_E = block.routed_E.clone()
        dist.all_reduce(routed_E)
        received = [torch.empty_like(block.received_E) for _ in range(world)]
        dist.all_gather(received, block.received_E)
        received_E = torch.cat(received)
        missing += int((routed_E - received_E).abs().sum())
        received_total += int(received_E.sum())
    return {"missing_copies": missing, "received_copies": received_total}


def run_job(job: dict) -> dict:
    import torch
    import torch.distributed as dist

    from twinseq.common.config import ModelConfig
    from twinseq.torch_backend import expert_parallel as ep
    from twinseq.torch_backend.model import build_model, loss_and_grads

    world, rank = dist.get_world_size(), dist.get_rank()
    cfg = ModelConfig.preset(job["preset"], vocab_size=VOCAB)
    full, mine = _batches(world, rank)
    ref_loss, ref_grads = loss_and_grads(build_model(cfg, weights(cfg)), full)
    model = build_model(cfg, weights(cfg))
    ep.shard_experts(model)
    _record_routing(model)
    if job.get("control") == "no_backward_exchange":
        _no_backward_exchange(ep)
    if job.get("control") == "misplaced_experts":
        _misplace_experts(model)
    loss, grads = loss_and_grads(model, mine)
    loss_t = torch.tensor(loss, dtype=torch.float64)
    dist.all_reduce(loss_t)
    per_rank = cfg.num_experts // world
    grad_rel = {}
    for name, g in grads.items():
        ref = ref_grads[name]
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            ref = ref[rank * per_rank : (rank + 1) * per_rank]
        else:
            g_t = torch.from_numpy(g)
            dist.all_reduce(g_t)
            g = g_t.numpy()
        grad_rel[name] = rel(g, ref)
    out = {"loss": float(loss_t), "ref_loss": ref_loss, "grad_rel": grad_rel, "tokens": int(full.num_tokens)}
    return {**out, **_routing_check(model, world)}


def _record_routing(model) -> None:
    """Each EP block keeps ``routed_E``: this rank's token copies per expert, from its router (a forward hook)."""
    import torch

    for block in _ep_blocks(model):

        def hook(gate, args, output, block=block):
            block.routed_E = torch.bincount(output[2].reshape(-1), minlength=gate.num_experts).detach()

        block.gate.register_forward_hook(hook)


def main(argv: list[str]) -> int:
    import torch.distributed as dist

    spec = json.loads(Path(argv[0]).read_text())
    dist.init_process_group("gloo")
    out = {job["name"]: run_job(job) for job in spec["jobs"]}
    Path(argv[1], f"rank{dist.get_rank()}.json").write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown (gloo's static destructors can abort, as _dist_workers.main)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
