"""End-to-end torch trainer: metrics, resume, bad configs. Small local data keeps it fast."""

import shutil

import pytest

torch = pytest.importorskip("torch")

from safetensors.torch import load_file  # noqa: E402

from twinseq.common.config import TrainConfig  # noqa: E402
from twinseq.common.run.report import REQUIRED_FIELDS, read_metrics  # noqa: E402
from twinseq.common.run.capabilities import Runtime, check_runtime  # noqa: E402
from twinseq.torch_backend.recipes import train  # noqa: E402
from _sft_data import write_embedded_sft_jsonl  # noqa: E402


@pytest.fixture(scope="module")
def small_sft_jsonl(tmp_path_factory):
    return write_embedded_sft_jsonl(tmp_path_factory.mktemp("data"), 160)


def _cfg(data, out, **kw):
    base = dict(dataset_name=data, model_config="tiny", max_length=96, per_device_train_batch_size=2,
                gradient_accumulation_steps=2, learning_rate=3e-3, warmup_steps=2, max_steps=6,
                output_dir=str(out), disable_tqdm=True, seed=3)
    return TrainConfig.from_flat(**{**base, **kw})


def test_metrics_have_the_contract_fields_and_loss_falls(small_sft_jsonl, tmp_path):
    train(_cfg(small_sft_jsonl, tmp_path, max_steps=12, packing=True, padding_free=True,
               attn_implementation="varlen", loss_type="fused_linear"))
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == list(range(1, 13))
    for r in records:
        assert all(k in r for k in REQUIRED_FIELDS)
        assert r["num_tokens"] > 0 and r["tokens_per_second"] > 0 and r["peak_memory_bytes"] > 0
        assert 0.0 <= r["mean_token_accuracy"] <= 1.0
    assert records[-1]["loss"] < records[0]["loss"]
    assert (tmp_path / "final" / "model.safetensors").is_file()


@pytest.mark.slow
def test_resume_is_bitwise_identical(small_sft_jsonl, tmp_path):
    """20 steps straight == 10 steps, a stop, and 10 more resumed from checkpoint-10."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    kw = dict(max_steps=20, packing=True, padding_free=True, attn_implementation="varlen")
    train(_cfg(small_sft_jsonl, straight, save_steps=10, **kw))
    # What a stop after step 10 leaves on disk: checkpoint-10 and the first 10 metric lines.
    resumed.mkdir()
    shutil.copytree(straight / "checkpoint-10", resumed / "checkpoint-10")
    lines = (straight / "metrics.jsonl").read_text().splitlines()[:10]
    (resumed / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    train(_cfg(small_sft_jsonl, resumed, resume_from_checkpoint=str(resumed / "checkpoint-10"), **kw))
    a = [r["loss"] for r in read_metrics(straight)]
    b = [r["loss"] for r in read_metrics(resumed)]
    assert [r["step"] for r in read_metrics(resumed)] == list(range(1, 21))
    assert a == b  # bitwise: exact float equality of every logged loss
    wa = load_file(str(straight / "final" / "model.safetensors"))
    wb = load_file(str(resumed / "final" / "model.safetensors"))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        (dict(loss_type="liger"), "Liger's CUDA kernel"),
        (dict(use_liger_kernel=True), "Liger's CUDA kernel"),
        (dict(activation_offloading=True), "activation_offloading=True"),
        (dict(padding_free=True, attn_implementation="flash_attention_2"), "flash_attention_2"),
    ],
)
def test_bad_runtime_configs_are_refused(overrides, fragment):
    if torch.cuda.is_available():
        pytest.skip("these refusals are for CPU-only machines")
    with pytest.raises(ValueError) as err:
        check_runtime(TrainConfig.from_flat(**overrides), Runtime("torch", "cpu"))
    assert fragment in str(err.value)
