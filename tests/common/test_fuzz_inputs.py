"""Fuzzing the loaders: any config, YAML text, data file or row set either loads, or raises one of
twinseq's own errors (``TwinseqError``) with a message; never another exception type.

Hypothesis draws values of every JSON/YAML type (and NaN, infinities, nested containers) for
random config fields, random YAML documents, random rows for the SFT and preference tokenisers,
and random bytes for ``.json``/``.jsonl`` dataset files.
"""

from __future__ import annotations

import math
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from twinseq.common.config import TrainConfig
from twinseq.common.data.prepare import load_dataset_any, tokenize_dpo, tokenize_sft
from twinseq.common.errors import TwinseqError

FIELDS = sorted(TrainConfig().to_flat_dict()) + ["model", "data", "optim", "max_stepz", "ds3_gather_for_generation"]
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6), st.floats(allow_nan=True),
                    st.text(max_size=12), st.sampled_from(["sigmoid", "tiny", "fused_linear", "bfd", "torch", "jax",
                                                           "latest", "tensorboard", "none", "", "1e-3", "no"]))
VALUES = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                       st.dictionaries(st.sampled_from(FIELDS), inner, max_size=3)),
                      max_leaves=6)
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _accepts_or_refuses(fn) -> None:
    try:
        fn()
    except TwinseqError as err:
        assert str(err).strip(), "a twinseq error must say what is wrong"


@FUZZ
@given(st.dictionaries(st.sampled_from(FIELDS), VALUES, max_size=5))
def test_config_from_any_values(values):
    _accepts_or_refuses(lambda: TrainConfig.from_dict(values))


@FUZZ
@given(st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=120))
@example("?")  # {None: None}: a key that is not a string (found by this fuzz)
@example("data: {1: 2}")
def test_config_from_any_yaml_text(text):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "c.yaml"
        path.write_text(text)
        _accepts_or_refuses(lambda: TrainConfig.from_yaml(path))


@FUZZ
@given(st.dictionaries(st.sampled_from(FIELDS), SCALARS, max_size=4).map(
    lambda d: "\n".join(f"{k}: {v!r}" if not isinstance(v, float) or math.isfinite(v) else f"{k}: .nan"
                        for k, v in d.items())))
def test_config_from_yaml_of_known_keys(text):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "c.yaml"
        path.write_text(text)
        _accepts_or_refuses(lambda: TrainConfig.from_yaml(path))


ROW_KEYS = st.sampled_from(["prompt", "completion", "text", "messages", "chosen", "rejected", "input_ids",
                            "completion_mask", "role", "content", "other"])
ROW_VALUES = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-5, 10**5), st.floats(allow_nan=False), st.text(max_size=20)),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(ROW_KEYS, inner, max_size=3)),
    max_leaves=8)
ROWS = st.lists(st.dictionaries(ROW_KEYS, ROW_VALUES, min_size=1, max_size=4), min_size=1, max_size=4)


@pytest.fixture(scope="module")
def tok():
    from twinseq.common.data.tokenizer import load_tokenizer

    return load_tokenizer("embedded")


@FUZZ
@given(rows=ROWS)
def test_sft_tokeniser_on_any_rows(tok, rows):
    _accepts_or_refuses(lambda: tokenize_sft(rows, tok, max_length=32))


@FUZZ
@given(rows=ROWS)
def test_preference_tokeniser_on_any_rows(tok, rows):
    _accepts_or_refuses(lambda: tokenize_dpo(rows, tok, max_length=32))


@FUZZ
@given(st.sampled_from([".json", ".jsonl"]), st.one_of(
    st.binary(max_size=80),
    st.lists(st.dictionaries(ROW_KEYS, ROW_VALUES, max_size=3), max_size=3).map(
        lambda rows: "\n".join(__import__("json").dumps(r) for r in rows).encode()),
    ROW_VALUES.map(lambda v: __import__("json").dumps(v).encode())))
@example(".jsonl", b'{"":[null,null]}')  # found by this test: Arrow raised its own IndexError
def test_dataset_files_with_any_bytes(suffix, content):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"data{suffix}"
        path.write_bytes(content)
        _accepts_or_refuses(lambda: load_dataset_any(str(path)))
