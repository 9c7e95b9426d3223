"""The locked install: what `make setup` installed is what requirements/cpu.lock says, package for package."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LOCK = ROOT / "requirements" / "cpu.lock"
CHECK = ROOT / "requirements" / "check_lock.py"


def test_the_lock_pins_every_line_and_covers_the_stack():
    sys.path.insert(0, str(CHECK.parent))
    try:
        import check_lock
    finally:
        sys.path.pop(0)
    pins = check_lock.pins(LOCK)
    for name in ("torch", "transformers", "datasets", "peft", "deepspeed", "jax", "flax", "trl", "triton"):
        assert name in pins, f"{name} is not in {LOCK.name}"
    assert pins["torch"].startswith("2.13.0")


@pytest.mark.skipif(Path(sys.prefix).resolve() != (ROOT / ".venv").resolve(),
                    reason="runs in the project's .venv (make setup / make test), where the lock was installed")
def test_make_setup_installed_exactly_the_lock():
    proc = subprocess.run([sys.executable, str(CHECK), str(LOCK)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
