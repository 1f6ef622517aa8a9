import pytest

from ferry.cli import main

from ferry.backends.cpu import CpuBackend


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


_CHILDREN: list = []  # (process, log) started for a waiting test


@pytest.hookimpl(trylast=True)  # after -k / -m have deselected
def pytest_collection_modifyitems(config, items):
    """The interpreted GPU tests' child (tests/test_kernels_interpreted.py) starts now when its test is selected,
    so that its minutes on one core pass beside the rest of the suite; its test runs last and waits for it."""
    waiting = [i for i in items if i.module.__name__.endswith("test_kernels_interpreted")]
    if waiting:
        items[:] = [i for i in items if i not in waiting] + waiting
        module = waiting[0].module
        config.stash[module.CHILD] = module.start()
        _CHILDREN.append(config.stash[module.CHILD])


def pytest_unconfigure(config):
    """A session that ends before the waiting test (-x, Ctrl-C) leaves no child behind."""
    for child, log in _CHILDREN:
        if child.poll() is None:
            child.kill()
            child.wait()
        log.unlink(missing_ok=True)
