"""The layout holds (docs/decisions.md, "Layout"): every module imports alone in a fresh interpreter, no two of ferry's
modules import each other (directly or around a circle), every backend offers its protocol, and nothing outside
backends/ tells backends apart by class or name."""

import ast
import concurrent.futures
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ferry.backends.base import Backend, GpuBackend
from ferry.backends.cpu import CpuBackend
from ferry.backends.cuda import CudaBackend
from ferry.backends.hybrid import HybridBackend
from ferry.backends.multi_gpu import MultiGpuBackend
from ferry.runtime.runners.base import Runner
from ferry.runtime.runners.cuda_graphs import CudaGraphRunner
from ferry.runtime.runners.eager import EagerRunner
from ferry.runtime.runners.ggml_graph import GgmlGraphRunner
from ferry.runtime.runners.multi_gpu import MultiGpuRunner

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "ferry"


def _modules() -> dict[str, Path]:
    """ferry's modules by dotted name (packages by their __init__)."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def test_every_module_imports_alone_in_a_fresh_interpreter():
    names = [n for n in _modules() if n != "ferry.__main__"]  # the entry point runs the command line
    assert len(names) > 60

    def alone(name: str) -> tuple[str, int, str]:
        r = subprocess.run([sys.executable, "-c", f"import {name}"], capture_output=True, text=True, cwd=ROOT,
                           timeout=300)
        return name, r.returncode, r.stderr[-2000:]

    with concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 2) as pool:
        failed = [(n, err) for n, rc, err in pool.map(alone, names) if rc != 0]
    assert not failed, failed[0]


def _imports(path: Path, name: str, modules: set[str]) -> set[str]:
    """The ferry modules `path` imports, at its top or inside functions alike."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + ([base] if base else []))
            # `from ferry.kernels.cpu import native` imports the module ferry.kernels.cpu.native
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        found |= {t for t in targets if t in modules and t != name}
    return found


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of two or more nodes (Tarjan's algorithm): each holds a circle."""
    # Tarjan's strongly connected components: any of two or more modules is a circle
    index, low, stack, on, circles, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    sys.setrecursionlimit(10000)
    for v in graph:
        if v not in index:
            visit(v)
    return circles


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(path, name, set(modules)) for name, path in modules.items()}


def test_no_circle_among_ferry_modules():
    graph = _graph()
    assert "ferry.runtime.loader" in graph["ferry.cli"]  # the graph sees function-level imports
    assert not _circles(graph)


def test_the_packages_import_one_way():
    """Data flows one way (STYLE.md): file -> model -> placement -> layers -> backends -> kernels, the runtime and
    tools above them; between ferry's subpackages no circle either."""
    def package(name: str) -> str:
        parts = name.split(".")
        return parts[1] if len(parts) > 2 else name

    packages: dict[str, set[str]] = {}
    for a, bs in _graph().items():
        packages.setdefault(package(a), set()).update(package(b) for b in bs if package(b) != package(a))
    for p in list(packages.values()):
        for b in p:
            packages.setdefault(b, set())
    assert "backends" in packages["runtime"] and "kernels" in packages["backends"]
    assert not _circles(packages)


def _members(protocol) -> set[str]:
    """The attributes and methods a Protocol class declares itself (its bases' too)."""
    names = set()
    for cls in protocol.__mro__:
        if cls in (object,) or not getattr(cls, "_is_protocol", False) or cls.__name__ == "Protocol":
            continue
        names |= set(getattr(cls, "__annotations__", {}))
        names |= {n for n, v in vars(cls).items() if not n.startswith("_") and (callable(v) or isinstance(v, property))}
    return names


def _offers(cls, name: str) -> bool:
    """A class attribute, method or property, or an attribute __init__ (or its class's code) assigns."""
    return hasattr(cls, name) or re.search(rf"self\.{name}\s*(:[^=]*)?=", inspect.getsource(cls)) is not None


@pytest.mark.parametrize("cls, protocol", [(CpuBackend, Backend), (CudaBackend, GpuBackend), (HybridBackend, GpuBackend),
                                           (MultiGpuBackend, Backend)], ids=lambda x: x.__name__)
def test_every_backend_offers_its_protocol(cls, protocol):
    members = _members(protocol)
    assert {"kv_devices", "prepare", "describe", "notes", "label", "n_threads"} <= members
    missing = sorted(m for m in members if not _offers(cls, m))
    assert not missing, f"{cls.__name__} lacks {missing}"


@pytest.mark.parametrize("cls", [EagerRunner, GgmlGraphRunner, CudaGraphRunner, MultiGpuRunner],
                         ids=lambda x: x.__name__)
def test_every_runner_offers_its_protocol(cls):
    missing = sorted(m for m in _members(Runner) if not _offers(cls, m))
    assert not missing, f"{cls.__name__} lacks {missing}"


def test_a_cpu_backend_is_a_backend_at_run_time():
    backend = CpuBackend(1)
    assert isinstance(backend, Backend) and backend.kv_devices(4) is None and backend.describe().startswith("1 thr")


def test_the_gpu_ops_call_nothing_a_gpu_backend_lacks():
    """The GPU op set runs over a CudaBackend or, with experts in RAM, a HybridBackend: every `self.backend.X` it (or
    the eager op set it extends) calls is in the GpuBackend protocol, which both offer."""
    import ferry.runtime.runners.cuda as cuda_ops
    import ferry.runtime.runners.eager as eager_ops

    called = {n for m in (cuda_ops, eager_ops) for n in re.findall(r"self\.backend\.(\w+)", Path(m.__file__).read_text())}
    assert {"half", "vector", "moe", "linear"} <= called
    assert called <= _members(GpuBackend) | {"recorder", "fused", "route"}, called - _members(GpuBackend)
    for cls in (CudaBackend, HybridBackend):
        missing = sorted(n for n in called if not _offers(cls, n))
        assert not missing, f"{cls.__name__} lacks {missing}"


def test_nothing_outside_backends_tells_backends_apart_by_class_or_name():
    pattern = re.compile(r"isinstance\([^)]*(Cpu|Cuda|Hybrid|MultiGpu)Backend|\.(name|label)\s*[!=]=\s*[\"'](CPU|CUDA)"
                         r"|getattr\(\s*(self\.)?backend|hasattr\(\s*(self\.)?backend")
    offenders = [f"{path.relative_to(ROOT)}:{i + 1}" for path in PACKAGE.rglob("*.py")
                 if "backends" not in path.parts
                 for i, line in enumerate(path.read_text().splitlines()) if pattern.search(line)]
    assert not offenders, offenders


def test_the_circle_finder_finds_circles():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []
