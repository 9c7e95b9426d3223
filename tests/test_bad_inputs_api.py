"""Twenty more bad inputs, on the Python API, YAML value types, GRPO reward functions and PEFT options: each gets
twinseq's own error (``TwinseqError``) naming the field (or function) and the value, and saying what to do."""

from __future__ import annotations

import pytest

from twinseq.common.backend import load_backend
from twinseq.common.config import TrainConfig
from twinseq.common.errors import TwinseqError
from twinseq.common.objectives.grpo import compute_rewards
from twinseq.common.data.prompts import resolve_reward_funcs

CONFIG_CASES = {  # flat values (the Python API's from_flat and constructor, and what a YAML file holds)
    "python: max_length as a string": (dict(max_length="512"), "max_length='512'", "integer"),
    "python: a list for a number": (dict(learning_rate=[1e-5]), "learning_rate=[1e-05]", "number"),
    "python: fractional accumulation": (dict(gradient_accumulation_steps=1.5), "gradient_accumulation_steps=1.5",
                                        "integer"),
    "python: max_steps None": (dict(max_steps=None), "max_steps=None", "integer"),
    "python: an unknown task": (dict(task="ppo"), "task='ppo'", "choose one of"),
    "yaml: packing: yes-as-a-string": (dict(packing="yes"), "packing='yes'", "--no-packing"),
    "yaml: a seed that is a word": (dict(seed="abc"), "seed='abc'", "integer"),
    "yaml: float16 dtype": (dict(dtype="float16"), "dtype='float16'", "did you mean 'bfloat16'"),
    "yaml: warmup ratio above 1": (dict(warmup_ratio=2.0), "warmup_ratio=2.0", "< 1"),
    "yaml: a negative clip norm": (dict(max_grad_norm=-1.0), "max_grad_norm=-1.0", "> 0"),
    "yaml: an unknown metric sink": (dict(report_to=["mlflow"]), "'mlflow'", "tensorboard"),
    "peft: rank 0": (dict(use_peft=True, lora_r=0), "lora_r=0", ">= 1"),
    "peft: dropout 1.5": (dict(use_peft=True, lora_dropout=1.5), "lora_dropout=1.5", "< 1"),
    "peft: a negative alpha": (dict(use_peft=True, lora_alpha=-4), "lora_alpha=-4", "> 0"),
    "peft: no target modules": (dict(use_peft=True, lora_target_modules=[]), "lora_target_modules=[]",
                                "all-linear"),
    "grpo: one generation per group": (dict(task="grpo", num_generations=1), "num_generations=1", "2 or more"),
    "grpo: weights for functions that are not there": (
        dict(task="grpo", reward_funcs=["exact_match"], reward_weights=[1.0, 2.0]), "reward_weights=[1.0, 2.0]",
        "one weight per reward function"),
}


@pytest.mark.parametrize("case", sorted(CONFIG_CASES))
def test_bad_config_values(case):
    values, named, fix = CONFIG_CASES[case]
    with pytest.raises(TwinseqError) as err:
        TrainConfig.from_flat(**values)
    assert named in str(err.value) and fix in str(err.value), str(err.value)
    with pytest.raises(TwinseqError):  # the constructor takes the same flat names, with the same refusals
        TrainConfig(**values)


def _reward(name, fn):
    fn.__name__ = name
    return fn


REWARD_CASES = {
    "returns one reward for two completions": (lambda prompts, completions, **kw: [1.0], "returned 1 rewards for 2"),
    "returns words": (lambda prompts, completions, **kw: ["good", "bad"], "returned 'good' (str)"),
    "returns booleans": (lambda prompts, completions, **kw: [True, False], "returned True (bool)"),
    "returns an infinite reward": (lambda prompts, completions, **kw: [float("inf"), 1.0], "returned inf"),
    "raises": (lambda prompts, completions, **kw: 1 / 0, "raised ZeroDivisionError"),
    "returns a scalar": (lambda prompts, completions, **kw: 1.0, "returned float, not a list of 2"),
}


@pytest.mark.parametrize("case", sorted(REWARD_CASES))
def test_bad_reward_functions_are_named_with_what_they_returned(case):
    fn, fragment = REWARD_CASES[case]
    with pytest.raises(TwinseqError) as err:
        compute_rewards([_reward("my_reward", fn)], ["p", "p"], ["a", "b"])
    assert "'my_reward'" in str(err.value) and fragment in str(err.value), str(err.value)


def test_reward_functions_that_cannot_be_called_or_found():
    with pytest.raises(TwinseqError, match=r"reward_funcs\[0\]='nonexistent' is not a built-in .*exact_match"):
        resolve_reward_funcs(["nonexistent"])
    with pytest.raises(TwinseqError, match=r"reward_funcs\[0\]=42 is not callable"):
        resolve_reward_funcs([42])
    with pytest.raises(TwinseqError, match=r"cannot be called as f\(prompts=..., completions=..., \*\*columns\)"):
        resolve_reward_funcs([_reward("one_argument", lambda x: x)])


def test_an_unknown_backend_names_the_choices():
    with pytest.raises(TwinseqError, match=r"backend='tensorflow' is not valid; choose one of \('torch', 'jax'\)"):
        load_backend("tensorflow")
