"""gpt-oss checkpoints in their released layout: MXFP4 experts (``common.models.mxfp4``), bfloat16 elsewhere.

Invariants:
- the numpy dequantisation equals transformers' own (``integrations.mxfp4.convert_moe_packed_tensors``) bitwise in
  float32, on random codes and scales; swapping the two nibbles of a byte breaks the equality (the control);
- a tiny-gpt-oss folder in the released layout (``_blocks``/``_scales`` experts, bfloat16 rest, a
  ``quantization_config``) inspects with transformers' fused shapes and loads on both backends with the experts equal
  to the dequantized numbers exactly (bfloat16 holds them), and the two backends' float32 logits agree within the
  tolerance table's ``logits_abs``;
- a pair missing its half, and a ``quantization_config`` of another method, are refused naming the tensor or the
  method and the fix;
- ``twinseq train --model-config DIR`` fine-tunes from the MXFP4 folder, and the folder it saves holds float experts
  and no ``quantization_config``, which loads again.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("jax")

from parity_tests.families import family_batches  # noqa: E402
from parity_tests.tolerances import TOLERANCES  # noqa: E402
from twinseq.common.cli import main as cli_main  # noqa: E402
from twinseq.common.errors import CheckpointError  # noqa: E402
from twinseq.common.models.configs import ModelConfig, to_hf_config  # noqa: E402
from twinseq.common.models.hf_folder import inspect_model_folder, read_hf_checkpoint  # noqa: E402
from twinseq.common.models.init import init_weights  # noqa: E402
from twinseq.common.models.mxfp4 import dequantize_mxfp4  # noqa: E402

QUANTIZATION = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "lm_head"]}


def _packed(rng: np.random.Generator, experts: int, rows: int, columns: int) -> tuple[np.ndarray, np.ndarray]:
    """Random MXFP4 codes ``[E, rows, columns / 32, 16]`` and scales (``2 ** -6`` to ``2 ** -3``)."""
    blocks = rng.integers(0, 256, (experts, rows, columns // 32, 16), dtype=np.uint8)
    return blocks, rng.integers(121, 125, (experts, rows, columns // 32), dtype=np.uint8)


def test_dequantisation_equals_transformers_bitwise():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks, scales = _packed(np.random.default_rng(0), 3, 8, 64)
    scales[0, 0, 0], scales[1, 2, 1] = 0, 254  # the E8M0 extremes: 2 ** -127 and 2 ** 127
    want = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32)
    got = np.swapaxes(dequantize_mxfp4(blocks, scales), 1, 2)
    assert got.dtype == np.float32 and got.shape == tuple(want.shape) == (3, 64, 8)
    assert np.array_equal(got, want.numpy())
    swapped = (blocks << 4) | (blocks >> 4)  # each byte's nibbles exchanged
    assert not np.array_equal(np.swapaxes(dequantize_mxfp4(swapped, scales), 1, 2), want.numpy())


def _mxfp4_folder(folder, seed: int = 0):
    """A tiny-gpt-oss folder in the released layout; returns the dequantized experts by fused name."""
    from safetensors.torch import save_file

    cfg = ModelConfig.preset("tiny-gpt-oss")
    rng = np.random.default_rng(seed)
    tensors, experts = {}, {}
    for name, values in init_weights(cfg, seed=seed).items():
        stem, _, tensor = name.rpartition(".")
        if ".experts" in stem and tensor in ("gate_up_proj", "down_proj"):
            e, columns, rows = values.shape  # transformers' input-major [E, in, out]
            blocks, scales = _packed(rng, e, rows, columns)
            tensors[name + "_blocks"], tensors[name + "_scales"] = torch.from_numpy(blocks), torch.from_numpy(scales)
            experts[name] = np.swapaxes(dequantize_mxfp4(blocks, scales), 1, 2)
        else:
            tensors[name] = torch.from_numpy(np.asarray(values, np.float32)).to(torch.bfloat16)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = {**to_hf_config(cfg, "bfloat16"), "quantization_config": QUANTIZATION}
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return experts


def test_a_released_layout_folder_loads_on_both_backends_alike(tmp_path):
    import twinseq.jax_backend as jb
    import twinseq.torch_backend as tb

    experts = _mxfp4_folder(tmp_path / "gpt-oss")
    _, shapes = inspect_model_folder(tmp_path / "gpt-oss")
    assert all(shapes[name] == values.shape for name, values in experts.items())
    _, weights = read_hf_checkpoint(tmp_path / "gpt-oss")
    for name, values in experts.items():  # bfloat16 like the rest of the folder, the numbers unchanged
        assert str(weights[name].dtype) == "bfloat16" and np.array_equal(weights[name].astype(np.float32), values)
    tmodel = tb.load_pretrained(tmp_path / "gpt-oss", dtype="float32")
    jmodel = jb.load_pretrained(tmp_path / "gpt-oss", dtype="float32")
    state = tmodel.state_dict()
    for name, values in experts.items():
        assert np.array_equal(state[name].numpy(), values), name
    batch = family_batches()["packed"]
    t_logits, j_logits = tb.logits(tmodel, batch), jb.logits(jmodel, batch)
    real = batch.segment_ids != 0
    diff = float(np.abs(t_logits - j_logits)[real].max())
    print(f"MXFP4 tiny-gpt-oss: max |torch - jax| logits {diff:.1e}")
    assert diff <= TOLERANCES["float32"]["logits_abs"]


def test_incomplete_pairs_and_other_quantisations_are_refused(tmp_path):
    from safetensors.numpy import load_file, save_file

    _mxfp4_folder(tmp_path / "half")
    tensors = load_file(str(tmp_path / "half" / "model.safetensors"))
    dropped = next(k for k in tensors if k.endswith("down_proj_scales"))
    del tensors[dropped]
    save_file(tensors, str(tmp_path / "half" / "model.safetensors"))
    with pytest.raises(CheckpointError, match=dropped.replace("_scales", "_blocks")):
        inspect_model_folder(tmp_path / "half")
    _mxfp4_folder(tmp_path / "gptq")
    config = json.loads((tmp_path / "gptq" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (tmp_path / "gptq" / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="quant_method='gptq'.*float \\(unquantized\\) release"):
        inspect_model_folder(tmp_path / "gptq")


@pytest.mark.slow  # two short CLI runs and a reload: about 25 s
@pytest.mark.parametrize("backend", ["torch", "jax"])
def test_train_from_an_mxfp4_folder_saves_float_experts(backend, tmp_path):
    _mxfp4_folder(tmp_path / "gpt-oss")
    out = tmp_path / "run"
    args = (
        f"train --task sft --backend {backend} --model-config {tmp_path / 'gpt-oss'} --max-steps 2 --max-length 32 "
        "--per-device-train-batch-size 2 --dataset-split train[:4] --disable-tqdm --seed 1 --learning-rate 1e-3"
    ).split()
    assert cli_main([*args, "--output-dir", str(out)]) == 0
    saved = json.loads((out / "final" / "config.json").read_text())
    assert "quantization_config" not in saved
    cfg, shapes = inspect_model_folder(out / "final")
    assert any(name.endswith("experts.gate_up_proj") for name in shapes)
    assert not any(name.endswith(("_blocks", "_scales")) for name in shapes)
