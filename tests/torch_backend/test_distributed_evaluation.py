"""Evaluation under FSDP2 (+ allgather CP) on 2 gloo ranks: every rank runs its share of the eval set (a rank
short of rows runs padding-only micro-batches), the sums are all-reduced, and the metrics equal one process's.

Each run goes through the trainer and the runner (``_dist_workers``' ``run`` job); the single process evaluates the
same held-out rows. Before any step the weights are equal, so ``eval_loss`` agrees to float32 summation order;
after FSDP2's steps (which follow the single process within 1e-5, test_distributed.py) it agrees to that bound.
Greedy samples (``eval_generate_samples``) generate inside the root module's forward, every rank in step.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

sys.path.insert(0, str(Path(__file__).parent))
import _dist_workers as W  # noqa: E402

from twinseq.common.config import TrainConfig  # noqa: E402
from twinseq.common.run.report import read_metrics  # noqa: E402
from twinseq.torch_backend.recipes import train  # noqa: E402

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


@pytest.fixture(scope="module")
def sft_jsonl(tmp_path_factory) -> Path:
    from twinseq.common.data.corpus import load_embedded

    path = tmp_path_factory.mktemp("data") / "sft.jsonl"
    rows = load_embedded("embedded-sft").select(range(60))
    path.write_text("".join(json.dumps({"prompt": r["prompt"], "completion": r["completion"]}) + "\n" for r in rows))
    return path


BASE = dict(model_config="tiny", max_length=64, learning_rate=3e-3, max_steps=4, disable_tqdm=True, seed=0,
            eval_fraction=0.2, eval_strategy="steps", eval_steps=2, eval_on_start=True, per_device_eval_batch_size=2)


@pytest.mark.parametrize(
    "name, dist, single",
    [
        # 2 ranks x 2 rows = one process's 2 micro-batches of 2 rows
        ("fsdp", dict(per_device_train_batch_size=2, eval_generate_samples=1),
         dict(per_device_train_batch_size=2, gradient_accumulation_steps=2, eval_generate_samples=1)),
        ("cp_packed", dict(packing=True, padding_free=True, pad_to_multiple_of=4, context_parallel_size=2,
                           attn_implementation="varlen", per_device_train_batch_size=2),
         dict(packing=True, padding_free=True, pad_to_multiple_of=4, attn_implementation="varlen",
              per_device_train_batch_size=2)),
    ],
)
def test_distributed_eval_equals_one_process(name, dist, single, sft_jsonl, tmp_path):
    out = tmp_path / "dist"
    cfg = TrainConfig.from_flat(**BASE, **dist, dataset_name=str(sft_jsonl), output_dir=str(out))
    (tmp_path / "launch").mkdir()
    W.launch({"jobs": [{"kind": "run", "name": name, "config": cfg.to_dict()}]}, tmp_path / "launch", world_size=2)
    train(TrainConfig.from_flat(**BASE, **single, dataset_name=str(sft_jsonl), output_dir=str(tmp_path / "one")))
    a, b = read_metrics(out, "eval"), read_metrics(tmp_path / "one", "eval")
    assert [r["step"] for r in a] == [r["step"] for r in b] == [0, 2, 4]
    assert a[0]["eval_num_label_tokens"] == b[0]["eval_num_label_tokens"]  # the 12 held-out rows, once each
    assert a[0]["eval_loss"] == pytest.approx(b[0]["eval_loss"], rel=1e-6)
    for x, y in zip(a, b):
        assert x["eval_loss"] == pytest.approx(y["eval_loss"], rel=1e-5)
        assert x["eval_mean_token_accuracy"] == pytest.approx(y["eval_mean_token_accuracy"], abs=1e-9)
    if dist.get("eval_generate_samples"):
        assert (out / "samples" / "step_4.md").is_file()
