"""Training checkpoints (common/run/checkpoint.py): safetensors + JSON, atomic, rotated, found by 'latest'."""

from __future__ import annotations

import json

import numpy as np
import pytest

from twinseq.common.run.checkpoint import (checkpoint_dir, flatten_state, list_checkpoints, load_training_checkpoint,
                                       read_meta, resolve_resume, rotate_checkpoints, save_training_checkpoint,
                                       unflatten_state)
from twinseq.common.errors import CheckpointError

STATE = {"model": {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.float32(0.5)},
         "optimizer": {"state": {"0": {"step": np.array(3.0, np.float32), "exp_avg": np.ones(4)}},
                       "param_groups": [{"lr": 1e-3, "betas": [0.9, 0.999], "params": ["w", "b"], "foreach": None}]},
         "rng": {"torch": np.arange(8, dtype=np.uint8)}, "steps_done": 7}


def _assert_same(a, b):
    if isinstance(a, np.ndarray) or isinstance(a, np.generic):
        assert isinstance(b, np.ndarray) and a.dtype == b.dtype and np.shape(a) == b.shape
        assert np.array_equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_same(x, y)
    else:
        assert a == b


def test_state_round_trips_exactly_with_shapes_dtypes_and_json_values(tmp_path):
    arrays, skeleton = flatten_state(STATE)
    assert arrays["model/b"].shape == () and arrays["optimizer/state/0/step"].shape == ()
    json.dumps(skeleton)  # everything that is not an array is JSON
    _assert_same(STATE, unflatten_state(skeleton, arrays))
    path = save_training_checkpoint(tmp_path, 7, STATE, {"data": {"position": 3}, "config": {}})
    assert path == checkpoint_dir(tmp_path, 7) and sorted(p.name for p in path.iterdir()) == [
        "trainer_state.json", "training_state.safetensors"]
    meta, state = load_training_checkpoint(path)
    assert (meta["step"], meta["data"]) == (7, {"position": 3})
    _assert_same(STATE, state)


def test_only_json_and_arrays_are_accepted():
    with pytest.raises(TypeError, match="optimizer/fn"):
        flatten_state({"optimizer": {"fn": print}})
    with pytest.raises(TypeError, match="without '/'"):
        flatten_state({"a/b": 1})


def test_latest_takes_the_newest_complete_checkpoint_and_rotation_keeps_n(tmp_path):
    assert resolve_resume("latest", tmp_path) is None  # a first run starts fresh
    for step in (2, 10, 4):
        save_training_checkpoint(tmp_path, step, STATE, {"data": {}, "config": {}})
    (tmp_path / ".tmp-checkpoint-12-999").mkdir()  # a save that was killed
    broken = checkpoint_dir(tmp_path, 11)
    broken.mkdir()
    (broken / "trainer_state.json").write_text('{"complete": fals')  # a folder another tool left half-written
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint-2", "checkpoint-4", "checkpoint-10",
                                                           "checkpoint-11"]
    assert resolve_resume("latest", tmp_path) == checkpoint_dir(tmp_path, 10)
    assert resolve_resume("auto", tmp_path) == checkpoint_dir(tmp_path, 10)
    deleted = rotate_checkpoints(tmp_path, keep=2)
    assert {p.name for p in deleted} == {".tmp-checkpoint-12-999", "checkpoint-2", "checkpoint-4"}
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint-10", "checkpoint-11"]


def test_a_save_replaces_an_older_checkpoint_of_the_same_step_atomically(tmp_path):
    save_training_checkpoint(tmp_path, 3, {"x": np.zeros(2)}, {"data": {}, "config": {}})
    save_training_checkpoint(tmp_path, 3, {"x": np.ones(2)}, {"data": {}, "config": {}})
    assert np.array_equal(load_training_checkpoint(checkpoint_dir(tmp_path, 3))[1]["x"], np.ones(2))
    assert not list(tmp_path.glob(".tmp-*"))


@pytest.mark.parametrize("damage, fragment", [
    (lambda p: (p / "trainer_state.json").unlink(), "holds no trainer_state.json"),
    (lambda p: (p / "trainer_state.json").write_text("{"), "is corrupt"),
    (lambda p: (p / "trainer_state.json").write_text(json.dumps({"complete": False})), "incomplete"),
    (lambda p: (p / "trainer_state.json").write_text(json.dumps({"complete": True, "format_version": 0})),
     "format_version=0"),
    (lambda p: (p / "training_state.safetensors").write_bytes(b"\x00" * 5), "cannot be read"),
])
def test_damaged_checkpoints_name_the_file(tmp_path, damage, fragment):
    path = save_training_checkpoint(tmp_path, 1, STATE, {"data": {}, "config": {}})
    damage(path)
    with pytest.raises(CheckpointError, match=fragment):
        load_training_checkpoint(path)


def test_resume_from_a_path_that_is_not_a_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match="is not a directory"):
        read_meta(tmp_path / "nope")
