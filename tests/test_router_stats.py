"""A MoE model's router statistics (issue 29) on both backends: torch's ``CausalLMLoss`` and JAX's ``loss_fn`` count
each expert's routing slots in-graph, the step turns the counts into ``router_max_load``, ``router_load_max/L{i}``
and ``router_load/L{i}``, and ``twinseq train`` writes them to ``metrics.jsonl`` (the numpy reference and the step's
assembly alone: ``tests/common/objectives/test_moe_stats.py``).

Invariants, on tiny-qwen3-moe and tiny-mixtral:
- each backend's counts equal, exactly, the numpy reference's count of its own router logits, and each other;
- padding rows and columns change no count, where a count over every position would (the control);
- two micro-batches, summed as a step sums them, give one big batch's figures exactly;
- a CLI run writes the metrics: the loads of each layer sum to 1 and ``router_max_load`` is the mean of the
  layers' busiest loads;
- on 2 ranks (FSDP2, gloo) the step's figures are one process's on the same rows: every rank's tokens count;
- with ``output_router_logits`` in config.json a run logs the unweighted ``aux_loss``, and both backends' first step
  (same weights, same rows) agree on it within float32's loss bound; without it no ``aux_loss`` is logged.
"""

from __future__ import annotations

import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from twinseq.common.cli import main as cli_main
from twinseq.common.config import DEFAULT_CHUNK_SIZE, TrainConfig
from twinseq.common.data.batching import collate, pad_batch
from twinseq.common.models.configs import ModelConfig
from twinseq.common.models.init import init_weights
from twinseq.common.objectives.moe import COUNTS_KEY, moe_layers, router_counts
from twinseq.common.run.report import read_metrics
from twinseq.common.run.step_metrics import sft_step_sums, with_means
from twinseq.jax_backend import model as jax_model
from twinseq.torch_backend import model as torch_model
from twinseq.torch_backend.attention import forward_outputs
from twinseq.torch_backend.losses import CausalLMLoss

MOE = ["tiny-qwen3-moe", "tiny-mixtral"]


@pytest.fixture(scope="module")
def models():
    built = {}
    for name in MOE:
        cfg = ModelConfig.preset(name)
        weights = init_weights(cfg, seed=3)
        built[name] = cfg, torch_model.build_model(cfg, weights), jax_model.build_model(cfg, weights)
    return built


def _examples(cfg: ModelConfig, lengths, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"input_ids": rng.integers(3, cfg.vocab_size, size=n).tolist()} for n in lengths]


def _batch(cfg: ModelConfig, lengths, seed: int = 0):
    return collate(_examples(cfg, lengths, seed))  # padded rows: the shorter ones end in padding


def _torch_counts(model, batch) -> np.ndarray:
    with torch.no_grad():
        _, metrics = CausalLMLoss(model, TrainConfig())(batch, router_stats=True)
    return metrics[COUNTS_KEY].numpy()


def _torch_reference(cfg, model, batch) -> np.ndarray:
    with torch.no_grad():
        logits = forward_outputs(model, batch, output_router_logits=True).router_logits
    return router_counts([x.float().numpy() for x in logits], batch.segment_ids, cfg.num_experts_per_tok)


def _jax_counts(model, batch) -> np.ndarray:
    graphdef, state, frozen = jax_model.split_trainable(model)
    inputs = jax_model.batch_inputs(batch, model.config.vocab_size)
    num_items = jnp.asarray(batch.num_items_in_batch, jnp.int32)
    _, metrics = jax_model.loss_jit(
        graphdef, state, inputs, num_items, loss_type="nll", chunk_size=DEFAULT_CHUNK_SIZE, frozen=frozen
    )
    return np.asarray(metrics[COUNTS_KEY])


def _jax_reference(cfg, model, batch) -> np.ndarray:
    ids, positions, segments, _ = jax_model.batch_inputs(batch, cfg.vocab_size)
    _, logits = model.with_router_logits(ids, positions, segments)
    return router_counts([np.asarray(x) for x in logits], batch.segment_ids, cfg.num_experts_per_tok)


@pytest.mark.parametrize("name", MOE)
def test_each_backend_counts_what_the_reference_counts(models, name):
    cfg, tm, jm = models[name]
    batch = _batch(cfg, [11, 5, 8])
    got_torch, got_jax = _torch_counts(tm, batch), _jax_counts(jm, batch)
    print(f"{name}: torch {got_torch.tolist()}, jax {got_jax.tolist()}")
    assert np.array_equal(got_torch, _torch_reference(cfg, tm, batch))
    assert np.array_equal(got_jax, _jax_reference(cfg, jm, batch))
    assert np.array_equal(got_torch, got_jax)
    assert got_torch.shape == (len(moe_layers(cfg)), cfg.num_experts)
    assert (got_torch.sum(axis=1) == cfg.num_experts_per_tok * int((batch.segment_ids != 0).sum())).all()


def test_padding_rows_and_columns_are_not_counted(models):
    cfg, tm, jm = models["tiny-qwen3-moe"]
    batch = _batch(cfg, [11, 5, 8])
    padded = pad_batch(batch, batch.shape[0] + 2, 16)  # two padding rows, the columns to 16
    assert padded.shape == (5, 16) and (padded.segment_ids != 0).sum() == (batch.segment_ids != 0).sum()
    want = _torch_counts(tm, batch)
    assert np.array_equal(_torch_counts(tm, padded), want)
    assert np.array_equal(_jax_counts(jm, padded), want)
    with torch.no_grad():
        logits = forward_outputs(tm, padded, output_router_logits=True).router_logits
    every = router_counts([x.numpy() for x in logits], np.ones_like(padded.segment_ids), cfg.num_experts_per_tok)
    assert not np.array_equal(every, want)  # the control: a count over every position counts the padding


