"""The router statistics' numpy reference (``common.objectives.moe``) and how a step assembles them
(``common.run.step_metrics``), without torch or jax (the backends: ``tests/test_router_stats.py``).

Invariants:
- the counts are the hand count of each real token's top-k experts; ties go to the lower expert index;
- padding (segment id 0) never counts: a count over every position differs (the control);
- each layer's loads sum to 1, ``router_max_load`` is the mean over layers of the busiest expert's load, and the
  per-layer names are the decoder-layer indices of the MoE layers;
- a step's counts are the sum of its micro-batches', so two micro-batches give the figures of one big batch
  exactly, where the mean of the micro-batches' loads would not (the control);
- ``metrics.jsonl`` writes a step's per-expert loads as lists;
- a step's ``aux_loss`` is the mean over every micro-batch of every rank: summed with its count, reduced over ranks
  as the other sums, divided last (the mean of the ranks' means differs when their micro-batch counts differ: the
  control); a step without it has none.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from twinseq.common.errors import DataError
from twinseq.common.models.configs import ModelConfig
from twinseq.common.objectives.moe import COUNTS_KEY, moe_layers, router_counts, router_load_metrics
from twinseq.common.run.report import JsonlSink, TensorBoardSink, bar_postfix, read_metrics
from twinseq.common.run.step_metrics import sft_step_sums, with_means

# 1 layer, 2 rows x 3 positions, 4 experts; row 1's last position is padding
LOGITS_NE = np.array(
    [
        [4.0, 3.0, 0.0, 1.0],  # top-2: 0, 1
        [0.0, 1.0, 2.0, 3.0],  # 3, 2
        [1.0, 1.0, 1.0, 0.0],  # a three-way tie: 0, 1 (the lower indices)
        [0.0, 5.0, 0.0, 4.0],  # 1, 3
        [2.0, 0.0, 3.0, 0.0],  # 2, 0
        [0.0, 0.0, 0.0, 9.0],  # padding: 3 and a tie would count
    ]
)
SEGMENTS_BT = np.array([[1, 1, 2], [1, 1, 0]])


def test_counts_are_the_hand_count_and_skip_padding():
    counts = router_counts([LOGITS_NE], SEGMENTS_BT, top_k=2)
    assert counts.dtype == np.int64 and counts.tolist() == [[3, 3, 2, 2]]
    assert counts.sum() == 2 * 5  # k slots per real token
    everything = router_counts([LOGITS_NE], np.ones_like(SEGMENTS_BT), top_k=2)
    assert everything.tolist() == [[4, 3, 2, 3]] and not np.array_equal(everything, counts)  # the control
    assert router_counts([LOGITS_NE], SEGMENTS_BT, top_k=1).tolist() == [[2, 1, 1, 1]]


def test_loads_sum_to_one_and_the_max_load_is_the_mean_of_the_layers_busiest():
    counts = np.array([[6, 2, 0, 0], [2, 2, 2, 2]])
    out = router_load_metrics(counts, layers=[1, 3])
    assert out["router_load/L1"].tolist() == [0.75, 0.25, 0.0, 0.0] and out["router_load/L3"].tolist() == [0.25] * 4
    assert (out["router_load_max/L1"], out["router_load_max/L3"]) == (0.75, 0.25)
    assert out["router_max_load"] == 0.5  # the mean, not the max (0.75)
    assert all(np.isclose(out[f"router_load/L{i}"].sum(), 1.0) for i in (1, 3))
    assert router_load_metrics(np.zeros((1, 4)))["router_load/L0"].tolist() == [0.0] * 4  # no real token: no NaN


def test_layer_names_are_the_moe_layers_decoder_indices():
    cfg = ModelConfig.preset("tiny-qwen3-moe", num_hidden_layers=4, mlp_only_layers=[0], decoder_sparse_step=1)
    assert moe_layers(cfg) == [1, 2, 3]
    assert moe_layers(ModelConfig.preset("tiny-mixtral")) == [0, 1]
    assert moe_layers(ModelConfig.preset("tiny")) == []


def test_a_logits_shape_that_is_not_the_tokens_is_refused():
    with pytest.raises(DataError, match=r"router_logits\[0\] has shape \(5, 4\).*N=6"):
        router_counts([LOGITS_NE[:5]], SEGMENTS_BT, top_k=2)


def _micro(counts: np.ndarray) -> dict:
    return {"loss": 0.5, "num_tokens": 3, "num_correct_tokens": 1, "entropy_sum": 2.0, COUNTS_KEY: counts}


def test_two_micro_batches_give_the_big_batchs_figures_exactly():
    rng = np.random.default_rng(0)
    logits_LNE = rng.normal(size=(2, 12, 4))
    segments_BT = np.array([[1, 1, 1, 1, 2, 2], [1, 0, 0, 0, 0, 0]])  # 7 real tokens: 6 in row 0, 1 in row 1
    big = router_counts(logits_LNE, segments_BT, top_k=2)
    parts = [
        router_counts(logits_LNE[:, rows], segments_BT[i : i + 1], 2)
        for i, rows in enumerate(np.split(np.arange(12), 2))
    ]
    step = with_means(sft_step_sums([_micro(p) for p in parts], num_tokens=7), [0, 1])
    one = with_means(sft_step_sums([_micro(big)], num_tokens=7), [0, 1])
    assert COUNTS_KEY not in step and step["router_max_load"] == one["router_max_load"]
    for i in (0, 1):
        assert np.array_equal(step[f"router_load/L{i}"], one[f"router_load/L{i}"])
    mean_of_means = np.mean([router_load_metrics(p)["router_max_load"] for p in parts])
    assert abs(mean_of_means - one["router_max_load"]) > 0.05  # the control: a mean of means is not the step's


def test_a_dense_models_step_has_no_router_metrics():
    out = with_means(sft_step_sums([{k: v for k, v in _micro(np.zeros(1)).items() if k != COUNTS_KEY}], num_tokens=3))
    assert not any(k.startswith("router") for k in out)


def test_metrics_jsonl_writes_the_loads_as_lists(tmp_path):
    sink = JsonlSink(tmp_path)
    sink.log_step({"step": 1, "loss": 1.0, **router_load_metrics(np.array([[3, 1]]))})
    sink.close()
    (line,) = read_metrics(tmp_path)
    assert line["router_load/L0"] == [0.75, 0.25] and line["router_max_load"] == 0.75
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["router_load_max/L0"] == 0.75


def test_the_terminal_line_shows_the_max_load_not_the_lists(tmp_path, caplog):
    step = {"step": 1, "loss": 2.0, "tokens_per_second": 1.0, "peak_memory_bytes": 1, **router_load_metrics(np.eye(2))}
    assert list(bar_postfix(step)) == ["loss", "router_max", "tok/s", "peak"]
    sink = TensorBoardSink(tmp_path)
    sink.log_step(step)
    sink.close()
    skipped = [r.getMessage() for r in caplog.records if "not a number" in r.getMessage()]
    assert len(skipped) == 1 and "'router_load/L0' (and the other router_load/... metrics)" in skipped[0], skipped


def _aux_records(values):
    return [{"loss": 0.0, "num_tokens": 0, "num_correct_tokens": 0, "entropy_sum": 0.0, "aux_loss": v} for v in values]


def test_the_aux_loss_is_the_mean_over_every_micro_batch_of_every_rank():
    from twinseq.common.run.step_metrics import ADDITIVE

    ranks = [_aux_records([1.0, 2.0, 3.0]), _aux_records([10.0])]  # 3 micro-batches on rank 0, 1 on rank 1
    sums = [sft_step_sums(r, num_tokens=0) for r in ranks]
    reduced = {k: sum(s[k] for s in sums) if k in ADDITIVE else sums[0][k] for k in sums[0]}  # the all-reduce
    step = with_means(reduced)
    assert step["aux_loss"] == pytest.approx(16.0 / 4, abs=1e-15)
    assert step["aux_loss"] != pytest.approx(np.mean([2.0, 10.0]))  # the mean of the ranks' means
    assert not any(k.startswith("aux_loss_") for k in step)
    assert "aux_loss" not in with_means(sft_step_sums([{k: v for k, v in r.items() if k != "aux_loss"}
                                                        for r in ranks[0]], num_tokens=0))  # fmt: skip
    assert bar_postfix({**step, "peak_memory_bytes": 1})["aux"] == "4.0000"
