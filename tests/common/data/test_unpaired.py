"""Unpaired preference data (KTO, ``common.data.unpaired``): formats, unpairing, the mismatched (KL) completions,
the micro-batch layout and the step iterator.

Invariants:
- unpairing loses and duplicates nothing: each pair gives its chosen row (True) and its rejected row (False), in
  TRL's order (per block of pairs, the chosen rows, then the rejected ones);
- the KL completions of a block are a rotation of its completions: a permutation, and no row keeps its own when
  the block has two rows or more;
- a ``KTOBatch`` scores exactly each completion's tokens, the same in padded and padding-free form, and a KL
  sequence never passes ``max_length``;
- an epoch of the step iterator yields every row once;
- bad labels and missing columns are refused naming the field; empty completions are dropped and counted.
"""

from __future__ import annotations

import numpy as np
import pytest
from datasets import Dataset

from twinseq.common.config import TrainConfig
from twinseq.common.data.batching import IGNORE_INDEX
from twinseq.common.data.tokenizer import load_tokenizer
from twinseq.common.data.unpaired import (
    KL_FIELD,
    KTOStepIterator,
    add_kl_completions,
    collate_unpaired,
    tokenize_kto,
    unpair_rows,
)
from twinseq.common.errors import DataError


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("embedded")


def _paired(n: int) -> dict[str, list]:
    return {
        "prompt_input_ids": [[1, 100 + i] for i in range(n)],
        "chosen_input_ids": [[200 + i, 2] for i in range(n)],
        "rejected_input_ids": [[300 + i, 301 + i, 2] for i in range(n)],
    }


def test_unpairing_keeps_every_completion_once_in_trls_order(monkeypatch):
    import twinseq.common.data.unpaired as unpaired

    monkeypatch.setattr(unpaired, "CHUNK_ROWS", 3)  # blocks of 3 pairs, to see the order repeat
    out = unpair_rows(_paired(5))
    firsts = [c[0] for c in out["completion_input_ids"]]
    assert firsts == [200, 201, 202, 300, 301, 302, 203, 204, 303, 304]
    assert out["label"] == [True] * 3 + [False] * 3 + [True] * 2 + [False] * 2
    for prompt, completion in zip(out["prompt_input_ids"], out["completion_input_ids"]):
        assert prompt[1] - 100 == completion[0] % 100  # each completion keeps its own prompt
    paired = _paired(5)
    assert sorted(map(tuple, out["completion_input_ids"])) == sorted(
        map(tuple, paired["chosen_input_ids"] + paired["rejected_input_ids"])
    )


@pytest.mark.parametrize("n, block", [(10, 4), (7, 7), (5, 1), (6, 2)])
def test_kl_completions_rotate_within_each_block(n, block):
    columns = {"completion_input_ids": [[i] for i in range(n)]}
    kl = add_kl_completions(columns, block)[KL_FIELD]
    for start in range(0, n, block):
        own = [c[0] for c in columns["completion_input_ids"][start : start + block]]
        theirs = [c[0] for c in kl[start : start + block]]
        assert sorted(theirs) == own  # a permutation of the block
        assert theirs == own[-1:] + own[:-1]  # TRL's rotation: row i takes row i - 1's
        if len(own) > 1:
            assert all(a != b for a, b in zip(own, theirs))


def _examples():
    return [
        {"prompt_input_ids": [1, 5, 6], "completion_input_ids": [7, 8, 2], "label": True, KL_FIELD: [9, 2]},
        {"prompt_input_ids": [1, 9], "completion_input_ids": [9, 2], "label": False, KL_FIELD: [7, 8, 2]},
        {"prompt_input_ids": [1], "completion_input_ids": [4, 4, 4, 2], "label": True, KL_FIELD: [9, 2]},
    ]


@pytest.mark.parametrize("with_kl", [True, False])
def test_a_kto_batch_scores_each_completion_the_same_padded_or_padding_free(with_kl):
    padded = collate_unpaired(_examples(), with_kl=with_kl)
    free = collate_unpaired(_examples(), with_kl=with_kl, padding_free=True)
    n = 3
    assert padded.num_docs == free.num_docs == (2 * n if with_kl else n)
    assert padded.labels.tolist() == [True, False, True]
    want = [3, 2, 4] + ([2, 3, 2] if with_kl else [])
    assert padded.num_target_tokens.tolist() == free.num_target_tokens.tolist() == want
    for kb in (padded, free):  # the scored tokens of each document are its completion, in order
        labels = kb.batch.labels.reshape(-1)
        docs = np.roll(kb.target_doc_ids.reshape(-1), 1)  # target of position t is labels[t + 1]
        scored = [labels[(docs == d) & (labels != IGNORE_INDEX)].tolist() for d in range(kb.num_docs)]
        assert scored[:n] == [ex["completion_input_ids"] for ex in _examples()]
        if with_kl:
            assert scored[n:] == [ex[KL_FIELD] for ex in _examples()]


