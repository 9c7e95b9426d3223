"""Evaluation during training, framework-free: the config rules, the eval set (held out, split, loaded), the eval
micro-batches, the cadence, the best model and the runner's use of them with a numpy stand-in trainer."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from twinseq.common.config import TrainConfig
from twinseq.common.data.loading import held_out_indices, load_dataset_any
from twinseq.common.data.prepare import eval_dataset, prepare_sft_dataset
from twinseq.common.data.prompts import prepare_grpo_eval_prompts, prepare_grpo_prompts
from twinseq.common.data.tokenizer import load_tokenizer
from twinseq.common.errors import ConfigError, DataError
from twinseq.common.run.callbacks import EarlyStoppingCallback, TrainerState
from twinseq.common.run.checkpoint import list_checkpoints, load_training_checkpoint
from twinseq.common.run.eval_set import eval_step_batches, sample_prompts
from twinseq.common.run.evaluation import Evaluator, evaluate, track_best
from twinseq.common.run.report import RunLogger, is_eval_record, read_metrics, summarize_eval
from twinseq.common.run.runner import run

# --------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "flat, fragment",
    [
        (dict(load_best_model_at_end=True), "needs evaluations"),
        (dict(eval_strategy="steps", eval_steps=3, save_steps=4, load_best_model_at_end=True), "multiple of 3"),
        (dict(eval_strategy="epoch", save_steps=4, load_best_model_at_end=True), "save_steps"),
        (dict(early_stopping_patience=2), "counts evaluations"),
        (dict(eval_strategy="steps", early_stopping_threshold=0.1), "early_stopping_patience"),
        (dict(eval_fraction=0.1, eval_split="test"), "give one of them"),
        (dict(task="dpo", eval_generate_samples=2), "SFT's"),
        (dict(eval_strategy="sideways"), "eval_strategy"),
        (dict(eval_fraction=1.0), "eval_fraction"),
    ],
)
def test_bad_evaluation_configs_are_refused(flat, fragment):
    with pytest.raises(ConfigError, match=fragment):
        TrainConfig.from_flat(**flat)


def test_hf_defaults_of_the_evaluation_fields():
    cfg = TrainConfig.from_flat(logging_steps=5, eval_strategy="steps", load_best_model_at_end=True, save_steps=10)
    assert cfg.effective_eval_steps == 5  # eval_steps None: logging_steps, as HF
    assert cfg.effective_metric_for_best_model == "eval_loss" and not cfg.effective_greater_is_better
    grpo = TrainConfig.from_flat(task="grpo", per_device_train_batch_size=8, metric_for_best_model=None)
    assert grpo.effective_metric_for_best_model == "eval_reward" and grpo.effective_greater_is_better
    named = TrainConfig.from_flat(metric_for_best_model="mean_token_accuracy")
    assert named.effective_metric_for_best_model == "eval_mean_token_accuracy" and named.effective_greater_is_better


# --------------------------------------------------------------------------------------
# The eval set
# --------------------------------------------------------------------------------------


def test_held_out_rows_are_drawn_from_the_seed_and_never_trained_on():
    train, held = held_out_indices(100, 0.1, seed=3)
    assert len(held) == 10 and not set(train) & set(held) and sorted(train + held) == list(range(100))
    assert held_out_indices(100, 0.1, seed=3) == (train, held)
    assert held_out_indices(100, 0.1, seed=4)[1] != held
    assert len(held_out_indices(7, 0.1, seed=0)[1]) == 1  # ceil, as datasets' train_test_split
    with pytest.raises(DataError, match="both need at least one row"):
        held_out_indices(1, 0.5, seed=0)


def test_eval_fraction_removes_the_held_out_rows_from_the_training_rows(tmp_path):
    rows = [{"prompt": f"question {i}?", "completion": f" answer {i}."} for i in range(40)]
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = TrainConfig.from_flat(dataset_name=str(path), eval_fraction=0.25, seed=1, max_length=64)
    held = eval_dataset(cfg, "sft")
    assert len(held) == 10
    tok = load_tokenizer("embedded")
    train_rows, _, _ = prepare_sft_dataset(cfg, tokenizer=tok)
    assert len(train_rows) == 30
    train_ids = {tuple(r) for r in train_rows["input_ids"]}
    held_ids, _, _ = prepare_sft_dataset(cfg, held, tok, held_out=True)
    assert len(held_ids) == 10 and not train_ids & {tuple(r) for r in held_ids["input_ids"]}
    # a Python train_dataset is split the same way, and an eval_dataset beside eval_fraction is refused
    assert eval_dataset(cfg, "sft", train_dataset=rows)["prompt"] == held["prompt"]
    with pytest.raises(DataError, match="drop one of them"):
        eval_dataset(cfg, "sft", given=rows[:3])


def test_a_split_of_a_saved_dataset_is_an_eval_set_and_embedded_data_points_to_eval_fraction(tmp_path):
    from datasets import Dataset, DatasetDict

    splits = {name: Dataset.from_list([{"text": f"{name} {i}"} for i in range(n)])
              for name, n in [("train", 8), ("test", 3)]}
    DatasetDict(splits).save_to_disk(str(tmp_path / "saved"))
    cfg = TrainConfig.from_flat(dataset_name=str(tmp_path / "saved"), eval_split="test")
    assert eval_dataset(cfg, "sft")["text"] == ["test 0", "test 1", "test 2"]
    assert eval_dataset(TrainConfig.from_flat(), "sft") is None
    with pytest.raises(DataError, match="eval_split='test'.*--eval-fraction"):
        eval_dataset(TrainConfig.from_flat(eval_split="test"), "sft")
    with pytest.raises(DataError, match="dataset_split='test'.*--eval-fraction"):
        load_dataset_any("embedded-sft", split="test")


def test_grpo_prompts_honour_the_split_and_the_held_out_fraction():
    tok = load_tokenizer("embedded")
    cfg = TrainConfig.from_flat(task="grpo", per_device_train_batch_size=8, eval_fraction=0.1, seed=2)
    train = prepare_grpo_prompts(cfg, tok)
    held = prepare_grpo_eval_prompts(cfg, tok)
    assert held is not None and len(held) == 52 and len(train) == 512 - 52  # ceil(0.1 x 512) held out
    sliced = TrainConfig.from_flat(task="grpo", per_device_train_batch_size=8, dataset_split="train[:90%]",
                                   eval_split="train[90%:]")
    assert len(prepare_grpo_prompts(sliced, tok)) == 460 and len(prepare_grpo_eval_prompts(sliced, tok) or []) == 52
    with pytest.raises(DataError, match="single split"):
        prepare_grpo_prompts(TrainConfig.from_flat(task="grpo", per_device_train_batch_size=8, dataset_split="test"),
                             tok)


# --------------------------------------------------------------------------------------
# Eval micro-batches, samples, cadence, best
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("packing, padding_free", [(False, False), (False, True), (True, True)])
@pytest.mark.parametrize("world_size", [1, 2])
def test_eval_batches_hold_every_row_once_as_one_step(packing, padding_free, world_size):
    rng = np.random.default_rng(0)
    rows = {"input_ids": [rng.integers(3, 50, size=n).tolist() for n in rng.integers(4, 20, size=23)]}
    cfg = TrainConfig.from_flat(max_length=32, packing=packing, padding_free=padding_free, per_device_eval_batch_size=3)
    per_rank = [eval_step_batches(rows, cfg, 0, world_size=world_size, rank=r) for r in range(world_size)]
    assert len({len(b) for b in per_rank}) == 1  # every rank runs the same number of micro-batches
    batches = [b for rank in per_rank for b in rank]
    total = sum(b.num_label_tokens for b in batches)
    assert total == sum(len(r) - 1 for r in rows["input_ids"])  # each row once (packing keeps every document here)
    assert {b.num_items_in_batch for b in batches} == {total}  # the eval set is the loss's denominator
    assert packing or all(b.shape[0] <= 3 for b in batches if not padding_free)


def test_sample_prompts_cut_at_the_first_target():
    rows = {"input_ids": [[1, 5, 6, 7, 2], [1, 8, 9, 2]], "completion_mask": [[0, 0, 1, 1, 1], [0, 0, 0, 1]]}
    assert sample_prompts(rows, 5) == [([1, 5], [6, 7, 2]), ([1, 8, 9], [2])]
    assert sample_prompts({"input_ids": [[1, 2, 3, 4]]}, 1) == [([1, 2], [3, 4])]


def _evaluator(cfg, steps_per_epoch=None):
    class Scripted(Evaluator):
        task = "sft"

        def collect(self, trainer, step):
            return {"loss": trainer.eval_values.pop(0)}

        def finish(self, sums):
            return {"loss": sums["loss"]}

    return Scripted(cfg, [], num_examples=4, tokenizer=None, steps_per_epoch=steps_per_epoch)


def test_the_cadence_follows_eval_strategy():
    steps = _evaluator(TrainConfig.from_flat(eval_strategy="steps", eval_steps=3, eval_fraction=0.1))
    assert [s for s in range(0, 11) if steps.due(s, 10)] == [3, 6, 9]
    epochs = _evaluator(TrainConfig.from_flat(eval_strategy="epoch", eval_fraction=0.1), steps_per_epoch=4)
    assert [s for s in range(0, 11) if epochs.due(s, 10)] == [4, 8, 10]  # and the last, partial epoch
    never = _evaluator(TrainConfig.from_flat(eval_fraction=0.1))
    assert not any(never.due(s, 10) for s in range(11))


def test_track_best_is_strict_and_follows_greater_is_better():
    cfg, state = TrainConfig.from_flat(), TrainerState()
    assert [track_best(state, cfg, {"eval_loss": v}, s) for s, v in enumerate([3.0, 2.0, 2.0, 2.5, 1.0])] == [
        True, True, False, False, True,
    ]
    assert (state.best_metric, state.best_global_step) == (1.0, 4)
    acc = TrainConfig.from_flat(metric_for_best_model="mean_token_accuracy")
    state = TrainerState()
    track_best(state, acc, {"eval_mean_token_accuracy": 0.2}, 1)
    assert not track_best(state, acc, {"eval_mean_token_accuracy": 0.1}, 2)
    with pytest.raises(ConfigError, match="not among"):
        track_best(state, acc, {"eval_loss": 1.0}, 3)


# --------------------------------------------------------------------------------------
# The runner, with a numpy stand-in for a backend's trainer
# --------------------------------------------------------------------------------------


class FakeTrainer:
    """A model of one weight: each step adds 1 to it; the scripted eval losses say how good it is."""

    is_main = True

    def __init__(self, eval_values):
        self.w, self.eval_values, self.saved = np.zeros(1, np.float32), list(eval_values), None

    def step(self, micro_batches):
        self.w = self.w + 1
        return {"loss": 1.0, "num_tokens": 4}

    def after_step(self, step):
        pass

    def state_dict(self):
        return {"w": self.w.copy()}

    def load_state_dict(self, state):
        self.w = np.asarray(state["w"], np.float32)

    def save_final(self, path):
        Path(path).mkdir(parents=True, exist_ok=True)
        self.saved = float(self.w[0])

    def peak_memory_bytes(self):
        return 0

    def any_rank(self, flag):
        return flag

    def reduce_sums(self, sums):
        return sums


class FakeSource:
    steps_per_epoch = 100

    def __init__(self):
        self.n = 0

    def next_step(self):
        self.n += 1
        return [None]

    def state_dict(self):
        return {"n": self.n}

    def load_state_dict(self, state):
        self.n = state["n"]


class Tok:
    def save_pretrained(self, path):
        pass


def _run(tmp_path, values, callbacks=(), **flat):
    cfg = TrainConfig.from_flat(output_dir=str(tmp_path), disable_tqdm=True, eval_fraction=0.1, **flat)
    trainer = FakeTrainer(values)
    evaluator = _evaluator(cfg)
    run(cfg, trainer, FakeSource(), tokenizer=Tok(), desc="t", callbacks=callbacks, evaluator=evaluator)
    return trainer


def test_eval_lines_are_logged_apart_and_the_best_checkpoint_is_loaded_at_the_end(tmp_path):
    values = [5.0, 4.0, 2.0, 3.0, 3.5]  # after steps 0 (eval_on_start), 2, 4, 6, 8: the best is step 4
    trainer = _run(
        tmp_path, values, max_steps=8, eval_strategy="steps", eval_steps=2, eval_on_start=True,
        load_best_model_at_end=True, save_total_limit=1,
    )
    evals = read_metrics(tmp_path, "eval")
    assert [(r["step"], r["eval_loss"]) for r in evals] == [(0, 5.0), (2, 4.0), (4, 2.0), (6, 3.0), (8, 3.5)]
    assert all("eval_runtime" in r and not is_eval_record(t) for r in evals for t in read_metrics(tmp_path))
    assert [r["step"] for r in read_metrics(tmp_path)] == list(range(1, 9))
    assert trainer.saved == 4.0  # the weights of step 4, restored before the final save
    # save_total_limit=1 keeps the best beside the newest (HF's rotation), and the last state stays resumable
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint-4", "checkpoint-8"]
    meta, state = load_training_checkpoint(tmp_path / "checkpoint-8")
    assert meta["best"]["best_global_step"] == 4 and meta["best"]["best_metric"] == 2.0 and state["w"][0] == 8.0
    assert "eval_loss: step 0 5.0000 -> step 8 3.5000; best 2.0000 at step 4" in summarize_eval(evals)


def test_early_stopping_stops_the_run_and_the_starting_weights_can_stay_the_best(tmp_path):
    values = [2.0, 2.5, 3.0, 9.0]
    trainer = _run(
        tmp_path, values, max_steps=20, eval_strategy="steps", eval_steps=1, eval_on_start=True,
        load_best_model_at_end=True, callbacks=[EarlyStoppingCallback(2)],
    )
    assert [r["step"] for r in read_metrics(tmp_path)][-1] == 2  # two evaluations without improvement
    assert trainer.saved == 0.0  # checkpoint-0, written at eval_on_start, is the best


def test_a_resumed_run_keeps_comparing_with_the_best_so_far(tmp_path):
    _run(tmp_path, [3.0, 1.0, 2.0], max_steps=6, eval_strategy="steps", eval_steps=2, save_steps=2)
    trainer = _run(
        tmp_path, [2.5, 2.2], max_steps=10, eval_strategy="steps", eval_steps=4, save_steps=4,
        load_best_model_at_end=True, resume_from_checkpoint=str(tmp_path / "checkpoint-6"),
    )
    assert trainer.saved == 4.0  # nothing after the resume beat step 4's 1.0: its checkpoint is the final model
    assert [r["step"] for r in read_metrics(tmp_path, "eval")] == [2, 4, 6, 8]


def test_evaluate_adds_the_prefix_and_the_runtime():
    evaluator = _evaluator(TrainConfig.from_flat(eval_fraction=0.1))
    out = evaluate(FakeTrainer([1.5]), evaluator)
    assert out["eval_loss"] == 1.5 and out["eval_runtime"] >= 0 and math.isfinite(out["eval_samples_per_second"])


def test_tensorboard_names_eval_metrics_as_hugging_face_does(tmp_path):
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    log = RunLogger(tmp_path, max_steps=2, disable_tqdm=True, report_to="tensorboard")
    log.log_step({"step": 1, "loss": 2.0, "num_tokens": 4, "tokens_per_second": 1.0, "peak_memory_bytes": 1})
    log.log_eval({"step": 1, "eval_loss": 1.5, "eval_rewards/accuracies": 0.5})
    log.close()
    acc = event_accumulator.EventAccumulator(str(tmp_path / "runs"))
    acc.Reload()
    assert {"train/loss", "eval/loss", "eval/rewards/accuracies"} <= set(acc.Tags()["scalars"])
    assert [(e.step, e.value) for e in acc.Scalars("eval/loss")] == [(1, 1.5)]
    assert read_metrics(tmp_path, "all")[1] == {"step": 1, "eval_loss": 1.5, "eval_rewards/accuracies": 0.5}
