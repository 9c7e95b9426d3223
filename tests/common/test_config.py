import re

import pytest

from twinseq.common.config import MODEL_PRESETS, SECTIONS, ModelConfig, TrainConfig, resolve_model_config
from twinseq.common.errors import TwinseqError


@pytest.mark.parametrize(
    "field, value, fragment",
    [
        ("loss_type", "focal", "loss_type='focal'"),
        ("truncation_mode", "middle", "truncation_mode='middle'"),
        ("packing_strategy", "ffd", "packing_strategy='ffd'"),
        ("per_device_train_batch_size", 0, "per_device_train_batch_size=0"),
        ("per_device_train_batch_size", -2, "per_device_train_batch_size=-2"),
        ("gradient_accumulation_steps", 0, "gradient_accumulation_steps=0"),
        ("max_length", 0, "max_length=0"),
        ("backend", "tf", "backend='tf'"),
        ("attn_implementation", "flash", "attn_implementation='flash'"),
        ("warmup_ratio", 1.5, "warmup_ratio=1.5"),
        ("pad_to_multiple_of", 0, "pad_to_multiple_of=0"),
    ],
)
def test_invalid_train_config_names_field_and_value(field, value, fragment):
    with pytest.raises(ValueError) as err:
        TrainConfig.from_flat(**{field: value})
    assert fragment in str(err.value)
    assert isinstance(err.value, TwinseqError)


def test_packing_needs_max_length():
    with pytest.raises(ValueError, match="max_length"):
        TrainConfig.from_flat(packing=True, max_length=None)


def test_use_liger_kernel_selects_liger_loss_and_refuses_another_kernel():
    assert TrainConfig.from_flat(use_liger_kernel=True).loss.loss_type == "liger"
    with pytest.raises(ValueError, match="use_liger_kernel=True selects Liger"):
        TrainConfig.from_flat(use_liger_kernel=True, loss_type="fused_linear")


@pytest.mark.parametrize("field, value, fragment", [
    ("learning_rate", "fast", "pass a number, not str"),
    ("learning_rate", float("nan"), "pass a finite number"),
    ("learning_rate", float("inf"), "pass a finite number"),
    ("per_device_train_batch_size", 2.0, "pass an integer, not float"),
    ("packing", "no", "pass true or false"),
    ("packing", 1, "pass true or false"),
    ("adam_beta1", 1.0, "adam_beta1=1.0 is not valid: pass a value >= 0 and < 1"),
    ("adam_beta2", -0.1, "adam_beta2=-0.1"),
    ("max_steps", 0, "max_steps=0"),
    ("label_smoothing", 0.7, "label_smoothing=0.7"),
    ("report_to", ["mlflow"], "report_to[0]='mlflow'"),
    ("dpo_loss_type", 3, "dpo_loss_type=3"),
])
def test_types_and_ranges_are_checked_in_one_place(field, value, fragment):
    with pytest.raises((ValueError, TypeError), match=re.escape(fragment)) as err:
        TrainConfig.from_flat(**{field: value})
    assert isinstance(err.value, TwinseqError)


def test_config_is_nested_by_concern_with_unique_flat_names():
    cfg = TrainConfig.from_flat(max_length=64, learning_rate=3e-3, loss_type="fused_linear",
                                gradient_checkpointing=True, context_parallel_size=2, model_config="small")
    assert (cfg.data.max_length, cfg.optim.learning_rate, cfg.loss.loss_type) == (64, 3e-3, "fused_linear")
    assert (cfg.memory.gradient_checkpointing, cfg.parallel.context_parallel_size, cfg.model.model_config) == \
        (True, 2, "small")
    assert set(SECTIONS) == {"model", "data", "optim", "loss", "memory", "parallel", "dpo", "peft", "grpo", "rloo", "kto",
                            "reference"}
    flat = cfg.to_flat_dict()
    assert TrainConfig.from_dict(flat) == cfg == TrainConfig.from_dict(cfg.to_dict())
    assert cfg.replace(max_length=32).data.max_length == 32 and cfg.data.max_length == 64
    nested = TrainConfig.from_dict({"data": {"max_length": 16}, "seed": 4})
    assert (nested.data.max_length, nested.seed) == (16, 4)
    with pytest.raises(ValueError, match="data.learning_rate"):
        TrainConfig.from_dict({"data": {"learning_rate": 1.0}})