def test_a_kl_sequence_is_cut_to_max_length():
    kb = collate_unpaired(_examples(), with_kl=True, max_length=4)
    # row 1: prompt [1, 9] + KL completion [7, 8, 2] is 5 tokens: cut to [7, 8]
    assert kb.num_target_tokens.tolist()[3:] == [1, 2, 2]


def test_an_epoch_yields_every_row_once():
    n = 13
    rows = {
        "prompt_input_ids": [[1, 50 + i] for i in range(n)],
        "completion_input_ids": [[100 + i, 2] for i in range(n)],
        "label": [i % 3 == 0 for i in range(n)],
    }
    rows = add_kl_completions(rows, 2)
    cfg = TrainConfig.from_flat(task="kto", per_device_train_batch_size=2, gradient_accumulation_steps=2)
    it = KTOStepIterator(rows, cfg, pad_token_id=0, with_kl=True)
    seen = []
    for _ in range(it.steps_per_epoch):
        for kb in it.next_step():
            ids = kb.batch.input_ids.reshape(-1).tolist()
            seen += [i for i in ids if 100 <= i < 100 + n][: kb.num_examples]
            assert kb.num_examples_in_step <= 4
    assert sorted(seen) == list(range(100, 100 + n))


def test_unpaired_strings_tokenise_with_bos_and_eos_and_drop_empty_completions(tok):
    ds = Dataset.from_dict(
        {
            "prompt": ["The sky is", "Water is", "Fire is"],
            "completion": [" blue.", "   ", " hot."],
            "label": [True, False, False],
        }
    )
    columns, stats = tokenize_kto(ds, tok)
    assert columns["label"] == [True, False]
    assert stats.examples_dropped == 1
    assert columns["prompt_input_ids"][0][0] == tok.bos_token_id
    assert columns["completion_input_ids"][0][-1] == tok.eos_token_id
    assert tok.decode(columns["completion_input_ids"][1][:-1]) == " hot."


def test_conversational_unpaired_rows_render_with_the_chat_template(tok):
    ds = Dataset.from_dict(
        {
            "prompt": [[{"role": "user", "content": "Colour of the sky?"}]],
            "completion": [[{"role": "assistant", "content": "Blue."}]],
            "label": [True],
        }
    )
    columns, _ = tokenize_kto(ds, tok)
    assert "Blue." in tok.decode(columns["completion_input_ids"][0])
    assert "Colour of the sky?" in tok.decode(columns["prompt_input_ids"][0])


def test_paired_data_is_unpaired(tok):
    ds = Dataset.from_dict({"prompt": ["A", "B"], "chosen": [" yes", " up"], "rejected": [" no", " down"]})
    columns, _ = tokenize_kto(ds, tok)
    assert columns["label"] == [True, True, False, False]
    assert [tok.decode(c[:-1]) for c in columns["completion_input_ids"]] == [" yes", " up", " no", " down"]


@pytest.mark.parametrize(
    "data, needle",
    [
        ({"prompt": ["a"], "completion": ["b"], "label": [1]}, "label=1 (int) must be a bool"),
        ({"prompt": ["a"], "completion": ["b"]}, "lacks ['label']"),
        ({"prompt": ["a"], "label": [True]}, "lacks ['completion']"),
    ],
)
def test_bad_unpaired_data_is_refused_naming_the_field(tok, data, needle):
    with pytest.raises(
        DataError, match=needle.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(").replace(")", r"\)")
    ):
        tokenize_kto(Dataset.from_dict(data), tok)


def test_a_mismatched_pair_is_cut_for_its_own_prompt(tok):
    """TRL rotates the completions before its collator cuts prompt + completion to max_length: row i's KL sequence
    is (prompt_i + completion_{i-1})[:max_length], whatever prompt_{i-1}'s length cut completion_{i-1} to."""
    long_prompt, short_prompt = "word " * 12, "hi"
    ds = Dataset.from_dict(
        {"prompt": [long_prompt, short_prompt], "completion": [" one two three four five six", " seven eight"],
         "label": [True, False]}
    )
    max_length = 16
    columns, _ = tokenize_kto(ds, tok, max_length=max_length)
    full = tokenize_kto(ds, tok)[0]["completion_input_ids"]
    assert len(columns["completion_input_ids"][0]) < len(full[0])  # row 0's own completion was cut for its prompt
    with_kl = add_kl_completions(columns, 2)
    assert "uncut_completion_input_ids" not in with_kl  # read for the rotation, then dropped
    kb = collate_unpaired([dict(zip(with_kl, values)) for values in zip(*with_kl.values())], with_kl=True,
                          max_length=max_length)
    prompt_1 = columns["prompt_input_ids"][1]
    want = (prompt_1 + full[0])[:max_length][len(prompt_1):]  # row 1 takes row 0's completion, cut for prompt_1
    assert kb.num_target_tokens[3] == len(want) > len(columns["completion_input_ids"][0])
