"""``steps_per_generation`` / ``generation_batch_size`` and the entropy bonus in real GRPO runs, on both backends.

Invariants:
- one generation of ``per_device_train_batch_size x steps_per_generation`` completions feeds
  ``steps_per_generation / gradient_accumulation_steps`` optimizer steps: only the first generates, and with the
  weights held (learning rate 0) the steps' losses add up to k times the loss of one step over the whole generation
  (TRL's per-step normaliser: the generation's tokens per step), the same prompts and completions;
- the prompt stream's epoch counts the optimizer steps of every generation;
- with the entropy bonus the run logs ``policy_loss`` and ``entropy_coef``; adaptive control applies no bonus on the
  first step (loss == policy_loss) and its coefficient survives a resume;
- the fields are refused with the field, the value and the fix when they cannot hold.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from twinseq.common.config import TrainConfig
from twinseq.common.data.prompts import PromptSource
from twinseq.common.errors import ConfigError
from twinseq.common.objectives.grpo import GRPOConfig, generation_steps

BASE = dict(model_config="tiny", per_device_train_batch_size=4, num_generations=4, max_completion_length=4,
            max_prompt_length=64, disable_tqdm=True, learning_rate=0.0, lr_scheduler_type="constant", seed=3)


def _train(backend: str, tmp_path, **flat) -> list[dict]:
    if backend == "torch":
        pytest.importorskip("torch")
        from twinseq.torch_backend.recipes import train
    else:
        pytest.importorskip("jax")
        from twinseq.jax_backend.recipes import train
    cfg = TrainConfig.from_flat(task="grpo", backend=backend, output_dir=str(tmp_path), **{**BASE, **flat})
    path = train(cfg)
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("backend", ["torch", pytest.param("jax", marks=pytest.mark.slow)])
def test_one_generation_feeds_k_steps_and_their_losses_add_up(backend, tmp_path):
    split = _train(backend, tmp_path / "split", max_steps=2, gradient_accumulation_steps=1, steps_per_generation=2)
    whole = _train(backend, tmp_path / "whole", max_steps=1, gradient_accumulation_steps=2)
    assert split[0]["generation_seconds"] > 0 and split[1]["generation_seconds"] == 0.0
    assert split[0]["reward"] == split[1]["reward"] == whole[0]["reward"]  # one generation, the same completions
    assert split[0]["num_completion_tokens"] + split[1]["num_completion_tokens"] == whole[0]["num_completion_tokens"]
    total = split[0]["loss"] + split[1]["loss"]
    assert total == pytest.approx(2 * whole[0]["loss"], abs=1e-6)
    # negative control: each step normalised by its own tokens (the slices differ in length here)
    own = [r["loss"] * whole[0]["num_completion_tokens"] / 2 / r["num_completion_tokens"] for r in split]
    assert abs(sum(own) - total) > 1e-6 or split[0]["num_completion_tokens"] == split[1]["num_completion_tokens"]


def test_the_prompt_stream_counts_every_step_of_a_generation():
    rows = [{"prompt": str(i)} for i in range(6)]
    src = PromptSource(rows, 2, num_iterations=2, steps_per_generation=3, seed=0)
    assert src.steps_per_epoch == 3 * 2 * 3
    entries = [src.next_step()[0] for _ in range(8)]
    assert [e["new_generation"] for e in entries] == [True] + [False] * 5 + [True, False]
    assert [e["part"] for e in entries] == [0, 1, 2, 0, 1, 2, 0, 1]
    assert all(e["prompts"] == entries[0]["prompts"] for e in entries[:6]) and entries[6]["prompts"] != entries[0][
        "prompts"]
    state = src.state_dict()  # mid-generation: a resume restarts at its first step
    assert state["steps_done"] == 6
    again = PromptSource(rows, 2, num_iterations=2, steps_per_generation=3, seed=0)
    again.load_state_dict(state)
    assert again.next_step()[0]["prompts"] == entries[6]["prompts"]


def test_generation_steps_follow_trls_rules():
    assert generation_steps(GRPOConfig(num_generations=2), 4, 2) == 2
    assert generation_steps(GRPOConfig(num_generations=2, steps_per_generation=6), 4, 2) == 6
    assert generation_steps(GRPOConfig(num_generations=2, generation_batch_size=32), 4, 2, world=2) == 4
    with pytest.raises(ConfigError, match=r"steps_per_generation=4 and generation_batch_size=16.*drop one"):
        generation_steps(GRPOConfig(num_generations=2, steps_per_generation=4, generation_batch_size=16), 4, 2)
    with pytest.raises(ConfigError, match=r"steps_per_generation=3 is not a multiple of gradient_accumulation_steps=2"):
        generation_steps(GRPOConfig(num_generations=2, steps_per_generation=3), 4, 2)
    with pytest.raises(ConfigError, match=r"generation_batch_size=20 is not divisible by .* = 8; make it a multiple"):
        generation_steps(GRPOConfig(num_generations=2, generation_batch_size=20), 4, 1, world=2)
    with pytest.raises(ConfigError, match=r"x steps_per_generation = 2 x 3 = 6 completions is not divisible by "
                                          r"num_generations=4"):
        generation_steps(GRPOConfig(num_generations=4, steps_per_generation=3), 2, 1)


def test_entropy_control_fields_are_refused_without_adaptive_control():
    with pytest.raises(ConfigError, match=r"entropy_target=0\.5 steer .* add --use-adaptive-entropy or drop "
                                          r"--entropy-target"):
        TrainConfig.from_flat(task="grpo", model_config="tiny", entropy_target=0.5)
    with pytest.raises(ConfigError, match=r"entropy_coef_min=0\.5 is above entropy_coef_max=0\.2"):
        TrainConfig.from_flat(task="grpo", model_config="tiny", use_adaptive_entropy=True, entropy_coef_min=0.5,
                              entropy_coef_max=0.2)
    with pytest.raises(ConfigError, match=r"entropy_coef=0\.1 .*task='rloo'"):
        TrainConfig.from_flat(task="rloo", model_config="tiny", entropy_coef=0.1)


@pytest.mark.parametrize("backend", ["torch", pytest.param("jax", marks=pytest.mark.slow)])
def test_adaptive_entropy_bonus_logs_and_resumes(backend, tmp_path):
    flat = dict(use_adaptive_entropy=True, entropy_coef=0.02, entropy_coef_delta=0.01, entropy_target=50.0,
                learning_rate=1e-2, save_steps=2, gradient_accumulation_steps=1)
    rows = _train(backend, tmp_path / "run", max_steps=3, **flat)
    assert rows[0]["loss"] == pytest.approx(rows[0]["policy_loss"], abs=1e-7)  # no bonus before a measurement
    # the entropy (a few nats) is below the target: the coefficient grows each step, and the bonus applies
    assert [round(r["entropy_coef"], 6) for r in rows] == [0.03, 0.04, 0.05]
    assert rows[1]["loss"] < rows[1]["policy_loss"]
    resumed = _train(backend, tmp_path / "run", max_steps=3, resume_from_checkpoint="latest", **flat)
    assert resumed[-1]["step"] == 3
    assert resumed[-1]["entropy_coef"] == pytest.approx(rows[-1]["entropy_coef"])
    assert np.isclose(resumed[-1]["loss"], rows[-1]["loss"], atol=1e-5)
