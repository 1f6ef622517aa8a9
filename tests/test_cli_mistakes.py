"""Every user mistake is one line on stderr and exit code 2, never a traceback: the cases users met, each by name, and
every subcommand with each of its numeric flags set to 0, -5, 1e12 and a word."""

import argparse
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from ferry import __version__
from ferry.cli import _finite, build_parser, main


def ferry(*args: str, stdin: str = "") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ferry", *args], capture_output=True, text=True, timeout=600,
                          input=stdin)


def _one_line_error(r: subprocess.CompletedProcess, says: str) -> None:
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2, r.stderr
    assert len(lines) == 1 and says in lines[0] and "Traceback" not in r.stderr, r.stderr


@pytest.mark.parametrize("args, says", [
    (["sweep", "-m", "{tiny}", "-ub", "0"], "-ub/--ubatch-size must be at least 1"),
    (["ppl", "-m", "{tiny}", "-f", "{text}", "-c", "0"], "-c/--ctx-size is the chunk size"),
    (["run", "-m", "{tiny}", "hi", "-n", "-5"], "-n/--n-predict -5"),
    (["run", "-m", "{tiny}", "hi", "-c", "-5"], "-c/--ctx-size must be 0"),
    (["synth", "qwen3-moe-tiny", "-o", "{tmp}/x.gguf", "--layers", "-2"], "--layers must be 0"),
    (["synth", "qwen3-moe-tiny", "-o", "{tmp}/x.gguf", "--seed", "-1"], "--seed must be"),
    (["serve", "-m", "{tiny}", "-ub", "0"], "-ub/--ubatch-size must be at least 1"),
    (["serve", "-m", "{tiny}", "-b", "-1"], "-b/--batch-size must be 0 (one u-batch) or more"),
    (["serve", "-m", "{tiny}", "--port", "99999"], "--port must be 0..65535"),
    (["run", "-m", "{tiny}", "hi", "-o", "out.txt"], "unrecognized arguments: -o"),  # not -ot
    (["run", "-m", "{tiny}", "hi", "-r"], "unrecognized arguments: -r"),  # not -rtr
    (["run", "-m", "{tiny}", "-f", "{tmp}/missing.txt"], "-f {tmp}/missing.txt: cannot read it"),
    (["run", "-m", "{tiny}", "hi", "--temp", "nan"], "not a finite number"),
    (["run", "-m", "{tiny}", "hi", "-s", "-7"], "-s/--seed must be -1"),
    (["info", "-m", "{tiny}", "{tiny}"], "give the GGUF file once"),
])
def test_each_mistake_users_met_is_one_line_and_exit_2(tiny, tmp_path, text_file, args, says):
    def sub(text: str) -> str:
        return text.replace("{tiny}", str(tiny)).replace("{tmp}", str(tmp_path)).replace("{text}", text_file)

    r = ferry(*map(sub, args))
    _one_line_error(r, sub(says))
    assert "serving on" not in r.stderr


def test_a_busy_port_is_one_line_and_exit_2_before_the_model_loads(tiny):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = ferry("serve", "-m", str(tiny), "--port", str(port))
    _one_line_error(r, f"cannot listen on 127.0.0.1:{port}")


