"""The model families as the neutral layer describes them: configs, shapes, config.json, initial weights, RoPE.

The comparisons with transformers' own reading of the same config.json (defaults, RoPE
buffers) are in tests/torch_backend/test_families.py, where transformers can be imported.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from twinseq.common.models import rope
from twinseq.common.errors import ConfigError
from twinseq.common.models.init import init_weights
from twinseq.common.models.configs import (MODEL_PRESETS, MODEL_TYPES, ModelConfig, from_hf_config, parameter_shapes,
                                   resolve_model_config, to_hf_config)

FAMILY_PRESETS = [name for name in MODEL_PRESETS if name.startswith("tiny-")]


def test_every_family_has_a_tiny_preset():
    assert sorted(ModelConfig.preset(name).model_type for name in FAMILY_PRESETS) == sorted(MODEL_TYPES)
    assert ModelConfig.preset("tiny-llama3").rope_type == "llama3"  # the Llama preset is a Llama 3.x


@pytest.mark.parametrize("name", sorted(MODEL_PRESETS))
def test_config_json_round_trip(name):
    cfg = ModelConfig.preset(name)
    values = json.loads(json.dumps(to_hf_config(cfg)))  # what a config.json file holds
    assert from_hf_config(values) == cfg


@pytest.mark.parametrize("name", sorted(MODEL_PRESETS))
def test_num_parameters_counts_parameter_shapes(name):
    cfg = ModelConfig.preset(name)
    assert cfg.num_parameters() == sum(int(np.prod(s)) for s in parameter_shapes(cfg).values())


def test_family_tensors():
    q2 = parameter_shapes(ModelConfig.preset("tiny-qwen2"))
    assert "model.layers.0.self_attn.q_proj.bias" in q2 and "model.layers.0.self_attn.v_proj.bias" in q2
    assert "model.layers.0.self_attn.o_proj.bias" not in q2
    q3cfg = ModelConfig.preset("tiny-qwen3")
    q3 = parameter_shapes(q3cfg)
    assert q3["model.layers.1.self_attn.q_norm.weight"] == (32,) and q3["model.layers.1.self_attn.k_norm.weight"] == (32,)
    assert q3["model.layers.0.self_attn.q_proj.weight"] == (4 * 32, 96)  # head_dim independent of hidden_size
    assert q3["model.layers.0.self_attn.o_proj.weight"] == (96, 4 * 32)
    assert "lm_head.weight" in q3
    g2 = parameter_shapes(ModelConfig.preset("tiny-gemma2"))
    assert {k.split(".", 3)[-1] for k in g2 if k.startswith("model.layers.0.") and "layernorm" in k} == {
        "input_layernorm.weight", "post_attention_layernorm.weight", "pre_feedforward_layernorm.weight",
        "post_feedforward_layernorm.weight"}
    assert "lm_head.weight" not in g2
    llama = parameter_shapes(ModelConfig.preset("tiny", attention_bias=True, mlp_bias=True))
    assert "model.layers.0.self_attn.o_proj.bias" in llama and "model.layers.0.mlp.down_proj.bias" in llama


def test_family_features():
    gemma = ModelConfig.preset("tiny-gemma2")
    assert [gemma.layer_is_sliding(i) for i in range(2)] == [True, False]
    assert gemma.attention_scale == 256 ** -0.5 and gemma.gemma
    mistral = ModelConfig.preset("tiny-mistral")
    assert all(mistral.layer_is_sliding(i) for i in range(2))
    assert not ModelConfig.preset("tiny-mistral", sliding_window=None).layer_is_sliding(0)
    assert not any(ModelConfig.preset("tiny-qwen2").layer_is_sliding(i) for i in range(2))
    assert ModelConfig.preset("tiny-qwen3").qk_norm and ModelConfig.preset("tiny-qwen2").qkv_bias
    # Gemma's default layer pattern, as transformers fills it: sliding on even layers
    assert ModelConfig(model_type="gemma2", num_hidden_layers=4, sliding_window=8).layer_types == [
        "sliding_attention", "full_attention", "sliding_attention", "full_attention"]


@pytest.mark.parametrize("values,match", [
    ({"model_type": "gpt2"}, "model_type='gpt2' is not supported; twinseq builds llama, qwen2, qwen3, mistral, gemma2"),
    ({"model_type": None}, "model_type=None is not supported; twinseq builds llama, qwen2"),
    ({"model_type": "llama", "hidden_act": "relu"}, "hidden_act='relu' is not supported"),
    ({"model_type": "llama", "rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope_type='yarn'"),
    ({"model_type": "llama", "rope_scaling": {"type": "longrope"}}, "rope_type='longrope'"),
    ({"model_type": "llama", "num_attention_heads": 4, "num_key_value_heads": 3}, "num_key_value_heads=3"),
])
def test_unsupported_config_json_is_refused_by_name(values, match):
    with pytest.raises(ConfigError, match=match):
        from_hf_config(values, "config.json")


def test_config_errors_name_the_field():
    with pytest.raises(ConfigError, match="layer_types has 3 entries for num_hidden_layers=2"):
        ModelConfig(model_type="qwen2", sliding_window=4, layer_types=["full_attention"] * 3)
    with pytest.raises(ConfigError, match="sliding_window is None"):
        ModelConfig(model_type="qwen2", layer_types=["sliding_attention", "full_attention"])
    with pytest.raises(ConfigError, match="not used by model_type 'mistral'"):
        ModelConfig(model_type="mistral", sliding_window=4, layer_types=["sliding_attention"] * 2)
    with pytest.raises(ConfigError, match="rope_original_max_position_embeddings"):
        ModelConfig(rope_type="llama3", rope_factor=8.0)
    with pytest.raises(ConfigError, match="model_type='phi3' is not valid"):
        ModelConfig(model_type="phi3")


def test_hand_written_config_json(tmp_path):
    """A config.json with only the sizes: transformers' family defaults fill the rest."""
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "mistral", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 16}))
    cfg = resolve_model_config(str(tmp_path))
    assert (cfg.model_type, cfg.num_key_value_heads, cfg.sliding_window, cfg.tie_word_embeddings) == (
        "mistral", 8, 4096, False)
    assert cfg.head_dim == 4 and cfg.rms_norm_eps == 1e-6 and cfg.max_position_embeddings == 131072


