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


def test_gemma3_features():
    """Gemma 3 text: Gemma's norms and scale, q/k norms, five sliding layers to one global by default, two RoPE
    bases (the local one 10000 unless set), no attention soft-cap."""
    g3 = ModelConfig.preset("tiny-gemma3")
    assert g3.gemma and g3.qk_norm and not g3.qkv_bias and g3.attention_scale == 256 ** -0.5
    assert [g3.layer_is_sliding(i) for i in range(2)] == [True, False]
    assert (g3.rope_theta, g3.rope_local_base_freq) == (1e6, 1e4)
    assert g3.attn_logit_softcapping is None and g3.final_logit_softcapping is None
    shapes = parameter_shapes(g3)
    assert shapes["model.layers.0.self_attn.q_norm.weight"] == shapes["model.layers.0.self_attn.k_norm.weight"] == (32,)
    assert len([k for k in shapes if k.startswith("model.layers.0.") and "layernorm" in k]) == 4
    default = ModelConfig(model_type="gemma3_text", num_hidden_layers=12, sliding_window=8)
    assert [i for i, t in enumerate(default.layer_types) if t == "full_attention"] == [5, 11]
    assert default.rope_local_base_freq == 10000.0
    # the sliding layers' own RoPE: faster than the global layers' from the second frequency on
    np.testing.assert_array_equal(rope.sliding_rope_inv_freq(g3), rope.default_inv_freq(32, 1e4))
    assert rope.sliding_rope_inv_freq(ModelConfig.preset("tiny-gemma2")) is None


@pytest.mark.parametrize("values,match", [
    (dict(model_type="gemma3_text", attn_logit_softcapping=50.0),
     r"attn_logit_softcapping=50.0 is not applied by transformers' Gemma3ForCausalLM.*set attn_logit_softcapping=None"),
    (dict(model_type="gemma3_text", rope_type="dynamic", rope_factor=2.0),
     r"rope_type='dynamic' is not built for model_type 'gemma3_text'.*use rope_type 'default'"),
    (dict(model_type="gemma2", rope_local_base_freq=10000.0),
     r"rope_local_base_freq=10000.0 is only read by model_type 'gemma3_text' \(got 'gemma2'"
     r".*drop rope_local_base_freq"),
])
def test_gemma3_fields_are_refused_where_they_mean_nothing(values, match):
    with pytest.raises(ConfigError, match=match):
        ModelConfig(sliding_window=8, **values)


def test_gemma3_config_json_in_both_layouts():
    """transformers 5 writes RoPE per layer type; older config.json files (and the Hub's Gemma 3 checkpoints) hold
    ``rope_theta``, ``rope_local_base_freq``, ``rope_scaling`` and ``sliding_window_pattern``: both read the same."""
    sizes = dict(model_type="gemma3_text", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=1, head_dim=16, sliding_window=8)
    legacy = from_hf_config({**sizes, "rope_theta": 5e5, "rope_local_base_freq": 2e4, "sliding_window_pattern": 2,
                             "rope_scaling": {"rope_type": "linear", "factor": 8.0}})
    assert legacy.layer_types == ["sliding_attention", "full_attention"] * 2
    assert (legacy.rope_theta, legacy.rope_local_base_freq, legacy.rope_type, legacy.rope_factor) == (5e5, 2e4,
                                                                                                      "linear", 8.0)
    assert to_hf_config(legacy)["rope_parameters"] == {
        "full_attention": {"rope_type": "linear", "rope_theta": 5e5, "factor": 8.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 2e4}}
    assert from_hf_config(to_hf_config(legacy)) == legacy
    bare = from_hf_config(sizes)  # transformers' defaults: 1e6 global, 1e4 local, every 6th layer global
    assert (bare.rope_theta, bare.rope_local_base_freq, bare.layer_types.count("full_attention")) == (1e6, 1e4, 0)
    with pytest.raises(ConfigError, match=r"sliding_attention.rope_type='linear' is not supported.*use 'default'"):
        from_hf_config({**sizes, "rope_parameters": {"sliding_attention": {"rope_type": "linear", "factor": 2.0}}})
    with pytest.raises(ConfigError, match=r"use_bidirectional_attention=True is not supported"):
        from_hf_config({**sizes, "use_bidirectional_attention": True})
    with pytest.raises(ConfigError, match=r"attn_logit_softcapping=50.0"):
        from_hf_config({**sizes, "attn_logit_softcapping": 50.0})


