"""Shared fixtures of the common-layer tests.

The embedded corpus and tokenizer are built once per session into a temporary
``TWINSEQ_CACHE`` (a few seconds), so the tests never read or write the user's cache.
"""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session", autouse=True)
def twinseq_cache(tmp_path_factory):
    """A fresh ``TWINSEQ_CACHE`` for the whole session (subprocesses inherit it)."""
    mp = pytest.MonkeyPatch()
    cache = tmp_path_factory.mktemp("twinseq_cache")
    mp.setenv("TWINSEQ_CACHE", str(cache))
    yield cache
    mp.undo()


@pytest.fixture(scope="session")
def embedded_tokenizer(twinseq_cache):
    from twinseq.common.data.tokenizer import load_tokenizer

    return load_tokenizer("embedded")


@pytest.fixture(scope="session")
def embedded_sft(twinseq_cache):
    from twinseq.common.data.corpus import load_embedded

    return load_embedded("embedded-sft")


@pytest.fixture(scope="session")
def embedded_preference(twinseq_cache):
    from twinseq.common.data.corpus import load_embedded

    return load_embedded("embedded-preference")
