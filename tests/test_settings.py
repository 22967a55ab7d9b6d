"""asyncllm/settings.py: the environment variables the package reads, each declared once.
(tests/test_layout.py checks that no other module of the package touches os.environ.)"""
from __future__ import annotations

import os
import pathlib

import pytest

from asyncllm import settings
from asyncllm.models.gguf import cache_root
from asyncllm.runner.tp_protocol import collective_timeout, make_store

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def test_every_default_parses(monkeypatch):
    for setting in settings.ALL:
        monkeypatch.delenv(setting.name, raising=False)
    values = {setting.name: setting.read() for setting in settings.ALL}
    assert values["ASYNCLLM_PDL"] is values["ASYNCLLM_SKINNY_GEMM"] is values["ASYNCLLM_LAUNCH_GATE"] is True
    assert values["ASYNCLLM_DECODE_TUNING"] is True and values["TRITON_INTERPRET"] is False
    assert values["ASYNCLLM_TP_TIMEOUT_S"] == 300.0 and values["ASYNCLLM_TP_LOCAL_RANKS"] == ""
    assert values["RANK"] is None and values["ASYNCLLM_API_KEY"] is None


def test_read_follows_the_environment_at_each_call(monkeypatch):
    monkeypatch.setenv("ASYNCLLM_LAUNCH_GATE", "0")
    assert settings.LAUNCH_GATE.read() is False
    monkeypatch.setenv("ASYNCLLM_LAUNCH_GATE", "1")
    assert settings.LAUNCH_GATE.read() is True
    monkeypatch.setenv("ASYNCLLM_TP_TIMEOUT_S", "12.5")
    assert collective_timeout().total_seconds() == 12.5


def test_cache_dir_default_and_override(monkeypatch, tmp_path):
    default = os.path.join(os.path.expanduser("~"), ".cache", "asyncllm")
    monkeypatch.delenv("ASYNCLLM_CACHE", raising=False)
    assert cache_root() == default
    monkeypatch.setenv("ASYNCLLM_CACHE", "")  # empty is unset, as before
    assert cache_root() == default
    monkeypatch.setenv("ASYNCLLM_CACHE", str(tmp_path))
    assert cache_root() == str(tmp_path)


@pytest.mark.parametrize("name, text", [("ASYNCLLM_TP_TIMEOUT_S", "soon"), ("ASYNCLLM_TP_TIMEOUT_S", "0"),
                                        ("ASYNCLLM_TP_TIMEOUT_S", "-5"), ("ASYNCLLM_TP_TIMEOUT_S", "nan"),
                                        ("RANK", "one"), ("WORLD_SIZE", "2.5")])
def test_a_bad_value_is_a_value_error_naming_the_variable(monkeypatch, name, text):
    monkeypatch.setenv(name, text)
    setting = next(s for s in settings.ALL if s.name == name)
    with pytest.raises(ValueError, match=f"\\${name}="):
        setting.read()


def test_env_rendezvous_names_the_missing_or_bad_variable(monkeypatch):
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.setenv("MASTER_PORT", "29500")
    with pytest.raises(ValueError, match=r"\$MASTER_ADDR is not set"):
        make_store("env://", 1, 2)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.delenv("MASTER_PORT")
    with pytest.raises(ValueError, match=r"\$MASTER_PORT is not set"):
        make_store("env://", 1, 2)
    monkeypatch.setenv("MASTER_PORT", "port")
    with pytest.raises(ValueError, match=r"\$MASTER_PORT='port'"):
        make_store("env://", 1, 2)


def test_every_setting_is_declared_once_and_documented_in_the_readme():
    names = [setting.name for setting in settings.ALL]
    assert len(names) == len(set(names))
    assert settings.markdown_table() in README.read_text(), "README.md's table of environment variables differs: " \
                                                           "paste settings.markdown_table()"
