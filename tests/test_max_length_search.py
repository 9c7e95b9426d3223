"""benchmarks/max_length.py's search: the length it reports fits, and the failure it stopped at is close above."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from max_length import parse_bytes, r_squared, search  # noqa: E402


@pytest.mark.parametrize("wall", [100, 300, 1024, 1500, 5000, 70000])
@pytest.mark.parametrize("start", [512, 1024, 4096])
def test_search_finds_the_wall_within_its_resolution(wall, start):
    seen = []

    def probe(length):
        seen.append(length)
        return {"peak_bytes": length, "seconds": 0.0}

    got = search(probe, wall, start=start, limit=1 << 20, resolution=0.1, max_seconds=60, log=lambda s: None)
    assert len(seen) == len(set(seen)), seen  # no length probed twice
    assert got["bound"] == "memory"
    if got["max_length"]:
        assert got["max_length"] <= wall
        failed = min(p for p in seen if p > wall)
        assert failed / got["max_length"] <= 1.1 or failed - got["max_length"] <= 64
    else:
        assert wall < 128


@pytest.mark.parametrize("wall", [700_000, 800_000, 2_000_000])
def test_a_limit_between_doublings_is_probed_itself(wall):
    """start 262,144, limit 786,432 (3 x 2^18): doubling reaches 524,288, then probes 786,432, not stops below it."""
    seen = []

    def probe(length):
        seen.append(length)
        return {"peak_bytes": length, "seconds": 0.0}

    got = search(probe, wall, start=262_144, limit=786_432, resolution=0.1, max_seconds=60, log=lambda s: None)
    assert max(seen) == 786_432 and len(seen) == len(set(seen)), seen
    if wall >= 786_432:
        assert (got["max_length"], got["bound"]) == (786_432, "limit")
    else:
        assert got["bound"] == "memory" and 524_288 < got["max_length"] <= wall
        assert 786_432 / got["max_length"] > 1 and min(p for p in seen if p > wall) / got["max_length"] <= 1.1


def test_a_slow_probe_ends_the_search_as_compute_bound():
    got = search(lambda t: {"peak_bytes": 0, "seconds": t / 1000}, 1 << 30, start=1024, limit=1 << 20,
                 resolution=0.1, max_seconds=5, log=lambda s: None)
    assert (got["max_length"], got["bound"]) == (8192, "compute")


def test_a_failing_probe_does_not_fit():
    def probe(length):
        if length > 3000:
            raise MemoryError("killed")
        return {"peak_bytes": 1, "seconds": 0.0}

    got = search(probe, 1 << 30, start=1024, limit=1 << 20, resolution=0.05, max_seconds=60, log=lambda s: None)
    assert 3000 - 64 <= got["max_length"] <= 3000 and got["bound"] == "memory"


def test_sizes_and_fit():
    assert parse_bytes("512MiB") == 512 << 20 and parse_bytes("8GiB") == 8 << 30
    assert r_squared([1, 2, 3], [1, 2, 3.0]) == pytest.approx(1.0)
    assert r_squared([1, 2, 3, 4], [1, 4, 9, 16]) < 0.99