def test_an_option_of_another_task_is_refused_not_ignored():
    with pytest.raises(ValueError, match="beta is read by task='dpo' or 'kto' only"):
        TrainConfig.from_flat(task="sft", beta=0.5)
    assert TrainConfig.from_flat(task="dpo", beta=0.5).dpo.beta == 0.5
    with pytest.raises(ValueError, match="packing=True does not apply to DPO"):
        TrainConfig.from_flat(task="dpo", packing=True, max_length=64)


def test_grpo_generation_fields_belong_to_the_grpo_task():
    """They came back with the GRPO work that reads them (common.objectives.grpo.check_grpo_config, the GRPO trainers)."""
    for name in ("ds3_gather_for_generation", "vllm_sleep_enabled"):
        with pytest.raises(ValueError, match="task='grpo'"):
            TrainConfig.from_flat(**{name: name == "vllm_sleep_enabled"})


def test_yaml_syntax_error_names_file_and_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("max_steps: 3\nlearning_rate: [1e-3\n")
    with pytest.raises(ValueError, match=re.escape(f"{path}:3")):
        TrainConfig.from_yaml(path)


def test_backend_default_from_env(monkeypatch):
    monkeypatch.setenv("TWINSEQ_BACKEND", "jax")
    assert TrainConfig().backend == "jax"


@pytest.mark.parametrize("name", sorted(MODEL_PRESETS))
def test_presets_are_valid_and_sized(name):
    cfg = ModelConfig.preset(name)
    n = cfg.num_parameters()
    bounds = {"small": (10e6, 30e6)}.get(name, (0.7e6, 2e6))  # tiny and the tiny-<family> presets
    assert bounds[0] <= n <= bounds[1], n


def test_unknown_preset_and_gqa_errors():
    with pytest.raises(ValueError, match="preset 'huge'"):
        ModelConfig.preset("huge")
    with pytest.raises(ValueError, match="num_key_value_heads=3"):
        ModelConfig(num_attention_heads=4, num_key_value_heads=3)
    with pytest.raises(ValueError, match="neither a preset"):
        resolve_model_config("/nonexistent/ckpt")


def test_yaml_round_trip_and_unknown_keys(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("max_steps: 7\nloss_type: chunked_nll\n")
    cfg = TrainConfig.from_yaml(path)
    assert (cfg.max_steps, cfg.loss.loss_type) == (7, "chunked_nll")
    path.write_text("max_stepz: 7\n")
    with pytest.raises(ValueError, match="max_stepz"):
        TrainConfig.from_yaml(path)
    assert TrainConfig.from_dict(TrainConfig().to_dict()) == TrainConfig()


def test_field_names_follow_trl():
    names = set(TrainConfig().to_flat_dict())
    trl_names = {"max_length", "truncation_mode", "max_prompt_length", "max_completion_length", "packing",
                 "packing_strategy", "padding_free", "pad_to_multiple_of", "completion_only_loss", "loss_type",
                 "use_liger_kernel", "activation_offloading", "gradient_checkpointing",
                 "gradient_accumulation_steps", "per_device_train_batch_size", "beta", "learning_rate",
                 "save_total_limit", "resume_from_checkpoint", "report_to", "logging_steps"}
    assert trl_names <= names


def test_the_constructor_takes_trls_flat_names_and_names_the_closest_field():
    """``TrainConfig(max_length=512)`` was a raw ``TypeError``: flat names work in the constructor as in
    ``from_flat``, beside sections, and a misspelt one gets twinseq's error with the closest field."""
    from twinseq.common.config import DataConfig, TrainConfig
    from twinseq.common.errors import ConfigError

    cfg = TrainConfig(max_length=512, per_device_train_batch_size=2, learning_rate=2e-5)
    assert cfg == TrainConfig.from_flat(max_length=512, per_device_train_batch_size=2, learning_rate=2e-5)
    mixed = TrainConfig(data=DataConfig(packing=True, max_length=64), per_device_train_batch_size=3)
    assert (mixed.data.packing, mixed.data.max_length, mixed.data.per_device_train_batch_size) == (True, 64, 3)
    assert TrainConfig(data=DataConfig(max_length=7)).data.max_length == 7  # sections alone: as before
    with pytest.raises(ConfigError, match=r"max_lenght \(did you mean 'max_length'\?\)"):
        TrainConfig(max_lenght=512)
