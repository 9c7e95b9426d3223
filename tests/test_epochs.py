"""``num_train_epochs`` end to end on both backends (issue 26, item 3), as a TRL/HF Trainer user expects it.

Invariants:
- ``--max-steps -1 --num-train-epochs 2`` runs exactly two passes: the summed ``num_tokens`` (and label tokens) of
  ``metrics.jsonl`` are twice those of the tokenised rows, counted here from the rows themselves; the ``epoch``
  column climbs by ``1 / steps_per_epoch`` and ends at 2.0, and reaches TensorBoard as ``train/epoch``;
- the data is 21 rows at 4 rows per step, so each epoch ends with a step of 1 row, which leaves a padding-only
  micro-batch: it runs on both backends and adds nothing;
- a run resumed from a checkpoint in the middle of epoch 2 is bitwise the run that never stopped (CPU);
- DPO counts epochs in pairs: 9 pairs at 4 per step are 3 steps per epoch, the last of one pair, whose loss is
  normalised by its own pair count;
- every builder hands its trainer the resolved ``max_steps``, so the learning-rate schedule spans the whole run.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from twinseq.common.backend import load_backend
from twinseq.common.config import TrainConfig
from twinseq.common.data.batching import collate
from twinseq.common.data.corpus import load_embedded
from twinseq.common.data.prepare import prepare_dpo_dataset, prepare_sft_dataset
from twinseq.common.run.report import read_metrics

NUM_ROWS, NUM_PAIRS = 21, 9
STEPS_PER_EPOCH = 6  # ceil(21 rows / (2 per micro-batch x 2 micro-batches))


@pytest.fixture(scope="module")
def sft_jsonl(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "sft.jsonl"
    rows = load_embedded("embedded-sft").select(range(NUM_ROWS))
    path.write_text("".join(json.dumps({"prompt": r["prompt"], "completion": r["completion"]}) + "\n" for r in rows))
    return str(path)


@pytest.fixture(scope="module")
def dpo_jsonl(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "dpo.jsonl"
    rows = load_embedded("embedded-preference").select(range(NUM_PAIRS))
    path.write_text("".join(json.dumps({k: r[k] for k in ("prompt", "chosen", "rejected")}) + "\n" for r in rows))
    return str(path)


def _cfg(data, out, **kw) -> TrainConfig:
    base = dict(dataset_name=data, model_config="tiny", max_length=96, per_device_train_batch_size=2,
                gradient_accumulation_steps=2, learning_rate=3e-3, warmup_ratio=0.2, max_steps=-1,
                num_train_epochs=2, output_dir=str(out), disable_tqdm=True, seed=3)
    return TrainConfig.from_flat(**{**base, **kw})


def _one_pass(cfg: TrainConfig) -> tuple[int, int]:
    """(tokens, label tokens) of one pass, from the tokenised rows, one row at a time."""
    rows, _, _ = prepare_sft_dataset(cfg)
    assert len(rows) == NUM_ROWS
    batches = [collate([{k: rows[k][i] for k in rows.column_names}]) for i in range(NUM_ROWS)]
    return sum(b.num_tokens for b in batches), sum(b.num_label_tokens for b in batches)


@pytest.mark.parametrize("backend", ["torch", "jax"])
def test_two_epochs_are_two_passes_over_the_rows(backend, sft_jsonl, tmp_path):
    pytest.importorskip(backend)
    report_to = ["tensorboard"] if backend == "torch" else ["none"]
    cfg = _cfg(sft_jsonl, tmp_path, backend=backend, report_to=report_to)
    load_backend(backend).train(cfg)
    records = read_metrics(tmp_path)
    tokens, labels = _one_pass(cfg)
    assert [r["step"] for r in records] == list(range(1, 2 * STEPS_PER_EPOCH + 1))
    assert sum(r["num_tokens"] for r in records) == 2 * tokens
    assert sum(r["num_label_tokens"] for r in records) == 2 * labels
    assert [r["epoch"] for r in records] == [s / STEPS_PER_EPOCH for s in range(1, 13)]
    assert records[STEPS_PER_EPOCH - 1]["epoch"] == 1.0 and records[-1]["epoch"] == 2.0
    # each epoch's tokens are one pass: the epoch boundary is real, no step crosses it
    assert sum(r["num_tokens"] for r in records[:STEPS_PER_EPOCH]) == tokens
    assert all(np.isfinite(r["loss"]) for r in records)
    # the cosine schedule spans the 12 resolved steps: warmup_ratio 0.2 of 12 is 2 warmup steps, then decay
    assert records[0]["lr"] == 0.0 and records[2]["lr"] == pytest.approx(3e-3) and records[-1]["lr"] < 3e-4
    if backend == "torch":
        ea = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
        acc = ea.EventAccumulator(str(tmp_path / "runs"))
        acc.Reload()
        assert [(e.step, e.value) for e in acc.Scalars("train/epoch")][-1] == (12, 2.0)


def _resume_in_epoch_two(backend: str, data: str, tmp_path) -> tuple[list[dict], list[dict]]:
    """12 steps straight, and the same run stopped after step 8 (epoch 1.33) and resumed from checkpoint-8."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    load_backend(backend).train(_cfg(data, straight, backend=backend, save_steps=8))
    resumed.mkdir()
    shutil.copytree(straight / "checkpoint-8", resumed / "checkpoint-8")
    lines = (straight / "metrics.jsonl").read_text().splitlines()[:8]
    (resumed / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    load_backend(backend).train(
        _cfg(data, resumed, backend=backend, resume_from_checkpoint=str(resumed / "checkpoint-8"))
    )
    return read_metrics(straight), read_metrics(resumed)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["torch", "jax"])
