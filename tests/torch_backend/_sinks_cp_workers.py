"""The rank side of ``test_attention_sinks.py``'s CP test: attention sinks (gpt-oss) under context parallelism on
gloo ranks (``python _sinks_cp_workers.py SPEC.json OUT_DIR`` with torchrun's environment, as
``_dist_workers.launch_script`` starts them).

Job kind ``sinks_cp``, per strategy (``allgather``, ``ulysses``):

- ``layer``: this rank's attention output and the q/k/v gradients against transformers' gpt-oss eager attention of
  the whole row (float64), and the sinks' gradient summed over the ranks; ``control``: the same call without
  ``s_aux``, which must be far from it;
- ``model``: the gpt-oss model (the ``gpt_oss`` case of ``parity_tests.families``) on this rank's zigzag shard, its
  loss and sink gradients summed over the ranks (compared with ``one_process_reference``).

Each rank writes ``OUT_DIR/rank{r}.json``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[2]))
import _dist_workers as W  # noqa: E402

STRATEGIES = ("allgather", "ulysses")
NAME = "gpt_oss"


def _batch():
    from parity_tests.families import family_examples
    from twinseq.common.data.batching import collate

    return collate(family_examples(), padding_free=True, pad_to_multiple_of=16)


def _model():
    """The gpt-oss case with common's weights (seed 0) and sinks drawn from N(0, 1), float32 (transformers' grouped
    expert matmul takes no float64)."""
    import torch

    from parity_tests.families import FAMILY_CASES
    from twinseq.common.models.init import init_weights
    from twinseq.torch_backend.model import build_model

    cfg = FAMILY_CASES[NAME]
    model = build_model(cfg, init_weights(cfg, seed=0), attn_implementation="eager")
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.copy_(torch.randn(layer.self_attn.sinks.shape, generator=gen))
    return model


def one_process_reference() -> dict:
    """The model's loss and sink gradients on the whole batch in one process (eager: transformers' attention)."""
    from twinseq.torch_backend.model import loss_and_grads

    loss, grads = loss_and_grads(_model(), _batch())
    return {"loss": loss, "sinks": {n: g.tolist() for n, g in grads.items() if n.endswith("sinks")}}


def _layer_check(strategy: str, batch, cp: int, rank: int) -> tuple[dict, float]:
    import torch
    import torch.distributed as dist
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    from twinseq.common.data.context_parallel import cp_permutation
    from twinseq.torch_backend import context_parallel as cpmod
    from twinseq.torch_backend.attention import document_mask

    B, T = batch.shape
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, n, T, 8, generator=gen, dtype=torch.float64) for n in (4, 2, 2))
    sinks = torch.randn(4, generator=gen, dtype=torch.float64)
    real = torch.as_tensor(batch.segment_ids != 0)[:, :, None, None]
    w = torch.randn(B, T, 4, 8, generator=gen, dtype=torch.float64) * real
    seg, pos = (torch.as_tensor(x, dtype=torch.long) for x in (batch.segment_ids, batch.position_ids))
    ref = [x.clone().requires_grad_() for x in (q, k, v, sinks)]
    module = SimpleNamespace(num_key_value_groups=2, sinks=ref[3], training=False)
    want, _ = eager_attention_forward(module, *ref[:3], document_mask(seg, pos, torch.float64), scaling=0.3)
    want_grads = torch.autograd.grad((want * w).sum(), ref)
    mine = torch.as_tensor(cp_permutation(T, cp)).reshape(cp, -1)[rank]
    local = [x[:, :, mine].clone().requires_grad_() for x in (q, k, v)] + [sinks.clone().requires_grad_()]
    ctx = cpmod.make_context(cpmod.shard_for_rank(batch, cp, rank), dist.group.WORLD, strategy)
    forward = cpmod.allgather_attention_forward if strategy == "allgather" else cpmod.ulysses_attention_forward
    got, _ = forward(
        SimpleNamespace(training=False), *local[:3], None, scaling=0.3, s_aux=local[3], **{cpmod.CP_KWARG: ctx}
    )
    grads = list(torch.autograd.grad((got * w[:, mine]).sum(), local))
    dist.all_reduce(grads[3])  # each rank's queries' share of the sinks' gradient
    errs = {"out": float(((got - want[:, mine]) * real[:, mine]).abs().max())}
    for name, g, h in zip(("dq", "dk", "dv"), grads, want_grads):
        errs[name] = float((g - h[:, :, mine]).abs().max())
    errs["dsinks"] = float((grads[3] - want_grads[3]).abs().max())
    blind, _ = forward(
        SimpleNamespace(training=False), *(x.detach() for x in local[:3]), None, scaling=0.3, **{cpmod.CP_KWARG: ctx}
    )
    return errs, float(((blind - want[:, mine]) * real[:, mine]).abs().max())


def _model_check(strategy: str, batch, cp: int, rank: int) -> dict:
    import torch.distributed as dist
    import torch.nn.functional as F

    from twinseq.torch_backend import context_parallel as cpmod
    from twinseq.torch_backend.attention import mask_layout
    from twinseq.torch_backend.parallel import use_cp_attention

    model = _model()
    use_cp_attention(model, strategy)
    shard = cpmod.shard_for_rank(batch, cp, rank)
    ctx = cpmod.make_context(shard, dist.group.WORLD, strategy, mask_layout(model.config).sliding_window)
    hidden = model.model(
        input_ids=shard.input_ids, position_ids=shard.position_ids, use_cache=False, **{cpmod.CP_KWARG: ctx}
    ).last_hidden_state
    nll = F.cross_entropy(
        model.lm_head(hidden).flatten(0, 1), shard.targets.flatten(), ignore_index=-100, reduction="sum"
    )
    loss = nll / batch.num_items_in_batch
    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total)
    sinks = {}
    for name, param in model.named_parameters():
        if name.endswith("sinks"):
            dist.all_reduce(param.grad)
            sinks[name] = param.grad.tolist()
    return {"loss": float(total), "sinks": sinks}


def sinks_cp() -> dict:
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo")  # rank and world size from the environment, as torchrun sets them
    cp, rank, batch = dist.get_world_size(), dist.get_rank(), _batch()
    out: dict = {"layer": {}, "control": {}, "model": {}}
    for strategy in STRATEGIES:
        out["layer"][strategy], out["control"][strategy] = _layer_check(strategy, batch, cp, rank)
        out["model"][strategy] = _model_check(strategy, batch, cp, rank)
    dist.barrier()  # every rank reaches teardown together (see _dist_workers.run_spec)
    dist.destroy_process_group()
    return out


def launch(spec: dict, tmp_path: Path, world_size: int) -> list[dict]:
    return W.launch_script(
        __file__, spec, tmp_path, world_size, timeout=300.0, env={"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    )


def main(argv: list[str]) -> int:
    spec = json.loads(Path(argv[0]).read_text())
    result = {job["kind"]: sinks_cp() for job in spec["jobs"]}["sinks_cp"]
    Path(argv[1], f"rank{os.environ['RANK']}.json").write_text(json.dumps(result))
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown, where gloo's static destructors can race (see _dist_workers.main)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