@pytest.mark.parametrize("backend", ["torch", "jax"])
def test_two_micro_batches_give_one_big_batchs_figures(models, backend):
    cfg, tm, jm = models["tiny-mixtral"]
    count = (lambda b: _torch_counts(tm, b)) if backend == "torch" else (lambda b: _jax_counts(jm, b))
    examples = _examples(cfg, [12, 4, 9, 7])
    # the same documents, in rows of other padding (one width: JAX compiles two shapes, not three)
    big = collate(examples, num_items_in_batch=32, pad_to_multiple_of=16)
    halves = [collate(examples[i : i + 2], num_items_in_batch=32, pad_to_multiple_of=16) for i in (0, 2)]

    def step(batches):
        records = [
            {"loss": 0.0, "num_tokens": 0, "num_correct_tokens": 0, "entropy_sum": 0.0, COUNTS_KEY: count(b)}
            for b in batches
        ]
        return with_means(sft_step_sums(records, num_tokens=0), moe_layers(cfg))

    one, two = step([big]), step(halves)
    assert one.keys() == two.keys()
    for key in one:
        assert np.array_equal(one[key], two[key]), key


@pytest.mark.parametrize("backend", ["torch", pytest.param("jax", marks=pytest.mark.slow)])  # jax: 6 s of CPU
def test_train_writes_the_router_metrics(backend, tmp_path):
    out = tmp_path / "run"
    args = (
        f"train --task sft --backend {backend} --model-config tiny-qwen3-moe --max-steps 2 --max-length 32 "
        "--per-device-train-batch-size 2 --gradient-accumulation-steps 2 --dataset-split train[:8] --disable-tqdm "
        "--seed 1 --logging-steps 1"
    ).split()
    args += ["--output-dir", str(out)]
    assert cli_main(args) == 0
    records = read_metrics(out)
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        loads = [np.asarray(r[f"router_load/L{i}"]) for i in (0, 1)]
        assert all(x.shape == (4,) and abs(x.sum() - 1.0) <= 1e-12 for x in loads), loads
        assert [r[f"router_load_max/L{i}"] for i in (0, 1)] == [x.max() for x in loads]
        assert r["router_max_load"] == pytest.approx(np.mean([x.max() for x in loads]), abs=1e-15)
        assert 1 / 4 <= r["router_max_load"] <= 1 / 2  # between balanced (1/E) and collapsed (1/k)
    assert (out / "metrics.png").is_file()


@pytest.mark.slow  # two CLI runs: about 20 s
def test_train_logs_the_aux_loss_alike_on_both_backends(tmp_path):
    import json

    from twinseq.common.models.configs import to_hf_config
    from twinseq.common.models.hf_folder import write_hf_checkpoint

    cfg = ModelConfig.preset("tiny-qwen3-moe")
    folder = tmp_path / "moe"
    write_hf_checkpoint(cfg, init_weights(cfg, seed=5), folder)
    (folder / "config.json").write_text(json.dumps({**to_hf_config(cfg), "output_router_logits": True}))
    flags = (
        "train --task sft --model-config {} --max-steps 1 --max-length 32 --per-device-train-batch-size 2 "
        "--gradient-accumulation-steps 2 --dataset-split train[:8] --disable-tqdm --seed 1 --logging-steps 1"
    )
    aux = {}
    for backend in ("torch", "jax"):
        out = tmp_path / backend
        assert cli_main([*flags.format(folder).split(), "--backend", backend, "--output-dir", str(out)]) == 0
        (record,) = read_metrics(out)
        aux[backend] = record["aux_loss"]
    print(f"step 1 aux_loss: torch {aux['torch']:.8f}, jax {aux['jax']:.8f}")
    assert abs(aux["torch"] - aux["jax"]) <= 1e-6 * aux["torch"] and aux["torch"] > 0.5
    out = tmp_path / "plain"
    assert cli_main([*flags.format("tiny-qwen3-moe").split(), "--backend", "torch", "--output-dir", str(out)]) == 0
    assert "aux_loss" not in read_metrics(out)[0]


@pytest.mark.slow
@pytest.mark.distributed
def test_two_ranks_count_every_ranks_tokens(tmp_path):
    """FSDP2 on 2 gloo ranks of 2 rows each: step 1's router figures are one process's on the same 4 rows (2
    micro-batches of 2), so the ranks' counts are summed; a step of 2 of those rows alone differs (the control)."""
    flags = (
        "--task sft --backend torch --model-config tiny-qwen3-moe --max-steps 1 --max-length 32 "
        "--per-device-train-batch-size 2 --dataset-split train[:8] --disable-tqdm --seed 1"
    ).split()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m"]
    cmd += ["twinseq.common.cli", "train", *flags, "--output-dir", str(tmp_path / "ranks")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert cli_main(["train", *flags, "--gradient-accumulation-steps", "2", "--output-dir", str(tmp_path / "one")]) == 0
    assert cli_main(["train", *flags, "--output-dir", str(tmp_path / "half")]) == 0
    (ranks,), (one,), (half,) = (read_metrics(tmp_path / d) for d in ("ranks", "one", "half"))
    keys = [k for k in one if k.startswith("router")]
    assert len(keys) == 5 and ranks["num_tokens"] == one["num_tokens"]
    assert all(np.array_equal(ranks[k], one[k]) for k in keys), {k: (ranks[k], one[k]) for k in keys}
    assert half["router_load/L0"] != one["router_load/L0"]
