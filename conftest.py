"""Root pytest configuration: environment that must be set before any framework is imported."""

import os

# JAX on 8 host CPU devices for the multi_device tests; harmless for everything else. The GPU lane
# (benchmarks/gpu/run_all.sh) sets JAX_PLATFORMS="" so that JAX picks its GPU there, and keeps JAX from
# preallocating most of the GPU's memory, which torch shares in the same process.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Without an NVIDIA device, twinseq's Triton kernel (loss_type='triton') is tested under Triton's CPU interpreter,
# which must be chosen before triton is first imported; a GPU machine compiles the kernels instead.
if not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if gpu_items and not _cuda_available():
        skip = pytest.mark.skip(reason="needs a CUDA GPU (none on this machine)")
        for item in gpu_items:
            item.add_marker(skip)


@pytest.fixture(autouse=True, scope="module")
def _release_jax_executables():
    """After each test module, drop JAX's compiled executables (``jax.clear_caches``): a python that runs thousands
    of tests otherwise keeps every compilation resident, and XLA's CPU compiler has crashed (SIGSEGV) late in such
    runs. A module still compiles each function once; only across modules is a shape compiled again."""
    yield
    import sys

    jax = sys.modules.get("jax")
    if jax is not None:
        jax.clear_caches()