def test_qwen3_moe_features():
    """Qwen3-MoE: Qwen3's attention (q/k norms, no biases); a layer is sparse when ``(i + 1) % decoder_sparse_step
    == 0`` and it is not in ``mlp_only_layers``; a sparse layer holds a router and transformers 5's fused experts,
    a dense one Qwen3's gated MLP of ``intermediate_size``."""
    moe = ModelConfig.preset("tiny-qwen3-moe")
    assert moe.qk_norm and not moe.qkv_bias and not moe.gemma and moe.attention_scale == 32 ** -0.5
    assert (moe.num_experts, moe.num_experts_per_tok, moe.moe_intermediate_size) == (4, 2, 64)
    assert [moe.layer_is_moe(i) for i in range(2)] == [True, True]
    shapes = parameter_shapes(moe)
    assert shapes["model.layers.0.mlp.gate.weight"] == (4, 96)
    assert shapes["model.layers.0.mlp.experts.gate_up_proj"] == (4, 128, 96)
    assert shapes["model.layers.0.mlp.experts.down_proj"] == (4, 96, 64)
    assert "model.layers.0.mlp.gate_proj.weight" not in shapes
    mixed = ModelConfig.preset("tiny-qwen3-moe", num_hidden_layers=6, decoder_sparse_step=2, mlp_only_layers=[3])
    assert [i for i in range(6) if mixed.layer_is_moe(i)] == [1, 5]
    assert parameter_shapes(mixed)["model.layers.0.mlp.gate_proj.weight"] == (256, 96)
    assert not any(ModelConfig.preset("tiny-qwen3").layer_is_moe(i) for i in range(2))
    assert ModelConfig.preset("tiny-qwen3-moe", sliding_window=8).layer_is_sliding(1)  # every layer, as Mistral
    # transformers' Qwen3MoeConfig.to_dict() spells num_experts num_local_experts; both read the same
    values = to_hf_config(mixed)
    assert from_hf_config(values) == mixed
    values["num_local_experts"] = values.pop("num_experts")
    assert from_hf_config(values) == mixed
    bare = from_hf_config({"model_type": "qwen3_moe"})  # transformers' defaults (Qwen3-30B-A3B's sizes)
    assert (bare.num_experts, bare.num_experts_per_tok, bare.moe_intermediate_size, bare.norm_topk_prob) == (
        128, 8, 768, False)
    assert (bare.router_aux_loss_coef, bare.output_router_logits, bare.sliding_window) == (0.001, False, None)


@pytest.mark.parametrize("values,match", [
    (dict(model_type="llama", num_experts=4),
     r"ModelConfig fields \{'num_experts': 4\} are only read by model_type 'qwen3_moe' or 'mixtral' or 'gpt_oss' "
     r"\(got 'llama'.*"
     r"drop them"),
    (dict(model_type="qwen3", output_router_logits=True), r"'output_router_logits': True.*set model_type='qwen3_moe'"),
    (dict(model_type="qwen3_moe", num_experts=2, num_experts_per_tok=4, moe_intermediate_size=8),
     r"num_experts=2 is below num_experts_per_tok=4.*set num_experts >= num_experts_per_tok"),
    (dict(model_type="qwen3_moe", num_experts=4),
     r"moe_intermediate_size=None: model_type 'qwen3_moe' needs.*set moe_intermediate_size"),
    (dict(model_type="qwen3_moe", num_experts=4, moe_intermediate_size=8, mlp_only_layers=[2]),
     r"mlp_only_layers=\[2\] has \[2\] outside the num_hidden_layers=2 layers; give layer indices 0..1"),
    (dict(model_type="qwen3_moe", num_experts=4, moe_intermediate_size=8, layer_types=["full_attention"] * 2),
     r"layer_types \(got 2 entries\) is not used by model_type 'qwen3_moe'"),
])
def test_qwen3_moe_fields_are_refused_where_they_mean_nothing(values, match):
    with pytest.raises(ConfigError, match=match):
        ModelConfig(**values)


