import pytest

from ferry.ops.cpu import CpuBackend


@pytest.fixture(scope="session")
def backend() -> CpuBackend:
    return CpuBackend(2)
