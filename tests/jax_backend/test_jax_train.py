"""The JAX trainer end to end on the embedded data: metrics.jsonl, checkpoints, resume.

Invariants:
- every step writes the required metric fields, finite, with the step's token counts;
- a run resumed from ``checkpoint-2`` logs steps 3-4 bit-identical to the run that never
  stopped (same data order, parameters and optimizer state; CPU, float32);
- the final checkpoint imports back into the model the trainer ended with;
- options the jax trainer cannot honour raise ``ValueError`` before any work.
"""

from __future__ import annotations

import pytest

from twinseq.common.config import TrainConfig
from twinseq.common.run.report import REQUIRED_FIELDS, read_metrics


def _cfg(output_dir, **overrides) -> TrainConfig:
    values = dict(backend="jax", output_dir=str(output_dir), max_steps=4, save_steps=2, max_length=64,
                  per_device_train_batch_size=2, gradient_accumulation_steps=2, pad_to_multiple_of=64,
                  loss_type="fused_linear", loss_chunk_size=64, disable_tqdm=True, learning_rate=3e-3)
    return TrainConfig.from_flat(**{**values, **overrides})


@pytest.mark.slow
def test_train_logs_checkpoints_and_resumes_bitwise(tmp_path):
    import numpy as np

    import twinseq.jax_backend as jb
    from twinseq.common.run.checkpoint import load_training_checkpoint
    from twinseq.common.models.hf_folder import read_hf_checkpoint

    path = jb.train(_cfg(tmp_path / "full"))
    records = read_metrics(tmp_path / "full")
    assert str(path).endswith("metrics.jsonl") and [r["step"] for r in records] == [1, 2, 3, 4]
    for record in records:
        assert all(k in record for k in REQUIRED_FIELDS)
        assert np.isfinite(record["loss"]) and record["num_label_tokens"] <= record["num_tokens"]
    assert records[-1]["loss"] < records[0]["loss"]

    jb.train(_cfg(tmp_path / "resumed", resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-2")))
    resumed = read_metrics(tmp_path / "resumed")
    assert [r["step"] for r in resumed] == [3, 4]
    for a, b in zip(records[2:], resumed):
        assert (a["loss"], a["grad_norm"], a["num_tokens"]) == (b["loss"], b["grad_norm"], b["num_tokens"])

    _, final = read_hf_checkpoint(tmp_path / "full" / "final")
    _, last = load_training_checkpoint(tmp_path / "full" / "checkpoint-4")
    assert sorted(final) == sorted(last["model"])
    assert all(final[k].tobytes() == last["model"][k].tobytes() for k in final)


@pytest.mark.parametrize("overrides,match", [
    ({"loss_type": "liger"}, "fused_linear"),
    ({"torch_compile": True}, "torch_compile"),
    ({"activation_offloading": True}, "activation_offloading"),
    ({"fsdp": True}, "fsdp=True is a torch option"),
])
def test_unsupported_options_raise_before_any_work(tmp_path, overrides, match):
    import twinseq.jax_backend as jb

    with pytest.raises(ValueError, match=match):
        jb.train(_cfg(tmp_path, dataset_name="/nonexistent.jsonl", **overrides))


def test_pad_batch_keeps_the_loss_inputs():
    import numpy as np

    from twinseq.common.data.batching import collate
    from twinseq.common.data.batching import pad_batch

    batch = collate([{"input_ids": [5, 6, 7]}, {"input_ids": [8, 9]}], padding_free=True)
    padded = pad_batch(batch, rows=2, multiple=8)
    assert padded.shape == (2, 8) and padded.num_label_tokens == batch.num_label_tokens
    assert padded.num_tokens == batch.num_tokens and padded.num_items_in_batch == batch.num_items_in_batch
    np.testing.assert_array_equal(padded.input_ids[0, :5], batch.input_ids[0])
    assert (padded.segment_ids[:, 5:] == 0).all() and (padded.labels[1] == -100).all()
