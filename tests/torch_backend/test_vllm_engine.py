"""The colocated vLLM engine (``twinseq.torch_backend.vllm_engine``): its guards run everywhere, the
engine itself on a CUDA GPU with vLLM installed.

Invariants:
- Without vLLM, asking for it raises ``MissingDependencyError`` naming the extra; sleep mode without
  CUDA, a memory share outside (0, 1] or a sleep level other than 1/2 raise ``ConfigError`` with the fix,
  before anything is loaded.
- The ``config.json`` folder vLLM starts from describes exactly the policy's architecture.
- On a GPU: after ``sync_weights`` the engine's greedy completions equal Hugging Face ``generate`` of the
  policy, also after a sleep / wake-up cycle of either level.
"""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from twinseq.common.errors import ConfigError, MissingDependencyError  # noqa: E402
from twinseq.torch_backend import vllm_engine as ve  # noqa: E402


def test_missing_vllm_names_the_extra(monkeypatch):
    monkeypatch.setattr(ve, "vllm_available", lambda: False)
    with pytest.raises(MissingDependencyError, match=r"twinseq\[gpu\].*--use-vllm"):
        ve.check_vllm(cuda_available=True)


@pytest.mark.skipif(ve.vllm_available(), reason="vLLM is installed here")
def test_building_the_engine_without_vllm_fails_before_loading_anything():
    from twinseq.common.config import ModelConfig
    from twinseq.torch_backend.model import to_hf_model_config

    with pytest.raises(MissingDependencyError, match="vLLM"):
        ve.ColocatedVLLM(to_hf_model_config(ModelConfig.preset("tiny")))


def test_sleep_mode_needs_cuda():
    with pytest.raises(ConfigError, match=r"vllm_enable_sleep_mode=True needs CUDA.*--vllm-enable-sleep-mode"):
        ve.check_vllm(enable_sleep_mode=True, cuda_available=False)


def test_vllm_without_cuda_is_refused(monkeypatch):
    monkeypatch.setattr(ve, "vllm_available", lambda: True)
    with pytest.raises(ConfigError, match="needs a CUDA GPU"):
        ve.check_vllm(cuda_available=False)
    ve.check_vllm(enable_sleep_mode=True, sleep_level=2, cuda_available=True)  # a GPU with vLLM: accepted


@pytest.mark.parametrize("kwargs, match", [
    (dict(gpu_memory_utilization=0.0), "vllm_gpu_memory_utilization=0.0"),
    (dict(gpu_memory_utilization=1.5), "vllm_gpu_memory_utilization=1.5"),
    (dict(sleep_level=3), "sleep_level=3"),
])
def test_out_of_range_knobs_are_refused(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        ve.check_vllm(cuda_available=True, **kwargs)


def test_config_folder_describes_the_policy(tmp_path):
    from transformers import AutoConfig

    from twinseq.common.config import ModelConfig
    from twinseq.common.models import from_hf_config
    from twinseq.torch_backend.model import to_hf_model_config

    for preset in ("tiny", "tiny-qwen2", "tiny-gemma2"):
        cfg = ModelConfig.preset(preset)
        folder = ve.write_config_folder(to_hf_model_config(cfg), str(tmp_path / preset))
        assert sorted(p.name for p in folder.iterdir()) == ["config.json"]
        values = json.loads((folder / "config.json").read_text())
        assert values["architectures"][0].endswith("ForCausalLM")
        loaded = AutoConfig.from_pretrained(str(folder), local_files_only=True)
        assert from_hf_config(loaded.to_dict(), preset) == cfg


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("sleep_level", [1, 2])
def test_colocated_engine_generates_what_hf_generates(sleep_level):
    pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'twinseq[gpu]')")
    from twinseq.common.config import ModelConfig
    from twinseq.common.init import init_weights
    from twinseq.torch_backend.deepspeed import generate
    from twinseq.torch_backend.model import build_model

    cfg = ModelConfig.preset("tiny")
    model = build_model(cfg, init_weights(cfg, seed=0), device="cuda").eval()
    prompts = [[5, 6, 7, 8], [40, 41], [100, 103, 106]]
    engine = ve.ColocatedVLLM(model.config, gpu_memory_utilization=0.2, enable_sleep_mode=True,
                              sleep_level=sleep_level, dtype="float32")
    assert engine.sync_weights(model) == len(list(model.parameters()))
    want = generate(model, prompts, max_new_tokens=8)
    assert engine.generate(prompts, max_new_tokens=8, do_sample=False) == want
    engine.sleep()
    engine.sync_weights(model)  # level 2 dropped the weights: the sync writes them back
    assert engine.generate(prompts, max_new_tokens=8, do_sample=False) == want
