"""One settings object: what the FERRY_* environment variables override, read once (`settings()`), and passed to
whatever they change. The flags of a run are in runtime/loader.RunConfig; these are the switches a user seldom
needs and a benchmark often does (docs/configuration.md lists them)."""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path

from ferry.errors import FerryError


def _flag(text: str) -> bool:
    if text not in ("0", "1"):
        raise ValueError("0 or 1")
    return text == "1"


def _count(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise ValueError("a whole number of at least 1")
    return int(text)


@dataclass(frozen=True)
class Settings:
    # where the calibration and ferry's compiled CPU kernels are kept
    cache_dir: Path = field(default_factory=lambda: Path.home() / ".cache" / "ferry",
                            metadata={"env": "FERRY_CACHE", "parse": Path})
    # ferry's own CPU kernels where they run (0: ggml's everywhere)
    native_kernels: bool = field(default=True, metadata={"env": "FERRY_NATIVE", "parse": _flag})
    # extra C compiler flags for ferry's CPU kernels, e.g. -DPREFETCH_AHEAD=4096 to try another prefetch distance
    native_cflags: tuple[str, ...] = field(default=(), metadata={"env": "FERRY_NATIVE_CFLAGS",
                                                                  "parse": lambda t: tuple(t.split())})
    # GPU steps recorded as CUDA graphs and replayed (0: every step eagerly, op by op)
    cuda_graphs: bool = field(default=True, metadata={"env": "FERRY_CUDA_GRAPHS", "parse": _flag})
    # a recorded hybrid step waits at its host steps instead of being cut there (0: a graph per stretch between them)
    handshakes: bool = field(default=True, metadata={"env": "FERRY_HANDSHAKES", "parse": _flag})
    # prompt u-batches up to this many tokens are replayed as CUDA graphs; above, a recording costs more than it saves
    prompt_graph_max: int = field(default=2048, metadata={"env": "FERRY_PROMPT_GRAPH_MAX", "parse": _count})
    # AMX-INT8 tiles for many tokens' weights (CPU_AMX_TYPES) where the CPU has them (0: the AVX512-VNNI kernels)
    amx: bool = field(default=True, metadata={"env": "FERRY_AMX", "parse": _flag})

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> Settings:
        """The defaults, overridden by the FERRY_* variables set in `env`; a bad value is a one-line error."""
        given = {}
        for f in fields(cls):
            var = f.metadata["env"]
            if env.get(var, "") == "":
                continue
            try:
                given[f.name] = f.metadata["parse"](env[var])
            except ValueError as e:
                raise FerryError(f"{var}={env[var]!r}: expected {e}; unset it or fix its value") from None
        return cls(**given)

    @staticmethod
    def variables() -> list[tuple[str, str]]:
        """(variable, the setting it overrides) for every FERRY_* variable ferry reads."""
        return [(f.metadata["env"], f.name) for f in fields(Settings)]


@functools.cache
def settings() -> Settings:
    """This process's settings, read from the environment at the first call."""
    return Settings.from_env()
