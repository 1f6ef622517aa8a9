"""The settings object: FERRY_* variables read into one frozen Settings, a bad value refused in one line."""

from pathlib import Path

import pytest

from ferry.cli import main
from ferry.config import Settings
from ferry.errors import FerryError


def test_without_variables_the_settings_are_the_defaults():
    s = Settings.from_env({})
    assert s == Settings()
    assert s.native_kernels and s.cuda_graphs and s.handshakes and s.prompt_graph_max == 2048
    assert s.cache_dir == Path.home() / ".cache" / "ferry"


def test_each_variable_overrides_its_setting():
    s = Settings.from_env({"FERRY_CACHE": "/tmp/x", "FERRY_NATIVE": "0", "FERRY_NATIVE_CFLAGS": "-DA=1  -DB",
                           "FERRY_CUDA_GRAPHS": "0", "FERRY_HANDSHAKES": "0", "FERRY_PROMPT_GRAPH_MAX": "512"})
    assert s == Settings(Path("/tmp/x"), False, ("-DA=1", "-DB"), False, False, 512)


def test_every_setting_has_exactly_one_variable():
    names = [v for v, _ in Settings.variables()]
    assert len(names) == len(set(names)) == len(Settings.__dataclass_fields__)
    assert all(v.startswith("FERRY_") for v in names)


@pytest.mark.parametrize("var, value", [("FERRY_NATIVE", "no"), ("FERRY_CUDA_GRAPHS", "2"),
                                        ("FERRY_PROMPT_GRAPH_MAX", "0"), ("FERRY_PROMPT_GRAPH_MAX", "lots")])
def test_a_bad_value_names_the_variable(var, value):
    with pytest.raises(FerryError, match=var):
        Settings.from_env({var: value})


def test_an_empty_variable_is_unset():
    assert Settings.from_env({"FERRY_NATIVE": ""}) == Settings()


def test_the_cli_reports_a_bad_variable_in_one_line(monkeypatch, capsys):
    from ferry import config

    monkeypatch.setenv("FERRY_HANDSHAKES", "off")
    config.settings.cache_clear()
    try:
        assert main(["info", "nothing.gguf"]) == 2
    finally:
        config.settings.cache_clear()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "FERRY_HANDSHAKES='off'" in err[0]