HUB_EXPERT_NAMES = {  # what transformers' save_pretrained writes per expert: (router, gate, up, down)
    "tiny-qwen3-moe": ("mlp.gate.weight", "mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight",
                       "mlp.experts.{e}.down_proj.weight"),
    "tiny-mixtral": ("block_sparse_moe.gate.weight", "block_sparse_moe.experts.{e}.w1.weight",
                     "block_sparse_moe.experts.{e}.w3.weight", "block_sparse_moe.experts.{e}.w2.weight"),
}


@pytest.mark.parametrize("preset", sorted(HUB_EXPERT_NAMES))
def test_hub_format_experts_are_fused_as_transformers_fuses_them(tmp_path, preset):
    """A checkpoint as transformers' ``save_pretrained`` writes it (Qwen3-MoE: one ``gate_proj``/``up_proj``/
    ``down_proj`` per expert; Mixtral: ``block_sparse_moe`` with ``w1`` (gate), ``w3`` (up), ``w2`` (down) per expert)
    reads as the fused tensors of ``parameter_shapes``: ``gate_up_proj[e] = [gate_e; up_e]``; the control: the same
    tensors with gate and up swapped are another model."""
    from safetensors.numpy import save_file

    from twinseq.common.models.hf_folder import read_hf_checkpoint

    cfg = ModelConfig.preset(preset, vocab_size=64, num_hidden_layers=1)
    m = cfg.expert_intermediate_size
    fused = init_weights(cfg, seed=1)
    router, gate, up, down_name = HUB_EXPERT_NAMES[preset]
    hub = {k: v for k, v in fused.items() if ".mlp." not in k}
    hub["model.layers.0." + router] = fused["model.layers.0.mlp.gate.weight"]
    gate_up, down = fused["model.layers.0.mlp.experts.gate_up_proj"], fused["model.layers.0.mlp.experts.down_proj"]
    for e in range(cfg.num_experts):
        hub["model.layers.0." + gate.format(e=e)] = gate_up[e, :m].copy()
        hub["model.layers.0." + up.format(e=e)] = gate_up[e, m:].copy()
        hub["model.layers.0." + down_name.format(e=e)] = down[e].copy()
    save_file(hub, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(to_hf_config(cfg)))
    read_cfg, weights = read_hf_checkpoint(tmp_path)
    assert read_cfg == cfg and list(weights) != [] and set(weights) == set(fused)
    for name, values in fused.items():
        np.testing.assert_array_equal(weights[name], values, err_msg=name)
    swapped = np.concatenate([gate_up[:, m:], gate_up[:, :m]], axis=1)
    assert not np.array_equal(weights["model.layers.0.mlp.experts.gate_up_proj"], swapped)


def test_mixtral_features():
    """Mixtral: Mistral's attention (no q/k norm, no biases, the window on every layer); every layer a mixture of
    ``num_experts`` experts of ``intermediate_size``, top-k always renormalised and kept in float32; config.json in
    transformers' ``MixtralConfig`` names (``num_local_experts``), with its defaults (Mixtral 8x7B's sizes)."""
    mix = ModelConfig.preset("tiny-mixtral")
    assert not mix.qk_norm and not mix.qkv_bias and not mix.gemma and mix.attention_scale == 24 ** -0.5
    assert (mix.num_experts, mix.num_experts_per_tok, mix.expert_intermediate_size) == (4, 2, 64)
    assert mix.renormalise_top_k and mix.routing_weights_f32 and not mix.norm_topk_prob
    assert [mix.layer_is_moe(i) for i in range(2)] == [True, True]
    assert not ModelConfig.preset("tiny-qwen3-moe").routing_weights_f32
    shapes = parameter_shapes(mix)
    assert shapes["model.layers.1.mlp.experts.gate_up_proj"] == (4, 128, 96)
    assert shapes["model.layers.1.mlp.experts.down_proj"] == (4, 96, 64)
    assert not any("gate_proj" in k or "q_norm" in k for k in shapes)
    assert not mix.layer_is_sliding(0)
    windowed = ModelConfig.preset("tiny-mixtral", sliding_window=8, output_router_logits=True)
    assert windowed.layer_is_sliding(0) and windowed.layer_is_sliding(1)
    values = to_hf_config(windowed)
    assert values["num_local_experts"] == 4 and "num_experts" not in values and values["router_jitter_noise"] == 0.0
    assert from_hf_config(values) == windowed
    bare = from_hf_config({"model_type": "mixtral"})  # transformers' MixtralConfig defaults
    assert (bare.num_experts, bare.num_experts_per_tok, bare.intermediate_size, bare.sliding_window) == (
        8, 2, 14336, None)
    assert (bare.rope_theta, bare.rms_norm_eps, bare.max_position_embeddings) == (1e6, 1e-5, 131072)


