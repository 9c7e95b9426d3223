"""Training-trajectory parity: 20 AdamW steps of the torch trainer and the jax trainer.

Both start from ``init_weights`` and see the same batches (padded and padding-free layouts,
one step in two with two accumulated micro-batches). They use their real step code:
``torch_backend.trainer.SFTTrainer.step`` (clip_grad_norm_, torch.optim.AdamW, LambdaLR) and
``jax_backend.trainer.SFTTrainer.step`` (torch's clip rule, optax.adamw, the same schedule table).
Weight decay and clipping are both active (the initial gradient norm is above max_grad_norm).

Invariant: at every step the losses agree within ``adamw_rel`` and every parameter tensor
agrees within ``adamw_rel`` (||p_jax - p_torch|| / ||p_torch||).
"""

from __future__ import annotations

import numpy as np
import pytest

from parity_tests.inputs import CHUNK_SIZE, rel_norm
from parity_tests.tolerances import tol
from twinseq.common.config import TrainConfig

torch = pytest.importorskip("torch")
pytest.importorskip("jax")

NUM_STEPS = 20


def _step_batches(harness, step: int):
    padded, padding_free = harness.batches["padded"], harness.batches["padding_free"]
    if step % 2:
        total = padded.num_label_tokens + padding_free.num_label_tokens
        return [padded.with_num_items(total), padding_free.with_num_items(total)]
    return [padded if step % 4 == 0 else padding_free]


def _train_config(tmp_path) -> TrainConfig:
    return TrainConfig.from_flat(backend="jax", output_dir=str(tmp_path), max_steps=NUM_STEPS, learning_rate=1e-3,
                       warmup_steps=3, lr_scheduler_type="cosine", weight_decay=0.1, max_grad_norm=1.0,
                       per_device_train_batch_size=1, loss_type="nll", disable_tqdm=True,
                       # the harness's shapes and chunk size, so the jitted step compiled by the
                       # gradient tests is reused (buckets of 4: [4, 12] and [1, 32] stay as they are)
                       pad_to_multiple_of=4, loss_chunk_size=CHUNK_SIZE)


@pytest.mark.slow
def test_twenty_adamw_steps_match(harness, tmp_path):
    import twinseq.jax_backend as jb
    import twinseq.torch_backend as tb
    from twinseq.jax_backend.model import export_weights as jax_export
    from twinseq.jax_backend.trainer import SFTTrainer as JaxTrainer
    from twinseq.torch_backend.parallel import parallelize
    from twinseq.torch_backend.trainer import SFTTrainer as TorchTrainer

    cfg = _train_config(tmp_path)
    torch_model = tb.build_model(harness.cfg, harness.weights)
    torch_trainer = TorchTrainer(cfg, parallelize(torch_model, None, cfg), torch.device("cpu"))
    trainer = JaxTrainer(jb.build_model(harness.cfg, harness.weights), cfg)
    worst_loss, worst_param, clipped = 0.0, 0.0, 0
    for step in range(NUM_STEPS):
        batches = _step_batches(harness, step)
        torch_out = torch_trainer.step(batches)
        jax_out = trainer.step(batches)
        loss_rel = abs(jax_out["loss"] - torch_out["loss"]) / abs(torch_out["loss"])
        assert jax_out["lr"] == pytest.approx(torch_out["lr"], rel=1e-7), step
        clipped += cfg.optim.max_grad_norm is not None and torch_out["grad_norm"] > cfg.optim.max_grad_norm
        torch_params, jax_params = tb.export_weights(torch_model), jax_export(trainer.model())
        rel = {k: rel_norm(jax_params[k], torch_params[k]) for k in torch_params}
        name = max(rel, key=rel.get)
        worst_loss, worst_param = max(worst_loss, loss_rel), max(worst_param, rel[name])
        assert loss_rel <= tol("float32", "adamw_rel"), (step, jax_out["loss"], torch_out["loss"])
        assert rel[name] <= tol("float32", "adamw_rel"), (step, name, rel[name])
    moved = rel_norm(tb.export_weights(torch_model)["model.layers.0.mlp.up_proj.weight"],
                     harness.weights["model.layers.0.mlp.up_proj.weight"])
    print(f"{NUM_STEPS} AdamW steps: worst loss rel {worst_loss:.2e}, worst param rel {worst_param:.2e}; "
          f"{clipped} steps clipped; up_proj moved by {moved:.2e} relative")
    assert clipped > 0 and moved > 1e-2, "the test must exercise clipping and real parameter motion"
    assert np.isfinite(worst_param)
