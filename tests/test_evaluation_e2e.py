"""Evaluation during training, end to end on both backends (``common.run.evaluation`` over each backend's hooks).

- SFT: ``eval_loss`` falls while a tiny model learns; the first ``eval_loss`` of a pretrained folder is the loss
  ``transformers`` computes on the same tokens and labels (sum of NLL / label tokens over the eval set), padded,
  padding-free and packed;
- DPO: TRL's eval reward metrics, ln 2 and zero rewards while the policy is the reference;
- GRPO: ``eval_reward`` of greedy completions on held-out prompts, and ``log_completions``' tables;
- early stopping stops a run; ``load_best_model_at_end`` ends with the best checkpoint's weights.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from twinseq.common.backend import load_backend
from twinseq.common.cli import main as cli_main
from twinseq.common.config import ModelConfig, TrainConfig
from twinseq.common.data.corpus import load_embedded
from twinseq.common.data.loading import load_dataset_any
from twinseq.common.data.prepare import tokenize_sft
from twinseq.common.data.tokenizer import load_tokenizer
from twinseq.common.models.init import init_weights
from twinseq.common.run.checkpoint import list_checkpoints, load_training_checkpoint
from twinseq.common.run.report import read_metrics

BACKENDS = ["torch", "jax"]


def _cfg(backend, out, **kw):
    base = dict(
        backend=backend, model_config="tiny", max_length=64, per_device_train_batch_size=4, learning_rate=1e-3,
        warmup_steps=0, lr_scheduler_type="constant", output_dir=str(out), disable_tqdm=True, seed=0,
        dataset_split="train[:120]", eval_fraction=0.1, per_device_eval_batch_size=8,
    )
    return TrainConfig.from_flat(**{**base, **kw})


@pytest.fixture(scope="module")
def jsonl_pair(tmp_path_factory):
    """(train file, eval file) of prompt/completion rows short enough that nothing is truncated at 128 tokens."""
    rows = [r for r in load_embedded("embedded-sft").select(range(300)) if len(r["prompt"] + r["completion"]) < 160]
    folder = tmp_path_factory.mktemp("data")
    paths = []
    for name, part in (("train", rows[:40]), ("eval", rows[40:52])):
        path = folder / f"{name}.jsonl"
        lines = [json.dumps({"prompt": r["prompt"], "completion": r["completion"]}) + "\n" for r in part]
        path.write_text("".join(lines))
        paths.append(str(path))
    return paths


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    """A tiny model folder written by each backend's ``save_pretrained`` (the same weights)."""
    cfg = ModelConfig.preset("tiny")
    weights = init_weights(cfg, seed=7)
    folders = {}
    for backend in BACKENDS:
        be = load_backend(backend)
        folders[backend] = be.save_pretrained(be.build_model(cfg, weights), tmp_path_factory.mktemp(backend) / "m")
    return folders


def _hf_loss(folder, eval_file) -> float:
    """transformers' token-normalised loss over the eval file: Σ NLL / label tokens, on the tokens twinseq's data
    layer gives each row, labels = input_ids with the prompt masked (``completion_mask``), as twinseq masks them."""
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), torch_dtype=torch.float32, attn_implementation="eager")
    model.eval()
    rows, _ = tokenize_sft(load_dataset_any(eval_file), load_tokenizer("embedded"), max_length=128)  # as the run
    total, count = 0.0, 0
    for ids, mask in zip(rows["input_ids"], rows["completion_mask"]):
        labels = [t if m else -100 for t, m in zip(ids, mask)]
        n = sum(1 for t in labels[1:] if t != -100)
        with torch.no_grad():
            mean = model(torch.tensor([ids]), labels=torch.tensor([labels])).loss
        total, count = total + float(mean) * n, count + n
    return total / count


# fast-tier budget: the jax case runs in make test-all and CI
@pytest.mark.parametrize("backend", ["torch", pytest.param("jax", marks=pytest.mark.slow)])
def test_eval_loss_falls_while_sft_learns(backend, tmp_path):
    args = ["train", "--backend", backend, "--output-dir", str(tmp_path), "--max-steps", "8", "--max-length", "64",
            "--dataset-split", "train[:200]", "--per-device-train-batch-size", "4", "--learning-rate", "1e-3",
            "--eval-strategy", "steps", "--eval-steps", "4", "--eval-fraction", "0.1", "--eval-on-start",
            "--per-device-eval-batch-size", "10", "--disable-tqdm", "--seed", "0"]
    assert cli_main(args) == 0
    evals = read_metrics(tmp_path, "eval")
    assert [r["step"] for r in evals] == [0, 4, 8]
    losses = [r["eval_loss"] for r in evals]
    assert losses[-1] < losses[0] - 0.1 and all(0 <= r["eval_mean_token_accuracy"] <= 1 for r in evals)
    assert evals[0]["eval_num_label_tokens"] == evals[-1]["eval_num_label_tokens"] > 0  # the same 20 held-out rows
    assert [r["step"] for r in read_metrics(tmp_path)] == list(range(1, 9))  # the training lines stay apart
    assert (tmp_path / "metrics.png").is_file()


