"""Streamed saves on torch: the lazy states equal torch's own full state dicts (so a checkpoint is the same
checkpoint), and the streamed model folder equals what transformers' own ``save_pretrained`` writes."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from twinseq.common.config import ModelConfig
from twinseq.common.models.init import init_weights
from twinseq.common.run.checkpoint import flatten_state
from twinseq.torch_backend.checkpoint import save_pretrained, to_numpy_tree
from twinseq.torch_backend.distributed import (
    full_model_state,
    full_optimizer_state,
    lazy_model_state,
    lazy_optimizer_state,
)
from twinseq.torch_backend.model import build_model


def _materialise(tree):
    arrays, skeleton = flatten_state(tree)
    return {k: np.asarray(v.produce() if hasattr(v, "produce") else v) for k, v in arrays.items()}, skeleton


@pytest.fixture(params=[True, False], ids=["tied", "untied"])
def trained(request):
    cfg = ModelConfig.preset("tiny", tie_word_embeddings=request.param)
    model = build_model(cfg, init_weights(cfg, seed=0))
    for p in model.model.layers[0].parameters():
        p.requires_grad_(False)  # a frozen part: in no optimizer group
    # a parameter that has no gradient yet has no optimizer state: torch leaves it out of "state"
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, betas=(0.8, 0.9))
    ids = torch.randint(0, cfg.vocab_size, (2, 12))
    model(input_ids=ids, labels=ids).loss.backward()
    model.model.norm.weight.grad = None
    optimizer.step()
    return cfg, model, optimizer


def test_the_lazy_optimizer_state_is_torchs_full_optimizer_state(trained):
    _, model, optimizer = trained
    want = to_numpy_tree(full_optimizer_state(model, optimizer))
    got = lazy_optimizer_state(model, optimizer)
    want_arrays, want_skeleton = _materialise(want)
    got_arrays, got_skeleton = _materialise(got)
    assert got_skeleton == want_skeleton
    assert set(got_arrays) == set(want_arrays) and "model.norm.weight" not in got["state"]
    for name, value in want_arrays.items():
        assert got_arrays[name].dtype == value.dtype, name
        np.testing.assert_array_equal(got_arrays[name], value, err_msg=name)


def test_the_lazy_model_state_is_the_full_model_state(trained):
    cfg, model, _ = trained
    names = [n for n, _ in model.named_parameters()]
    full = full_model_state(model)
    for name, lazy in lazy_model_state(model, names, float32=True).items():
        np.testing.assert_array_equal(lazy.produce(), full[name].float().numpy(), err_msg=name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_streamed_model_folder_is_transformers_own(dtype, tmp_path):
    """Same tensor names, dtypes and bytes, and the same config.json, as ``PreTrainedModel.save_pretrained``."""
    cfg = ModelConfig.preset("tiny")
    model = build_model(cfg, init_weights(cfg, seed=1)).to(dtype)
    save_pretrained(model, tmp_path / "ours")
    model.save_pretrained(str(tmp_path / "theirs"), safe_serialization=True)
    if dtype == torch.bfloat16:
        from safetensors.torch import load_file as load_torch

        ours, theirs = (
            load_torch(str(tmp_path / "ours/model.safetensors")),
            load_torch(str(tmp_path / "theirs/model.safetensors")),
        )
        assert set(ours) == set(theirs)
        assert all(ours[k].dtype == torch.bfloat16 and torch.equal(ours[k], theirs[k]) for k in theirs)
    else:
        ours, theirs = (
            load_file(str(tmp_path / "ours/model.safetensors")),
            load_file(str(tmp_path / "theirs/model.safetensors")),
        )
        assert set(ours) == set(theirs)
        for k in theirs:
            np.testing.assert_array_equal(ours[k], theirs[k], err_msg=k)
    config = json.loads((tmp_path / "ours/config.json").read_text())
    assert config == json.loads((tmp_path / "theirs/config.json").read_text())
    assert config["dtype"] == str(dtype).removeprefix("torch.")
