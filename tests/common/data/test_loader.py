import numpy as np
import pytest

from twinseq.common.config import TrainConfig
from twinseq.common.data.sft_steps import StepIterator

ROWS = {"input_ids": [list(range(1, n + 1)) for n in [3, 7, 2, 9, 5, 4, 8, 6, 3, 2, 5]],
        "completion_mask": [[0] + [1] * (n - 1) for n in [3, 7, 2, 9, 5, 4, 8, 6, 3, 2, 5]]}


def _cfg(**kw):
    return TrainConfig.from_flat(**{"per_device_train_batch_size": 2, "gradient_accumulation_steps": 2, "max_length": 16, **kw})


def test_step_total_covers_every_micro_batch_and_rank():
    cfg = _cfg()
    ranks = [StepIterator(ROWS, cfg, pad_token_id=0, world_size=2, rank=r) for r in range(2)]
    for _ in range(5):
        steps = [it.next_step() for it in ranks]
        total = sum(b.num_label_tokens for step in steps for b in step)
        assert all(b.num_items_in_batch == total for step in steps for b in step)
        assert total > 0


def test_every_row_seen_once_per_epoch():
    cfg = _cfg(per_device_train_batch_size=1, gradient_accumulation_steps=1)
    it = StepIterator(ROWS, cfg, pad_token_id=0)
    seen = [tuple(it.next_step()[0].input_ids[0]) for _ in range(len(ROWS["input_ids"]))]
    assert sorted(seen) == sorted(tuple(r) for r in ROWS["input_ids"])


def test_resume_continues_identically():
    cfg = _cfg()
    a = StepIterator(ROWS, cfg, pad_token_id=0)
    straight = [a.next_step() for _ in range(9)]
    b = StepIterator(ROWS, cfg, pad_token_id=0)
    for _ in range(4):
        b.next_step()
    c = StepIterator(ROWS, cfg, pad_token_id=0)
    c.load_state_dict(b.state_dict())
    for want, got in zip(straight[4:], [c.next_step() for _ in range(5)]):
        for x, y in zip(want, got):
            assert np.array_equal(x.input_ids, y.input_ids) and x.num_items_in_batch == y.num_items_in_batch


def test_resume_with_other_data_is_refused():
    a = StepIterator(ROWS, _cfg(), pad_token_id=0)
    b = StepIterator({"input_ids": ROWS["input_ids"][:5]}, _cfg(), pad_token_id=0)
    with pytest.raises(ValueError, match="num_rows"):
        b.load_state_dict(a.state_dict())


def test_bad_rank_and_empty_rows():
    with pytest.raises(ValueError, match="rank=2"):
        StepIterator(ROWS, _cfg(), pad_token_id=0, world_size=2, rank=2)
    with pytest.raises(ValueError, match="empty"):
        StepIterator({"input_ids": []}, _cfg(), pad_token_id=0)
