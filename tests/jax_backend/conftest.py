"""Fixtures of the jax backend's tests."""

import pytest


@pytest.fixture(scope="module")
def highest_precision():
    """float32 matmuls at full precision for a module (``pytestmark = pytest.mark.usefixtures(...)``), restored
    after: the comparisons there are held to float32 bounds, which a reduced-precision default would break."""
    jax = pytest.importorskip("jax")
    saved = jax.config.jax_default_matmul_precision
    jax.config.update("jax_default_matmul_precision", "highest")
    yield
    jax.config.update("jax_default_matmul_precision", saved)