def test_version_and_info_with_m(tiny):
    r = ferry("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"ferry {__version__}"
    pyproject = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    # the distribution's name is free on PyPI ("ferry" there is another project); the command stays `ferry`
    assert 'name = "ferry-moe"' in pyproject and f'version = "{__version__}"' in pyproject
    assert 'ferry = "ferry.cli:main"' in pyproject
    assert ferry("info", "-m", str(tiny), "--json").returncode == 0


@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    return str(path)


# a cheap valid invocation of each subcommand; the flag under test is appended (argparse: the last one wins)
BASES = {
    "run": ["run", "-m", "{tiny}", "hi", "-n", "2", "-q"],
    "chat": ["chat", "-m", "{tiny}", "-n", "2", "-q"],
    "bench": ["bench", "-m", "{tiny}", "-p", "8", "-n", "2", "-r", "1", "-o", "json"],
    "sweep": ["sweep", "-m", "{tiny}", "-c", "96", "-ub", "32", "-q"],
    "ppl": ["ppl", "-m", "{tiny}", "-f", "{text}", "-c", "32", "-q", "-o", "json"],
    "serve": ["serve", "-m", "{tiny}", "-c", "64", "-np", "1", "--port", "0"],
    "calibrate": ["calibrate", "--quick", "--out", "{tmp}/c.json", "-q"],
    "plan": ["plan", "-m", "{tiny}", "--calibration", "{tmp}/none.json"],
    "info": ["info", "{tiny}"],
    "synth": ["synth", "qwen3-moe-tiny", "-o", "{tmp}/s.gguf", "-q"],
    "compare": None,  # no numeric flag
}
BENCH_LISTS = {"-p", "-n", "-b", "-ub", "-t", "-d", "-ngl", "-fa", "-mla"}  # numbers as llama-bench's lists
VALUES = ("0", "-5", "1e12", "many")


def _numeric_flags() -> list[tuple[str, str]]:
    """(subcommand, flag) for every flag that takes a number, found in the parser itself: a new flag is covered."""
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    found = []
    for name, p in sub.choices.items():
        for a in p._actions:
            if not a.option_strings or a.nargs == 0:
                continue
            flag = a.option_strings[0]
            if a.type in (int, float, _finite) or (name == "bench" and flag in BENCH_LISTS):
                found.append((name, flag))
    return found


def test_every_subcommand_has_a_base_invocation():
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert set(sub.choices) == set(BASES)
    flags = _numeric_flags()
    assert ("run", "-c") in flags and ("bench", "-ub") in flags and ("serve", "--port") in flags
    assert len(flags) > 80


def test_every_numeric_flag_of_every_subcommand_takes_garbage_without_a_traceback(tiny, tmp_path, text_file,
                                                                                monkeypatch, capsys):
    """Each run in-process: an exception escaping main() fails the test. A calibration or a server that would run
    for long is replaced by an instant one once its flags have been checked."""
    import uvicorn

    from ferry.offload import calibrate

    monkeypatch.setattr(uvicorn.Server, "run", lambda self, sockets=None: None)
    monkeypatch.setattr(calibrate, "calibrate", lambda backend, quick=False, on_step=None: {
        "machine": "x", "cpu": {"cpu_bytes_per_s": 1e10, "cpu_flops": 1e11, "threads": backend.n_threads},
        "gpu": None, "quick": quick, "time": "now"})
    monkeypatch.setattr(sys, "stdin", open("/dev/null"))  # chat: no input, the conversation ends at once
    sub = {"{tiny}": str(tiny), "{tmp}": str(tmp_path), "{text}": text_file}
    codes = {}
    for name, flag in _numeric_flags():
        for value in VALUES:
            argv = [sub.get(a, a.replace("{tmp}", str(tmp_path))) for a in BASES[name]] + [flag, value]
            code = main(argv)
            out = capsys.readouterr()
            assert code in (0, 2), (argv, code, out.err)
            assert "Traceback" not in out.err, (argv, out.err)
            if code == 2:
                errors = [line for line in out.err.strip().splitlines() if "error" in line]
                assert len(errors) == 1, (argv, out.err)
            codes[name, flag, value] = code
    # the garbage is refused, the plain values run
    assert all(codes[k] == 2 for k in codes if k[2] in ("many",))
    assert codes["run", "-n", "0"] == 0 and codes["run", "-c", "0"] == 0 and codes["run", "-c", "-5"] == 2
    assert codes["sweep", "-ub", "0"] == 2 and codes["ppl", "-c", "0"] == 2 and codes["serve", "--port", "0"] == 0
    assert codes["run", "--temp", "1e12"] == 0 and codes["run", "--top-p", "1e12"] == 2