def test_a_resume_in_the_middle_of_epoch_two_is_bitwise_the_straight_run(backend, sft_jsonl, tmp_path):
    pytest.importorskip(backend)
    from twinseq.common.models.hf_folder import read_hf_checkpoint

    a, b = _resume_in_epoch_two(backend, sft_jsonl, tmp_path)
    assert [r["step"] for r in b] == list(range(1, 13)) and b[7]["epoch"] == 8 / STEPS_PER_EPOCH
    for key in ("loss", "grad_norm", "num_tokens", "lr", "epoch"):
        assert [r[key] for r in a] == [r[key] for r in b], key  # bitwise: exact equality
    _, wa = read_hf_checkpoint(tmp_path / "straight" / "final")
    _, wb = read_hf_checkpoint(tmp_path / "resumed" / "final")
    assert sorted(wa) == sorted(wb) and all(wa[k].tobytes() == wb[k].tobytes() for k in wa)


@pytest.mark.slow  # fast-tier budget: runs in make test-all and CI
@pytest.mark.parametrize("backend", ["torch", "jax"])
def test_dpo_epochs_count_pairs(backend, dpo_jsonl, tmp_path):
    pytest.importorskip(backend)
    cfg = _cfg(dpo_jsonl, tmp_path, backend=backend, task="dpo", learning_rate=1e-3, precompute_ref_log_probs=True)
    load_backend(backend).train(cfg)
    records = read_metrics(tmp_path)
    rows, _, _ = prepare_dpo_dataset(cfg)
    # prefix sharing (DPO's default): a pair is its prompt once, plus a copy of the prompt's last token for each side
    tokens = sum(len(p) + 1 + len(c) + len(r) for p, c, r in
                 zip(rows["prompt_input_ids"], rows["chosen_input_ids"], rows["rejected_input_ids"]))
    assert [r["num_pairs"] for r in records] == [4, 4, 1] * 2
    assert sum(r["num_tokens"] for r in records) == 2 * tokens
    assert [r["epoch"] for r in records] == [s / 3 for s in range(1, 7)]
    # the one-pair step is normalised by its one pair (divided by 4 it would be about 0.69 / 4 early in training)
    assert 0.3 < records[2]["loss"] < 1.0, records[2]


@pytest.mark.parametrize("backend, task", [("torch", "sft"), ("torch", "dpo"), ("torch", "grpo"), ("jax", "sft"),
                                           ("jax", "dpo"), ("jax", "grpo")])
def test_every_builder_gives_its_trainer_the_resolved_max_steps(backend, task, sft_jsonl, dpo_jsonl, tmp_path):
    pytest.importorskip(backend)
    data = {"sft": sft_jsonl, "dpo": dpo_jsonl, "grpo": "embedded"}[task]
    extra = dict(num_generations=2, max_completion_length=4) if task == "grpo" else {}
    cfg = _cfg(data, tmp_path, backend=backend, task=task, num_train_epochs=1.5, **extra)
    if backend == "torch":
        import torch

        from twinseq.torch_backend.recipes import builders

        trainer, source, _, _ = builders(cfg, torch.device("cpu"), None)[task]()
    else:
        from twinseq.jax_backend.recipes import builders

        trainer, source, _, _ = builders(cfg)[task]()
    want = -(-3 * source.steps_per_epoch // 2)
    assert trainer.cfg.max_steps == want and cfg.max_steps == -1
