"""Evaluation on a (data=4, cp=2) mesh of 8 host CPU devices: an eval micro-batch of 3 rows is padded to whole rows
per data replica and sharded as a training batch is, and the eval metrics equal the single device's."""

from __future__ import annotations

import jax
import pytest

from twinseq.common.config import TrainConfig
from twinseq.common.run.report import read_metrics
from twinseq.jax_backend.recipes import train

pytestmark = [pytest.mark.multi_device, pytest.mark.slow]


@pytest.fixture(autouse=True)
def _highest_precision():
    with jax.default_matmul_precision("highest"):
        yield


def test_eval_on_a_mesh_equals_one_device(tmp_path):
    if jax.device_count() < 8:
        pytest.skip("needs 8 host devices (XLA_FLAGS=--xla_force_host_platform_device_count=8, set by conftest.py)")
    base = dict(backend="jax", model_config="tiny", max_length=64, max_steps=2, learning_rate=1e-3, disable_tqdm=True,
                eval_fraction=0.1, eval_strategy="steps", eval_steps=2, eval_on_start=True, dataset_split="train[:120]",
                per_device_eval_batch_size=3)
    train(TrainConfig.from_flat(**base, context_parallel_size=2, pad_to_multiple_of=4, per_device_train_batch_size=1,
                                output_dir=str(tmp_path / "mesh")))
    train(TrainConfig.from_flat(**base, per_device_train_batch_size=4, output_dir=str(tmp_path / "one")))
    mesh, one = read_metrics(tmp_path / "mesh", "eval"), read_metrics(tmp_path / "one", "eval")
    assert [r["step"] for r in mesh] == [r["step"] for r in one] == [0, 2]
    assert mesh[0]["eval_num_label_tokens"] == one[0]["eval_num_label_tokens"]
    for a, b in zip(mesh, one):
        assert a["eval_loss"] == pytest.approx(b["eval_loss"], rel=1e-5)