@pytest.mark.parametrize(
    "backend, layout",
    [
        ("torch", {}),
        ("torch", {"padding_free": True}),
        ("torch", {"packing": True, "padding_free": True}),
        ("jax", {}),
        ("jax", {"packing": True, "padding_free": True}),
    ],
)
def test_first_eval_loss_is_transformers_loss(backend, layout, tiny_folder, jsonl_pair, tmp_path):
    train_file, eval_file = jsonl_pair
    cfg = _cfg(
        backend, tmp_path, model_config=str(tiny_folder[backend]), dataset_name=train_file, dataset_split="train",
        eval_fraction=None, eval_dataset_name=eval_file, eval_on_start=True, max_steps=1, max_length=128,
        per_device_eval_batch_size=5, **layout,
    )
    load_backend(backend).train(cfg)
    first = read_metrics(tmp_path, "eval")[0]
    reference = _hf_loss(tiny_folder[backend], eval_file)
    assert first["step"] == 0
    assert first["eval_loss"] == pytest.approx(reference, rel=1e-4), (first["eval_loss"], reference)


@pytest.mark.parametrize("backend", BACKENDS)
def test_dpo_eval_reports_trl_reward_metrics(backend, tmp_path):
    load_backend(backend).train(_cfg(
        backend, tmp_path, task="dpo", max_steps=2, eval_strategy="steps", eval_steps=2, eval_on_start=True,
        per_device_train_batch_size=2,
    ))
    start, end = read_metrics(tmp_path, "eval")
    keys = ["eval_loss", "eval_rewards/chosen", "eval_rewards/rejected", "eval_rewards/accuracies",
            "eval_rewards/margins", "eval_logps/chosen", "eval_logps/rejected"]
    assert all(k in start and k in end for k in keys)
    # before any update the policy is its reference: sigmoid loss ln 2, every reward 0, no pair won
    assert start["eval_loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert abs(start["eval_rewards/margins"]) < 1e-6 and start["eval_rewards/accuracies"] == 0.0
    assert 0 <= end["eval_rewards/accuracies"] <= 1 and end["eval_rewards/margins"] == pytest.approx(
        end["eval_rewards/chosen"] - end["eval_rewards/rejected"], abs=1e-9
    )
    assert end["eval_loss"] != start["eval_loss"] and end["eval_logps/chosen"] < 0


# fast-tier budget: the jax case runs in make test-all and CI
@pytest.mark.parametrize("backend", ["torch", pytest.param("jax", marks=pytest.mark.slow)])
def test_grpo_eval_reward_on_held_out_prompts(backend, tmp_path):
    load_backend(backend).train(_cfg(
        backend, tmp_path, task="grpo", dataset_split="train", max_steps=1, num_generations=2,
        max_completion_length=4, eval_strategy="steps", eval_steps=1, eval_fraction=0.01, log_completions=True,
    ))
    (record,) = read_metrics(tmp_path, "eval")
    assert 0.0 <= record["eval_reward"] <= 2.0  # two reward functions of [0, 1], weight 1
    assert {"eval_rewards/exact_match/mean", "eval_rewards/format/mean", "eval_completions/mean_length"} <= set(record)
    samples = [json.loads(x) for x in (tmp_path / "samples" / "step_1.jsonl").read_text().splitlines()]
    assert len(samples) == 6 and {"prompt", "completion", "reward", "format"} <= set(samples[0])  # ceil(0.01 x 512)
    assert np.mean([s["reward"] for s in samples]) == pytest.approx(record["eval_reward"])
    rollouts = [json.loads(x) for x in (tmp_path / "completions.jsonl").read_text().splitlines()]
    assert len(rollouts) == 4 and {"step", "prompt", "completion", "advantage"} <= set(rollouts[0])


@pytest.mark.parametrize("backend", BACKENDS)
def test_early_stopping_stops_the_run(backend, tmp_path):
    """An improvement of 10 nats can't be met: patience 1 stops at the first evaluation after the start."""
    load_backend(backend).train(_cfg(
        backend, tmp_path, max_steps=20, eval_strategy="steps", eval_steps=2, eval_on_start=True,
        early_stopping_patience=1, early_stopping_threshold=10.0,
    ))
    assert [r["step"] for r in read_metrics(tmp_path)][-1] == 2
    assert [r["step"] for r in read_metrics(tmp_path, "eval")] == [0, 2]
    assert (tmp_path / "final").is_dir() and (tmp_path / "checkpoint-2").is_dir()


@pytest.mark.parametrize("backend", BACKENDS)
def test_load_best_model_at_end_ends_with_the_best_checkpoint(backend, tmp_path):
    """The loss falls, so with greater_is_better the best evaluation is the first one (step 2), not the last."""
    from safetensors.numpy import load_file

    load_backend(backend).train(_cfg(
        backend, tmp_path, max_steps=6, eval_strategy="steps", eval_steps=2, load_best_model_at_end=True,
        greater_is_better=True, save_total_limit=1,
    ))
    evals = read_metrics(tmp_path, "eval")
    assert max(evals, key=lambda r: r["eval_loss"])["step"] == 2
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint-2", "checkpoint-6"]
    final = load_file(str(tmp_path / "final" / "model.safetensors"))
    best = load_training_checkpoint(tmp_path / "checkpoint-2")[1]["model"]
    last = load_training_checkpoint(tmp_path / "checkpoint-6")[1]["model"]
    assert all(np.array_equal(final[k], best[k]) for k in final)
    assert not all(np.array_equal(final[k], last[k]) for k in final)
