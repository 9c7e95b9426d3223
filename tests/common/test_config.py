import dataclasses

import pytest

from twinseq.common.config import MODEL_PRESETS, ModelConfig, TrainConfig, resolve_model_config


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
        TrainConfig(**{field: value})
    assert fragment in str(err.value)


def test_packing_needs_max_length():
    with pytest.raises(ValueError, match="max_length"):
        TrainConfig(packing=True, max_length=None)


def test_use_liger_kernel_selects_liger_loss():
    assert TrainConfig(use_liger_kernel=True).loss_type == "liger"


def test_backend_default_from_env(monkeypatch):
    monkeypatch.setenv("TWINSEQ_BACKEND", "jax")
    assert TrainConfig().backend == "jax"


@pytest.mark.parametrize("name", sorted(MODEL_PRESETS))
def test_presets_are_valid_and_sized(name):
    cfg = ModelConfig.preset(name)
    n = cfg.num_parameters()
    bounds = {"tiny": (0.7e6, 1.5e6), "small": (10e6, 30e6)}[name]
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
    assert (cfg.max_steps, cfg.loss_type) == (7, "chunked_nll")
    path.write_text("max_stepz: 7\n")
    with pytest.raises(ValueError, match="max_stepz"):
        TrainConfig.from_yaml(path)
    assert TrainConfig.from_dict(TrainConfig().to_dict()) == TrainConfig()


def test_field_names_follow_trl():
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    trl_names = {"max_length", "truncation_mode", "max_prompt_length", "max_completion_length", "packing",
                 "packing_strategy", "padding_free", "pad_to_multiple_of", "completion_only_loss", "loss_type",
                 "use_liger_kernel", "activation_offloading", "gradient_checkpointing",
                 "gradient_accumulation_steps", "per_device_train_batch_size", "beta",
                 "ds3_gather_for_generation", "vllm_sleep_enabled"}
    assert trl_names <= names
