"""A LoRA/DoRA run under ``--dtype bfloat16`` stores its frozen base in bfloat16 on both backends, its adapters in
float32 (issue 26, item 4.2; ``common.models.peft.base_dtype``).

- the built models, by dtype: the base is exactly half its float32 bytes, the adapters are float32, and what
  trains is the same;
- jax: the compiled step of the bf16 base against the float32 base the trainer used to hold (compute dtype
  bfloat16 in both): its arguments (the live parameters) drop by exactly the base's two bytes a number, and its
  temporaries do not grow (the bfloat16 copies of the float32 base were temporaries before);
- torch (slow): the resident memory of a real ``twinseq train`` run (``benchmarks/_train_peak.measure``, a fresh
  subprocess), before its first step, against the same run in float32, whose base was float32 before and is now.
"""

from __future__ import annotations

import collections
import sys
from pathlib import Path

import numpy as np
import pytest

from twinseq.common.config import TrainConfig
from twinseq.common.models.configs import parameter_shapes, resolve_model_config
from twinseq.common.models.peft import PeftConfig, adapter_shapes, base_dtype

MIB = 2**20
LORA = dict(use_peft=True, lora_r=8, lora_alpha=16.0, lora_dropout=0.0)


def _numel(shapes) -> int:
    return int(sum(np.prod(s) for s in shapes.values()))


def test_the_rule():
    on = PeftConfig(use_peft=True)
    assert base_dtype(on, "bfloat16") == "bfloat16" and base_dtype(on, "float32") == "float32"
    assert base_dtype(PeftConfig(), "bfloat16") == "float32"  # full fine-tuning: float32 master weights
    assert base_dtype(PeftConfig(use_peft=True, load_in_4bit=True), "bfloat16") == "float32"  # NF4 computes in f32


def _cfg(backend: str, dtype: str, **kw) -> TrainConfig:
    return TrainConfig.from_flat(backend=backend, model_config="tiny", dtype=dtype, output_dir="unused", **LORA, **kw)


def _torch_bytes(dtype: str, **kw) -> dict:
    import torch

    from twinseq.torch_backend import trainer

    cfg = _cfg("torch", dtype, **kw)
    model = trainer.add_peft(cfg, trainer.build_causal_lm(cfg, 8192, torch.device("cpu")))
    out: collections.Counter = collections.Counter()
    for p in model.parameters():
        part = "adapters" if p.requires_grad else "base"
        out[(part, str(p.dtype).replace("torch.", ""))] += p.numel() * p.element_size()
    return dict(out)


def _jax_bytes(dtype: str, **kw) -> dict:
    import jax

    from twinseq.jax_backend import trainer

    _, params, frozen = trainer.split_trainable(trainer.build_causal_lm(_cfg("jax", dtype, **kw), 8192))
    out: collections.Counter = collections.Counter()
    for part, tree in (("adapters", params), ("base", frozen)):
        for leaf in jax.tree.leaves(tree):
            out[(part, str(leaf.dtype))] += leaf.nbytes
    return dict(out)


@pytest.mark.parametrize("backend", ["torch", "jax"])
@pytest.mark.parametrize("variant", [{}, dict(use_dora=True), dict(trainable_token_indices=[3, 4])],
                         ids=["lora", "dora", "tokens"])
def test_the_frozen_base_is_bf16_and_the_adapters_float32(backend, variant):
    pytest.importorskip(backend)
    if backend == "torch":
        pytest.importorskip("peft")
    measure = _torch_bytes if backend == "torch" else _jax_bytes
    fp32, bf16 = measure("float32", **variant), measure("bfloat16", **variant)
    cfg = resolve_model_config("tiny")
    base = _numel(parameter_shapes(cfg))
    adapters = _numel(adapter_shapes(cfg, _cfg(backend, "bfloat16", **variant).peft))
    assert fp32 == {("base", "float32"): 4 * base, ("adapters", "float32"): 4 * adapters}
    assert bf16 == {("base", "bfloat16"): 2 * base, ("adapters", "float32"): 4 * adapters}
    print(f"{backend} {variant}: base {4 * base / MIB:.2f} MiB float32 -> {2 * base / MIB:.2f} MiB bfloat16, "
          f"adapters {4 * adapters / MIB:.3f} MiB float32")


