import pytest

from ferry.cli import main

from ferry.ops.cpu import CpuBackend


@pytest.fixture(scope="session")
def backend() -> CpuBackend:
    return CpuBackend(2)


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """A qwen3-moe-tiny synthetic GGUF (a few MB), written once through the `ferry synth` command."""
    path = tmp_path_factory.mktemp("synth") / "tiny.gguf"
    assert main(["synth", "qwen3-moe-tiny", "-o", str(path), "-q"]) == 0
    return path


@pytest.fixture(scope="session")
def llamacpp_tree():
    """llama.cpp's tree from the llama-cpp-python sdist (benchmarks/llamacpp.py converter): its converter,
    vocabulary test files and chat templates."""
    from benchmarks.llamacpp import converter

    return converter()