@pytest.mark.parametrize("values,match", [
    (dict(model_type="mixtral", num_experts=4, moe_intermediate_size=64),
     r"\{'moe_intermediate_size': 64\} are only read by model_type 'qwen3_moe' \(got 'mixtral', its experts are "
     r"intermediate_size wide.*drop them"),
    (dict(model_type="mixtral", num_experts=4, norm_topk_prob=True), r"\{'norm_topk_prob': True\}.*got 'mixtral'"),
    (dict(model_type="mixtral", num_experts=4, mlp_only_layers=[0]), r"\{'mlp_only_layers': \[0\]\}.*got 'mixtral'"),
    (dict(model_type="mixtral", num_experts=1, num_experts_per_tok=2),
     r"num_experts=1 is below num_experts_per_tok=2 \(model_type 'mixtral'.*set num_experts >= num_experts_per_tok"),
    (dict(model_type="mixtral", num_experts=4, layer_types=["full_attention"] * 2),
     r"layer_types \(got 2 entries\) is not used by model_type 'mixtral'"),
])
def test_mixtral_fields_are_refused_where_they_mean_nothing(values, match):
    with pytest.raises(ConfigError, match=match):
        ModelConfig(**values)


def test_mixtral_router_jitter_noise_is_refused_with_the_fix():
    """transformers multiplies Mixtral's MoE inputs by uniform noise in train mode when ``router_jitter_noise > 0``:
    no two runs, and no two backends, would agree; the config.json is refused, naming the field, the value and the
    fix. The control: 0.0 (and an absent key) reads."""
    values = to_hf_config(ModelConfig.preset("tiny-mixtral"))
    with pytest.raises(ConfigError, match=r"model/config.json: router_jitter_noise=0.01 is not supported; .*"
                                          r"set router_jitter_noise to 0.0 in config.json"):
        from_hf_config({**values, "router_jitter_noise": 0.01}, "model/config.json")
    assert from_hf_config(values) == from_hf_config({k: v for k, v in values.items() if k != "router_jitter_noise"})