@pytest.mark.slow  # fast-tier budget: runs in make test-all and CI
def test_jax_compiled_step_holds_half_the_base_and_no_more_temporaries():
    pytest.importorskip("jax")
    import jax.numpy as jnp

    from twinseq.jax_backend import trainer
    from twinseq.jax_backend.model import CausalLM, grads_jit, split_trainable

    cfg = _cfg("jax", "bfloat16")
    new = trainer.build_causal_lm(cfg, 8192)
    source = resolve_model_config("tiny")
    from twinseq.common.models.init import init_weights

    old = trainer.with_adapters(CausalLM(source, init_weights(source, seed=0), dtype="float32"), cfg)

    def step_memory(model):
        graphdef, params, frozen = split_trainable(model)
        ids = jnp.zeros((2, 128), jnp.int32)
        return grads_jit.lower(graphdef, params, (ids, ids, ids, ids), jnp.asarray(10, jnp.int32),
                               loss_type="fused_linear", chunk_size=64, compute_dtype="bfloat16",
                               frozen=frozen).compile().memory_analysis()

    before, after = step_memory(old), step_memory(new)
    base = _numel(parameter_shapes(source))
    assert before.argument_size_in_bytes - after.argument_size_in_bytes == 2 * base
    assert after.temp_size_in_bytes <= before.temp_size_in_bytes * 1.01
    print(f"jax tiny step: arguments {before.argument_size_in_bytes / MIB:.2f} -> "
          f"{after.argument_size_in_bytes / MIB:.2f} MiB, temporaries {before.temp_size_in_bytes / MIB:.2f} -> {after.temp_size_in_bytes / MIB:.2f} MiB")


@pytest.mark.slow
def test_torch_resident_memory_of_a_real_run_drops_by_half_the_base():
    """``small`` (12.6M numbers): the float32 base is 48 MiB, the bf16 one 24 MiB. Measured on a 2-core AMD EPYC,
    three runs: resident before the first step 75.3 -> 45.7, 73.9 -> 43.7 and 74.0 -> 37.1 MiB (the base's 24 MiB
    plus what the allocator keeps of the float32 copies made while building, which varies from run to run), peak
    over the steps 186 -> 121, 186 -> 135 and 189 -> 133 MiB (autocast's bf16 copies of a float32 base are gone
    too, and the compute dtype changes the activations)."""
    pytest.importorskip("torch")
    pytest.importorskip("peft")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from _train_peak import measure

    values = dict(backend="torch", model_config="small", max_length=128, per_device_train_batch_size=2,
                  learning_rate=1e-3, **LORA)
    fp32 = measure({**values, "dtype": "float32"}, max_steps=2, skip_saves=True)
    bf16 = measure({**values, "dtype": "bfloat16"}, max_steps=2, skip_saves=True)
    half_base = 2 * _numel(parameter_shapes(resolve_model_config("small")))
    drop = fp32["resident_before_steps_bytes"] - bf16["resident_before_steps_bytes"]
    print(f"resident before the steps {fp32['resident_before_steps_bytes'] / MIB:.1f} -> "
          f"{bf16['resident_before_steps_bytes'] / MIB:.1f} MiB (half the base: {half_base / MIB:.1f} MiB); peak "
          f"{fp32['peak_bytes'] / MIB:.1f} -> {bf16['peak_bytes'] / MIB:.1f} MiB")
    # at least the half of the base that is gone, at most the whole float32 base: nothing else than the base
    # (and the allocator's leftovers of its float32 copies) may change before the first step
    assert 0.9 * half_base <= drop <= 2 * half_base
    assert bf16["peak_bytes"] < fp32["peak_bytes"] - half_base
