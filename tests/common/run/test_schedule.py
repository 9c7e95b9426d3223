import math

import pytest

from twinseq.common.run.schedule import lr_multiplier


@pytest.mark.parametrize("kind", ["constant", "linear", "cosine"])
def test_warmup_is_linear_from_zero_and_peak_is_one(kind):
    vals = [lr_multiplier(k, warmup_steps=4, max_steps=20, scheduler=kind) for k in range(20)]
    assert vals[:5] == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert all(0.0 <= v <= 1.0 for v in vals)


def test_cosine_matches_closed_form():
    for k in range(3, 13):
        expected = 0.5 * (1 + math.cos(math.pi * (k - 3) / 9))
        assert lr_multiplier(k, warmup_steps=3, max_steps=12, scheduler="cosine") == pytest.approx(expected)


def test_unknown_scheduler():
    with pytest.raises(ValueError, match="lr_scheduler_type='step'"):
        lr_multiplier(0, warmup_steps=0, max_steps=1, scheduler="step")