def test_gpt_oss_features():
    """gpt-oss: attention sinks, biases on q/k/v/o, sliding and full layers alternating, YaRN, every layer a mixture
    of experts with a biased router and biased, interleaved, input-major expert tensors; config.json in transformers'
    ``GptOssConfig`` names (``num_local_experts``, ``swiglu_limit``), with its defaults (gpt-oss-20b's sizes)."""
    cfg = ModelConfig.preset("tiny-gpt-oss", swiglu_limit=0.5, output_router_logits=True)
    assert cfg.has_attention_sinks and cfg.qkv_bias and cfg.o_bias and cfg.renormalise_top_k and not cfg.qk_norm
    assert not any(ModelConfig.preset(p).has_attention_sinks for p in FAMILY_PRESETS if p != "tiny-gpt-oss")
    assert [cfg.layer_is_sliding(i) for i in range(2)] == [True, False] and cfg.layer_is_moe(0)
    shapes = parameter_shapes(cfg)
    p = "model.layers.1."
    assert shapes[p + "self_attn.sinks"] == (4,) and shapes[p + "self_attn.o_proj.bias"] == (96,)
    assert (shapes[p + "mlp.router.weight"], shapes[p + "mlp.router.bias"]) == ((4, 96), (4,))
    assert shapes[p + "mlp.experts.gate_up_proj"] == (4, 96, 128)
    assert shapes[p + "mlp.experts.gate_up_proj_bias"] == (4, 128)
    assert shapes[p + "mlp.experts.down_proj"] == (4, 64, 96) and shapes[p + "mlp.experts.down_proj_bias"] == (4, 96)
    assert not any("mlp.gate." in k or "gate_proj" in k for k in shapes)
    values = to_hf_config(cfg)
    assert (values["num_local_experts"], values["swiglu_limit"], values["attention_bias"]) == (4, 0.5, True)
    assert values["rope_parameters"] == {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                                         "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096}
    assert from_hf_config(values) == cfg and from_hf_config({**values, "swiglu_limit": 7.0}) != cfg  # control
    bare = from_hf_config({"model_type": "gpt_oss"})  # transformers' GptOssConfig defaults
    assert (bare.num_experts, bare.num_experts_per_tok, bare.sliding_window, bare.swiglu_limit) == (128, 4, 128, 7.0)
    assert (bare.rope_type, bare.rope_factor, bare.rope_original_max_position_embeddings, bare.rope_truncate) == (
        "yarn", 32.0, 4096, False)
    assert bare.layer_types[:3] == ["sliding_attention", "full_attention", "sliding_attention"]
    assert bare.attention_bias and bare.rope_theta == 150000.0 and not bare.tie_word_embeddings


@pytest.mark.parametrize("values,match", [
    (dict(model_type="mixtral", num_experts=4, swiglu_limit=1.0),
     r"\{'swiglu_limit': 1.0\} are only read by model_type 'gpt_oss' \(got 'mixtral'.*set model_type='gpt_oss'"),
    (dict(rope_type="yarn", rope_factor=4.0, rope_original_max_position_embeddings=64),
     r"rope_type='yarn' is built for model_type 'gpt_oss' only \(got 'llama'\); use rope_type 'default'"),
    (dict(model_type="gpt_oss", num_experts=4, num_experts_per_tok=2, sliding_window=8, rope_type="yarn"),
     r"rope_type='yarn' needs rope_original_max_position_embeddings: set it .*4096 for gpt-oss"),
])
def test_gpt_oss_fields_are_refused_where_they_mean_nothing(values, match):
    with pytest.raises(ConfigError, match=match):
        ModelConfig(**values)


def test_gpt_oss_config_json_refuses_deepseek_yarn():
    values = to_hf_config(ModelConfig.preset("tiny-gpt-oss"))
    values["rope_parameters"] = {**values["rope_parameters"], "mscale": 1.0, "mscale_all_dim": 1.0}
    with pytest.raises(ConfigError, match=r"rope_parameters.mscale=1.0 is not supported; .*drop mscale"):
        from_hf_config(values, "config.json")
    del values["rope_parameters"]["mscale"], values["rope_parameters"]["mscale_all_dim"]
    assert from_hf_config(values, "config.json") == ModelConfig.preset("tiny-gpt-oss")  # control


@pytest.mark.parametrize("values,match", [
    ({"model_type": "gpt2"}, "model_type='gpt2' is not supported; twinseq builds llama, qwen2, qwen3, qwen3_moe, "
                             "mistral, mixtral, gemma2, gemma3_text"),
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
    g3 = init_weights(ModelConfig.preset("tiny-gemma3"), seed=0)
    assert not g3["model.layers.0.self_attn.k_norm.weight"].any()  # Gemma 3's q/k norms are 1 + w too
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


def test_yarn_rope():
    """YaRN keeps the frequencies that turn more than beta_fast times within original_max_position_embeddings,
    divides those that turn fewer than beta_slow times by factor, and ramps between; cos and sin scale by
    0.1 ln(factor) + 1. (Bit equality with transformers' ``_compute_yarn_parameters``: parity_tests.)"""
    cfg = ModelConfig.preset("tiny-gpt-oss")
    freq, plain = rope.rope_inv_freq(cfg), rope.default_inv_freq(cfg.head_dim, cfg.rope_theta)
    turns = 4096 * plain / (2 * np.pi)  # rotations within original_max_position_embeddings
    fast, slow = turns > 32, turns < 1
    assert fast.any() and slow.any() and (~fast & ~slow).any()
    np.testing.assert_array_equal(freq[fast], plain[fast])
    np.testing.assert_allclose(freq[slow], plain[slow] / 32.0, rtol=1e-6)
    middle = ~fast & ~slow
    assert ((freq[middle] < plain[middle]) & (freq[middle] > plain[middle] / 32.0)).all()
    assert rope.rope_attention_factor(cfg) == pytest.approx(0.1 * np.log(32.0) + 1)
    assert rope.rope_attention_factor(ModelConfig.preset("tiny-gpt-oss", rope_attention_factor=1.5)) == 1.5
    assert rope.rope_attention_factor(ModelConfig.preset("tiny-llama3")) == 1.0