def test_init_weights_per_family():
    g = init_weights(ModelConfig.preset("tiny-gemma2"), seed=0)
    assert not g["model.layers.0.pre_feedforward_layernorm.weight"].any()  # Gemma's x * (1 + w): zeros
    q3 = init_weights(ModelConfig.preset("tiny-qwen3"), seed=0)
    assert (q3["model.layers.0.self_attn.q_norm.weight"] == 1).all()
    q2 = init_weights(ModelConfig.preset("tiny-qwen2"), seed=0)
    bias = q2["model.layers.0.self_attn.q_proj.bias"]
    assert bias.std() > 0.01  # drawn, so that a dropped bias changes every output
    again = init_weights(ModelConfig.preset("tiny-qwen2"), seed=0)
    assert all(np.array_equal(q2[k], again[k]) for k in q2)


def test_rope_types():
    base = ModelConfig.preset("tiny")
    default = rope.default_inv_freq(base.head_dim, base.rope_theta)
    np.testing.assert_array_equal(rope.rope_inv_freq(base), default)
    linear = ModelConfig.preset("tiny", rope_type="linear", rope_factor=4.0)
    np.testing.assert_array_equal(rope.rope_inv_freq(linear), default / np.float32(4.0))
    llama3 = ModelConfig.preset("tiny-llama3")
    freq, plain = rope.rope_inv_freq(llama3), rope.default_inv_freq(llama3.head_dim, llama3.rope_theta)
    wavelen = 2 * np.pi / plain
    short = wavelen < 64 / 4.0   # original_max_position_embeddings / high_freq_factor: kept
    long = wavelen > 64 / 1.0    # / low_freq_factor: divided by factor
    assert short.any() and long.any()
    np.testing.assert_array_equal(freq[short], plain[short])
    np.testing.assert_allclose(freq[long], plain[long] / 8.0, rtol=1e-7)
    dynamic = ModelConfig.preset("tiny", rope_type="dynamic", rope_factor=2.0, max_position_embeddings=32)
    np.testing.assert_array_equal(rope.dynamic_inv_freq(dynamic, 31), default)  # not longer than max positions
    stretched = rope.dynamic_inv_freq(dynamic, 63)
    assert stretched[0] == default[0] and (stretched[1:] < default[1:]).all()
