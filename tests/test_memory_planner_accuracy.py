"""The memory plan against real ``twinseq train`` runs, and the budget advice applied for real.

Measured the way ``benchmarks/memory_planner_check.py`` measures (its harness, ``_train_peak.measure``):
torch on CPU by peak RSS over the training steps above the RSS before the model is built, jax by the compiled
step's ``memory_analysis()``. The shapes (``tiny``, 8 packed rows x 512 tokens) make the modelled memory
hundreds of MiB, so allocator noise stays small. The full table (both backends, every knob) is the benchmark's.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))

from memory_planner_check import BASE, STATE_RUNGS, TOLERANCE, check_one  # noqa: E402

from twinseq.common.config import TrainConfig  # noqa: E402
from twinseq.common.run.memory_plan import advise, format_bytes, parse_bytes, plan_memory  # noqa: E402

pytestmark = pytest.mark.slow
MIB = 2 ** 20


def _summary(r: dict) -> str:
    return (f"planned {r['planned'] / MIB:.1f} MiB, measured {r['measured'] / MIB:.1f} MiB "
            f"({100 * r['error']:+.1f}%), plan:\n" + "\n".join(f"  {row['component']}: {row['bytes'] / MIB:.1f} MiB"
                                                             for row in r["plan"]["rows"]))


def test_jax_plan_is_within_tolerance_of_the_compiled_step():
    pytest.importorskip("jax")
    r = check_one(dict(BASE, backend="jax", loss_type="fused_linear", gradient_checkpointing=True))
    assert abs(r["error"]) <= TOLERANCE, _summary(r)


def test_bfloat16_8bit_state_plan_is_within_tolerance_on_cpu():
    """The bfloat16 weights + 8-bit moments rung (issue 28) on CPU: bfloat16 activations, the update's float32
    temporaries, the oneDNN kernel cache and the heap backward leaves (memory_plan's rows), against the real peak.
    The float32-state plan of the same run is far above that peak (the negative control: a plan that ignored the
    optimizer would pass no better)."""
    pytest.importorskip("torch")
    values = STATE_RUNGS["torch-small-bf16-8bit"]
    r = check_one(values)
    assert abs(r["error"]) <= TOLERANCE, _summary(r)
    f32 = plan_memory(TrainConfig.from_flat(**{**values, "optimizer": "adamw_torch"})).total
    assert (f32 - r["measured"]) / r["measured"] > TOLERANCE, f"{f32 / MIB:.1f} MiB\n" + _summary(r)


def test_advice_applied_fits_the_budget_for_real():
    """A run whose measured peak exceeds the budget; the advisor's flags, applied, run under it (and the plan is
    within tolerance of both measurements)."""
    pytest.importorskip("torch")
    values = dict(BASE, backend="torch", loss_type="nll")
    budget = parse_bytes("200MiB")
    before = check_one(values)
    assert before["measured"] > budget, _summary(before)
    assert abs(before["error"]) <= TOLERANCE, _summary(before)

    advice = advise(TrainConfig.from_flat(**values), budget)
    assert advice.plan.total <= budget and advice.flags, advice.text()
    after = check_one({**values, **advice.changes})
    assert after["measured"] <= budget, f"advice {advice.flags} measured {format_bytes(after['measured'])}\n" \
                                        + _summary(after)
    assert abs(after["error"]) <= TOLERANCE, _summary(after)
    assert plan_memory(TrainConfig.from_flat(**values)).total > budget
