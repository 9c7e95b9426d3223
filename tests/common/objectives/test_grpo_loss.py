"""GRPO's common rules: advantages, rewards, the loss family's numpy reference, config refusals, prompt data.

Expected values are derived by hand in the comments, never by calling the code under test.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from twinseq.common.config import TrainConfig
from twinseq.common.errors import ConfigError, DataError
from twinseq.common.objectives.grpo import completion_mask, compute_rewards, group_advantages
from twinseq.common.objectives.grpo_loss import grpo_loss
from twinseq.common.data.prompts import (PromptSource, build_last_word_task, exact_match_reward, format_reward,
                                      resolve_reward_funcs, tokenize_prompts)


# --------------------------------------------------------------------------------------
# Advantages
# --------------------------------------------------------------------------------------


def test_equal_rewards_in_a_group_give_zero_advantage():
    adv = group_advantages(np.array([3.0, 3.0, 3.0, 0.0, 1.0, 2.0]), num_generations=3)
    assert adv[:3].tolist() == [0.0, 0.0, 0.0]
    # group 2: mean 1, unbiased std 1 -> (r - 1) / (1 + 1e-4)
    np.testing.assert_allclose(adv[3:], np.array([-1.0, 0.0, 1.0]) / (1 + 1e-4), rtol=1e-12)


def test_scale_rewards_batch_and_none():
    r = np.array([1.0, 0.0, 5.0, 5.0])
    # centred by group: [0.5, -0.5, 0, 0]
    np.testing.assert_allclose(group_advantages(r, 2, "none"), [0.5, -0.5, 0.0, 0.0])
    std = np.std(r, ddof=1)
    np.testing.assert_allclose(group_advantages(r, 2, "batch"), np.array([0.5, -0.5, 0.0, 0.0]) / (std + 1e-4))


def test_advantages_refuse_a_partial_group():
    with pytest.raises(DataError, match="whole groups"):
        group_advantages(np.zeros(5), num_generations=2)


# --------------------------------------------------------------------------------------
# The loss family
# --------------------------------------------------------------------------------------


def test_a_single_completion_on_policy():
    # ratio 1 everywhere, so L_t = -A on each of the 2 masked tokens
    logps, mask = np.array([[-1.0, -2.0, -3.0]]), np.array([[1, 1, 0]])
    a = np.array([0.7])
    assert grpo_loss(logps, a, mask, loss_type="grpo").loss == pytest.approx(-0.7)   # mean over its tokens
    assert grpo_loss(logps, a, mask, loss_type="bnpo").loss == pytest.approx(-0.7)
    assert grpo_loss(logps, a, mask, loss_type="dapo").loss == pytest.approx(-0.7)
    # dr_grpo: Σ L m / (N * max_completion_length) = -1.4 / 4
    assert grpo_loss(logps, a, mask, loss_type="dr_grpo", max_completion_length=4).loss == pytest.approx(-0.35)


def test_zero_advantage_and_no_kl_gives_zero_loss():
    out = grpo_loss(np.random.default_rng(0).normal(size=(4, 3)), np.zeros(4), np.ones((4, 3)))
    assert out.loss == 0.0 and "kl" not in out.metrics


def test_clipping_active_on_both_sides():
    old = np.zeros((3, 1))
    logps = np.log(np.array([[1.5], [0.5], [1.5]]))
    adv = np.array([1.0, -1.0, -1.0])
    out = grpo_loss(logps, adv, np.ones((3, 1)), old_logps_NC=old, loss_type="grpo", epsilon=0.2)
    # row 0: ratio 1.5, A=+1: min(1.5, 1.2) = 1.2 -> loss -1.2 (clipped high)
    # row 1: ratio 0.5, A=-1: min(-0.5, -0.8) = -0.8 -> loss 0.8 (clipped low)
    # row 2: ratio 1.5, A=-1: min(-1.5, -1.2) = -1.5 -> loss 1.5 (not clipped: the pessimistic side)
    assert out.loss == pytest.approx((-1.2 + 0.8 + 1.5) / 3)
    assert out.metrics["clip_ratio/high_mean"] == pytest.approx(1 / 3)
    assert out.metrics["clip_ratio/low_mean"] == pytest.approx(1 / 3)
    assert out.metrics["clip_ratio/region_mean"] == pytest.approx(2 / 3)


def test_epsilon_high_widens_the_upper_clip_only():
    out = grpo_loss(np.log([[1.25]]), np.array([1.0]), np.ones((1, 1)), old_logps_NC=np.zeros((1, 1)),
                    epsilon=0.2, epsilon_high=0.28)
    # 1.25 < 1.28: unclipped, loss -1.25
    assert out.loss == pytest.approx(-1.25) and out.metrics["clip_ratio/high_mean"] == 0.0


def test_kl_term_with_a_known_value():
    # log π = 0, log π_ref = log 2: k3 = e^{ln 2} - ln 2 - 1 = 1 - ln 2 on every token
    beta = 0.04
    logps, ref = np.zeros((2, 2)), np.full((2, 2), math.log(2.0))
    out = grpo_loss(logps, np.zeros(2), np.ones((2, 2)), ref_logps_NC=ref, beta=beta, loss_type="bnpo")
    assert out.metrics["kl"] == pytest.approx(1 - math.log(2.0))
    assert out.loss == pytest.approx(beta * (1 - math.log(2.0)))
    with pytest.raises(ConfigError, match="reference"):
        grpo_loss(logps, np.zeros(2), np.ones((2, 2)), beta=beta)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
def test_micro_batch_shares_add_up_to_the_step_loss(loss_type):
    rng = np.random.default_rng(1)
    logps, old = rng.normal(size=(4, 5)) * 0.3, rng.normal(size=(4, 5)) * 0.3
    adv, mask = rng.normal(size=4), (rng.random((4, 5)) < 0.7).astype(np.int32)
    mask[:, 0] = 1
    kw = dict(loss_type=loss_type, max_completion_length=5)
    full = grpo_loss(logps, adv, mask, old_logps_NC=old, **kw).loss
    shares = sum(grpo_loss(logps[s], adv[s], mask[s], old_logps_NC=old[s], num_sequences_in_step=4,
                           num_tokens_in_step=int(mask.sum()), **kw).loss for s in (slice(0, 2), slice(2, 4)))
    assert shares == pytest.approx(full, rel=1e-12)


def test_completion_mask_stops_after_the_first_eos():
    mask, truncated = completion_mask(np.array([[7, 2, 9, 2], [7, 8, 9, 9]]), eos_token_id=2, pad_token_id=0)
    assert mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]] and truncated.tolist() == [False, True]
    mask, _ = completion_mask(np.array([[7, 2, 9, 2], [7, 8, 9, 9]]), 2, 0, mask_truncated=True)
    assert mask.tolist() == [[1, 1, 0, 0], [0, 0, 0, 0]]


# --------------------------------------------------------------------------------------
# Rewards
# --------------------------------------------------------------------------------------


def test_rewards_are_the_weighted_nan_sum():
    def a(prompts, completions, **kw):
        return [1.0, 0.0]

    def b(prompts, completions, **kw):
        return [None, 3.0]

    total, per = compute_rewards([a, b], ["p", "p"], ["x", "y"], weights=[2.0, 0.5])
    assert total.tolist() == [2.0, 1.5] and np.isnan(per[0, 1])


def test_a_reward_function_that_raises_is_named():
    def broken_reward(prompts, completions, **kw):
        raise KeyError("answer")

    with pytest.raises(DataError, match="broken_reward.*KeyError"):
        compute_rewards([broken_reward], ["p"], ["c"])


def test_a_reward_function_with_the_wrong_length_is_named():
    def short_reward(prompts, completions, **kw):
        return [1.0]

    with pytest.raises(DataError, match="short_reward.*1 rewards for 2 completions"):
        compute_rewards([short_reward], ["p", "p"], ["c", "d"])


def test_a_reward_function_returning_text_is_named():
    def text_reward(prompts, completions, **kw):
        return ["good"] * len(completions)

    with pytest.raises(DataError, match="text_reward.*'good'"):
        compute_rewards([text_reward], ["p"], ["c"])


def test_builtin_rewards_and_unknown_names():
    assert exact_match_reward(["p"] * 3, [" stone", "stone river", "x"], answer=["stone"] * 3) == [1.0, 0.5, 0.0]
    assert format_reward(["p"] * 2, [" good words", "Bad 12 ok"]) == [1.0, 1 / 3]
    with pytest.raises(ConfigError, match="'acuracy'.*exact_match"):
        resolve_reward_funcs(["acuracy"])


# --------------------------------------------------------------------------------------
# Config refusals
# --------------------------------------------------------------------------------------


def _grpo(**kw):
    return TrainConfig.from_flat(task="grpo", per_device_train_batch_size=8, **kw)


def test_grpo_defaults_follow_trl():
    g = _grpo().grpo
    assert (g.num_generations, g.grpo_beta, g.epsilon, g.epsilon_high, g.num_iterations) == (8, 0.0, 0.2, None, 1)
    assert (g.scale_rewards, g.grpo_loss_type, g.vllm_sleep_level, g.vllm_gpu_memory_utilization) == \
        ("group", "dapo", 1, 0.3)


@pytest.mark.parametrize("flat, match", [
    (dict(num_generations=1), "at least 2"),
    (dict(num_generations=3), "not divisible by num_generations=3"),
    (dict(use_vllm=True, vllm_mode="server"), "vllm_mode=.server. is not supported"),
    (dict(use_vllm=True, ds3_gather_for_generation=False), "ds3_gather_for_generation=False"),
    (dict(vllm_enable_sleep_mode=True), "use_vllm=False"),
    (dict(use_vllm=True, vllm_sleep_level=3), "vllm_sleep_level=3"),
    (dict(reward_funcs=["format"], reward_weights=[1.0, 2.0]), "one weight per"),
    (dict(grpo_loss_type="ppo"), "grpo_loss_type='ppo'"),
    (dict(scale_rewards="std"), "scale_rewards='std'"),
    (dict(packing=True), "packing=True does not apply to task=.grpo."),
])
def test_bad_grpo_configs_are_refused(flat, match):
    with pytest.raises(ConfigError, match=match):
        _grpo(**flat)


def test_grpo_knobs_are_refused_on_another_task():
    with pytest.raises(ConfigError, match="num_generations.*task='grpo'"):
        TrainConfig.from_flat(task="sft", num_generations=4)


# --------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------


def test_embedded_task_is_deterministic():
    a, b = build_last_word_task(8, seed=3), build_last_word_task(8, seed=3)
    assert a == b and all(r["prompt"].split("\n")[0].split()[-1] == r["answer"] for r in a)


def test_prompt_only_jsonl_text_and_conversational(tmp_path, embedded_tokenizer):
    from twinseq.common.data.prompts import load_prompt_rows

    path = tmp_path / "prompts.jsonl"
    rows = [{"prompt": "Say hi", "answer": "hi"},
            {"prompt": [{"role": "user", "content": "Say hi"}], "answer": "hi"}]
    path.write_text("\n".join(json.dumps(r) for r in rows[:1]) + "\n")
    loaded = tokenize_prompts(load_prompt_rows(str(path)), embedded_tokenizer, max_prompt_length=64)
    assert loaded[0]["answer"] == "hi" and loaded[0]["prompt_input_ids"][0] == embedded_tokenizer.bos_token_id
    chat = tokenize_prompts(rows[1:], embedded_tokenizer)[0]
    assert chat["prompt_text"] == embedded_tokenizer.render_prompt(rows[1]["prompt"])
    assert chat["prompt_text"] != "Say hi"
    # truncation keeps the end of a prompt
    short = tokenize_prompts(rows[:1], embedded_tokenizer, max_prompt_length=2)[0]["prompt_input_ids"]
    assert short == embedded_tokenizer.encode("Say hi")[-2:]
    with pytest.raises(DataError, match="no 'prompt' column"):
        tokenize_prompts([{"text": "x"}], embedded_tokenizer)


def test_prompt_source_reuses_a_generation_for_num_iterations_and_resumes():
    rows = [{"prompt": str(i)} for i in range(10)]
    src = PromptSource(rows, 2, num_iterations=2, seed=0)
    s1, s2, s3 = (src.next_step()[0] for _ in range(3))
    assert s1["new_generation"] and not s2["new_generation"] and s3["new_generation"]
    assert s1["prompts"] == s2["prompts"] != s3["prompts"]
    state = src.state_dict()  # mid-generation: resumes at s3's generation
    again = PromptSource(rows, 2, num_iterations=2, seed=0)
    again.load_state_dict(state)
    assert again.next_step()[0]["prompts"] == s3["prompts"]


def test_the_guides_sleep_spelling_is_an_alias():
    cfg = _grpo(use_vllm=True, vllm_sleep_enabled=True)
    assert cfg.grpo.vllm_enable_sleep_mode is True


def test_unset_completion_length_uses_trls_default():
    from twinseq.common.objectives.grpo import completion_budget

    assert completion_budget(None) == 512 and completion_budget(7) == 7  # TRL 1.16's GRPOConfig default


def test_reward_callables_are_checked_for_trls_keywords():
    from twinseq.common.errors import ConfigTypeError

    def needs_answer(prompts, completions, answer, **kwargs):
        return [0.0] * len(completions)

    def wrong_names(p, c):
        return [0.0] * len(c)

    assert resolve_reward_funcs([needs_answer, "format"])[0] is needs_answer
    with pytest.raises(ConfigTypeError, match="'wrong_names' cannot be called as f\\(prompts=..., completions="):
        resolve_reward_funcs([wrong_names])
    with pytest.raises(ConfigTypeError, match="not callable"):
        resolve_reward_funcs([3])
