"""The embedded stdlib-docstring datasets: size, shape, determinism, cache."""

from __future__ import annotations

import logging
import re
from collections import Counter

import numpy as np
import pytest

from twinseq.common.data import corpus


@pytest.fixture(scope="module")
def records(twinseq_cache):
    return corpus.collect_docstrings()


def test_collection_is_sorted_unique_and_sized(records):
    assert 3000 <= len(records) <= 6000
    names = [(r.name, r.kind) for r in records]
    assert names == sorted(names)
    docs = [r.doc for r in records]
    assert len(set(docs)) == len(docs)
    assert min(len(d) for d in docs) >= corpus.MIN_DOC_CHARS
    assert {r.kind for r in records} == {"module", "class", "function", "method", "property"}


def test_no_process_specific_text(records):
    # a memory address or a local path in the text would break determinism across machines
    for r in records:
        assert not re.search(r" at 0x[0-9a-f]+", r.doc + r.params), r.name


def test_collection_ignores_monkeypatched_stdlib(records, monkeypatch):
    """Libraries patch the stdlib (transformers adds Logger.warning_once); the text must not change."""

    def warning_once(self, *args):
        """Patched in by a third-party library."""

    monkeypatch.setattr(logging.Logger, "warning_once", warning_once, raising=False)
    corpus.collect_docstrings.cache_clear()
    try:
        again = corpus.collect_docstrings()
    finally:
        corpus.collect_docstrings.cache_clear()
    assert corpus.content_hash(again) == corpus.content_hash(records)
    assert not any(r.name.endswith("warning_once") for r in again)


def test_lengths_are_skewed(records):
    chars = np.array([len(r.doc) for r in records])
    p50, p99 = np.percentile(chars, [50, 99])
    assert p99 > 10 * p50  # many short docstrings, a long tail


@pytest.mark.parametrize("name,columns", [
    ("embedded", ["prompt", "completion"]),
    ("embedded-sft", ["prompt", "completion"]),
    ("embedded-messages", ["messages"]),
    ("embedded-preference", ["prompt", "chosen", "rejected"]),
    ("embedded-text", ["text"]),
])
def test_load_embedded_columns(name, columns, records):
    ds = corpus.load_embedded(name)
    assert ds.column_names == columns
    assert len(ds) == len(records)


def test_datasets_agree_row_by_row(embedded_sft, embedded_preference):
    messages = corpus.load_embedded("embedded-messages")
    for i in range(0, len(embedded_sft), 97):
        sft, pref, conv = embedded_sft[i], embedded_preference[i], messages[i]["messages"]
        assert pref["prompt"] == sft["prompt"] and pref["chosen"] == sft["completion"]
        assert [m["role"] for m in conv] == ["user", "assistant"]
        assert conv[0]["content"] == sft["prompt"].rstrip("\n")
        assert conv[1]["content"] == sft["completion"]


def test_prompts_name_the_object_and_use_every_template(embedded_sft, records):
    names = {r.name for r in records}
    used = Counter()
    for prompt in embedded_sft["prompt"]:
        quoted = re.findall(r"`([^`(]+)", prompt)
        assert quoted and quoted[0] in names, prompt
        used[next(i for i, t in enumerate(corpus.PROMPT_TEMPLATES)
                  if prompt.startswith(t.split("{")[0]))] += 1
    assert set(used) == set(range(len(corpus.PROMPT_TEMPLATES)))


def test_rejected_is_a_reordering_of_chosen(embedded_preference):
    for row in embedded_preference.select(range(0, len(embedded_preference), 13)):
        assert row["rejected"] != row["chosen"]
        words = row["chosen"].split()
        if len(words) >= 2:
            assert sorted(row["rejected"].split()) == sorted(words)


def test_corrupt_docstring_is_seeded():
    doc = "Return the sum of a and b, or raise TypeError."
    a = corpus.corrupt_docstring(doc, np.random.default_rng(3))
    b = corpus.corrupt_docstring(doc, np.random.default_rng(3))
    assert a == b != doc
    assert corpus.corrupt_docstring("single", np.random.default_rng(0)) != "single"


def test_build_rows_is_deterministic(records):
    assert corpus.build_rows(records[:300]) == corpus.build_rows(records[:300])


def test_cache_folder_is_keyed_and_reused(records, twinseq_cache):
    folder = corpus.embedded_dir(records)
    assert folder.parent == twinseq_cache
    assert folder.name == f"embedded-{corpus.python_tag()}-{corpus.content_hash(records)}"
    stamps = {p.name: p.stat().st_mtime_ns for p in folder.glob("*.parquet")}
    assert len(stamps) == 4
    corpus.embedded_dir(records)
    assert {p.name: p.stat().st_mtime_ns for p in folder.glob("*.parquet")} == stamps


def test_unknown_embedded_name():
    with pytest.raises(ValueError, match="embedded-sft"):
        corpus.load_embedded("embedded-foo")
