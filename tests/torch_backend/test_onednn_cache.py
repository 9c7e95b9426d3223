"""``twinseq.torch_backend`` caps oneDNN's and ideep's kernel caches on import (memory_plan's
``ONEDNN_CACHE_CAPACITY``), and a user's own setting wins.

A fresh subprocess: the variables are read when the first bfloat16 kernel is built, so only what a new process sees
says whether the cap is in place before that.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from twinseq.common.run.memory_plan import ONEDNN_CACHE_CAPACITY

VARS = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")
CHILD = f"""
import json, os
import torch
seen = {{"after torch": {{v: os.environ.get(v) for v in {VARS!r}}}}}
import twinseq.torch_backend
seen["after twinseq"] = {{v: os.environ.get(v) for v in {VARS!r}}}
print(json.dumps(seen))
"""


@pytest.mark.slow  # a fresh interpreter imports torch and transformers: 7 s of CPU, 22 s on 2 loaded cores
def test_import_caps_both_kernel_caches_and_keeps_a_users_own_value():
    """The user sets ideep's cache to 5 and leaves oneDNN's unset: after ``import twinseq.torch_backend`` oneDNN's is
    the cap and ideep's is still 5. Negative control: ``import torch`` alone sets neither (the import under test
    does)."""
    env = {k: v for k, v in os.environ.items() if k not in VARS}
    env["LRU_CACHE_CAPACITY"] = "5"
    proc = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["after torch"] == {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": None, "LRU_CACHE_CAPACITY": "5"}, seen
    assert seen["after twinseq"] == {
        "ONEDNN_PRIMITIVE_CACHE_CAPACITY": str(ONEDNN_CACHE_CAPACITY),
        "LRU_CACHE_CAPACITY": "5",
    }, seen
    assert ONEDNN_CACHE_CAPACITY != 5  # else "kept" and "set" could not be told apart
