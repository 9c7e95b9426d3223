"""The HF model built from the neutral config and weights (the tiny Llama here; every family in
test_families.py): names, shapes, I/O round trips, protocol."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from twinseq.common.backend import PROTOCOL, load_backend
from twinseq.common.data.batching import collate
from twinseq.common.config import ModelConfig
from twinseq.common.models.init import init_weights, parameter_shapes
from twinseq.common.objectives.nll import nll_loss
from twinseq.torch_backend.checkpoint import load_pretrained, save_pretrained
from twinseq.torch_backend.model import (build_model, export_weights, logits, loss_and_grads, model_config_of,
                                         to_hf_model_config)


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def cfg(request):
    return ModelConfig.preset("tiny", tie_word_embeddings=request.param, rope_theta=5000.0)


@pytest.fixture(scope="module")
def weights(cfg):
    return init_weights(cfg, seed=0)


@pytest.fixture(scope="module")
def batch(cfg):
    rng = np.random.default_rng(0)
    return collate([{"input_ids": rng.integers(3, cfg.vocab_size, n).tolist()} for n in (9, 17, 4)],
                   padding_free=True, pad_to_multiple_of=8)


def test_config_translation_round_trips(cfg):
    config = to_hf_model_config(cfg)
    assert type(config).__name__ == "LlamaConfig"
    assert config.rope_parameters == {"rope_type": "default", "rope_theta": 5000.0}
    assert (config.hidden_act, config.attention_bias, config.mlp_bias) == ("silu", False, False)
    model = build_model(cfg)
    assert model_config_of(model) == cfg


def test_weights_load_and_export_bitwise(cfg, weights):
    model = build_model(cfg, weights)
    assert model.training
    exported = export_weights(model)
    assert list(exported) == list(parameter_shapes(cfg))
    for name, value in weights.items():
        assert exported[name].dtype == np.float32
        np.testing.assert_array_equal(exported[name], value, err_msg=name)
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    assert tied == cfg.tie_word_embeddings and ("lm_head.weight" in exported) == (not tied)


def test_skipping_hf_init_changes_nothing(cfg, weights, batch):
    """build_model skips HF's random init; a model built with it and then loaded is identical."""
    from transformers import AutoModelForCausalLM

    from twinseq.torch_backend.model import load_weights_

    reference = AutoModelForCausalLM.from_config(to_hf_model_config(cfg))
    load_weights_(reference, weights)
    np.testing.assert_array_equal(logits(build_model(cfg, weights), batch), logits(reference, batch))
    buffers = dict(reference.named_buffers())
    for name, buf in build_model(cfg, weights).named_buffers():
        torch.testing.assert_close(buf, buffers[name], rtol=0, atol=0)


def test_bfloat16_casts_parameters_not_rope_buffers(cfg, weights, batch):
    model = build_model(cfg, weights, dtype="bfloat16", attn_implementation="eager")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32, "RoPE frequencies keep fp32, as in HF"
    low, high = logits(model, batch), logits(build_model(cfg, weights, attn_implementation="eager"), batch)
    assert low.dtype == np.float32 and np.isfinite(low).all()
    assert np.abs(low - high).max() < 0.1 * np.abs(high).max()


def test_weight_mismatch_names_the_tensor(cfg, weights):
    missing = {k: v for k, v in weights.items() if k != "model.norm.weight"}
    with pytest.raises(ValueError, match=r"missing \['model.norm.weight'\]"):
        build_model(cfg, missing)
    wrong = {**weights, "model.layers.0.mlp.up_proj.weight": np.zeros((3, 3), np.float32)}
    with pytest.raises(ValueError, match="wrong shape model.layers.0.mlp.up_proj.weight"):
        build_model(cfg, wrong)
    extra = {**weights, "model.layers.9.mlp.up_proj.weight": np.zeros((3, 3), np.float32)}
    with pytest.raises(ValueError, match="unexpected"):
        build_model(cfg, extra)
    other = dataclasses.replace(cfg, num_hidden_layers=3)
    with pytest.raises(ValueError, match="missing"):
        build_model(other, weights)


def test_save_load_round_trip_bitwise(cfg, weights, batch, tmp_path):
    model = build_model(cfg, weights, attn_implementation="varlen")
    path = save_pretrained(model, tmp_path / "ckpt")
    assert (path / "model.safetensors").is_file()
    assert json.loads((path / "config.json").read_text())["model_type"] == "llama"
    loaded = load_pretrained(path, attn_implementation="varlen")
    assert loaded.training and model_config_of(loaded) == cfg
    assert (loaded.lm_head.weight is loaded.model.embed_tokens.weight) == cfg.tie_word_embeddings
    reloaded = export_weights(loaded)
    for name, value in export_weights(model).items():
        np.testing.assert_array_equal(reloaded[name], value, err_msg=name)
    np.testing.assert_array_equal(logits(loaded, batch), logits(model, batch))


def test_load_pretrained_refuses_bad_paths(tmp_path):
    with pytest.raises(ValueError, match="has no config.json"):
        load_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ValueError, match="model_type='gpt2' is not supported"):
        load_pretrained(tmp_path)


def test_logits_and_loss_match_the_numpy_reference(cfg, weights, batch):
    model = build_model(cfg, weights)
    out = logits(model, batch)
    assert out.dtype == np.float32 and out.shape == (*batch.shape, cfg.vocab_size)
    loss, grads = loss_and_grads(model, batch)
    assert loss == pytest.approx(nll_loss(out, batch.labels, batch.num_items_in_batch), abs=1e-5)
    assert list(grads) == list(parameter_shapes(cfg))
    assert all(g.dtype == np.float32 and g.shape == weights[k].shape for k, g in grads.items())
    assert all(p.grad is None for p in model.parameters()), "loss_and_grads leaves no .grad behind"


def test_gradients_are_those_of_an_independent_hf_loss(cfg, weights, batch):
    """loss_and_grads names and sums gradients right (tied embeddings: lookup + lm_head).

    Reference: HF's own forward with the dense document mask and a hand-written shifted
    cross-entropy, differentiated with torch.autograd.grad. (Finite differences do not work
    here: HF's RMSNorm computes in fp32 even in a float64 model.)
    """
    from twinseq.torch_backend.attention import document_mask

    model = build_model(cfg, weights, attn_implementation="eager")
    loss, grads = loss_and_grads(model, batch)
    seg, pos = (torch.as_tensor(a, dtype=torch.long) for a in (batch.segment_ids, batch.position_ids))
    out = model(input_ids=torch.as_tensor(batch.input_ids, dtype=torch.long), position_ids=pos,
                attention_mask=document_mask(seg, pos)).logits
    targets = torch.as_tensor(batch.labels, dtype=torch.long)[0, 1:]
    ref_loss = torch.nn.functional.cross_entropy(out[0, :-1], targets, ignore_index=-100,
                                                 reduction="sum") / batch.num_items_in_batch
    names = list(parameter_shapes(cfg))
    params = dict(model.named_parameters())
    ref_grads = torch.autograd.grad(ref_loss, [params[n] for n in names])
    assert loss == pytest.approx(float(ref_loss.detach()), abs=1e-6)
    for name, ref in zip(names, ref_grads):
        np.testing.assert_allclose(grads[name], ref.numpy(), rtol=1e-5, atol=1e-8, err_msg=name)


def test_backend_protocol_surface():
    backend = load_backend("torch")
    for name in PROTOCOL:
        assert callable(getattr(backend, name)), name
    assert callable(load_backend("torch").train)
