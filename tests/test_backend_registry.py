"""Generator backends are registered once (pyproject.toml's `dfpipe.backends`, read by shared/plugins.py): the `--backend`
choices of `dfpipe generate` and `dfpipe run` are that table, every entry names a class that exists, and an
unknown kind is refused with the known ones named, at the CLI and in the config."""

from __future__ import annotations

import argparse
import inspect

import msgspec
import pytest

from services.generator import backends
from services.generator.backends import BACKENDS, backend_class, backend_kinds, check_kind, make_backend
from shared.cli import build_parser, main
from shared.config import ConfigError, load_config


def backend_choices(parser: argparse.ArgumentParser, command: str) -> list[str]:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    option = next(a for a in sub.choices[command]._actions if "--backend" in a.option_strings)
    return list(option.choices)


def test_every_cli_offers_exactly_the_registered_kinds() -> None:
    parser = build_parser()
    assert backend_kinds() == ["hf", "openai", "sglang", "synthetic"]
    assert backend_choices(parser, "generate") == backend_kinds()
    assert backend_choices(parser, "run") == backend_kinds()


@pytest.mark.parametrize("kind", sorted(BACKENDS))
def test_every_registration_names_a_backend_class(kind: str) -> None:
    cls = backend_class(kind)
    assert cls.__module__ == BACKENDS[kind].split(":")[0] and cls.__module__.startswith("services.generator.backends.")
    assert isinstance(cls.engine, str) and cls.engine.startswith(kind)
    assert all(callable(getattr(cls, m)) for m in ("start", "generate", "close"))
    assert "gpus" in inspect.signature(cls.__init__).parameters  # make_backend builds every kind as Kind(cfg, gpus=)


def test_an_unknown_kind_is_refused_naming_the_known_ones(tmp_path) -> None:
    with pytest.raises(ConfigError, match=r"generator.backend = 'vllm' is not a backend; "
                                          r"known: hf, openai, sglang, synthetic"):
        check_kind("vllm")
    path = tmp_path / "c.toml"
    path.write_text('[generator]\nbackend = "vllm"\n')
    with pytest.raises(ConfigError, match=r"c.toml, line 2: config key 'generator.backend': 'vllm' is not a backend; "
                                          r"known: hf, openai, sglang, synthetic"):
        load_config(path, env={})  # at load, from the same registrations (shared/plugins.py)
    with pytest.raises(ConfigError, match="environment variable DFLASH_GENERATOR__BACKEND"):
        load_config(None, env={"DFLASH_GENERATOR__BACKEND": "vllm"})
    cfg = load_config(None, env={})
    with pytest.raises(ConfigError, match="known: hf, openai, sglang, synthetic"):
        make_backend(msgspec.structs.replace(cfg, generator=msgspec.structs.replace(cfg.generator, backend="vllm")))


def test_the_cli_refuses_an_unknown_kind_as_a_usage_error(capsys) -> None:
    with pytest.raises(SystemExit) as stopped:
        main(["generate", "--run", "r", "--backend", "vllm"])
    assert stopped.value.code == 2
    assert "invalid choice: 'vllm'" in capsys.readouterr().err


def test_a_new_backend_is_one_file_and_one_line(monkeypatch) -> None:
    """What docs/adding-a-backend.md says: a registration names the module and class; the table does the rest."""
    monkeypatch.setitem(BACKENDS, "echo", "services.generator.backends.synthetic:SyntheticBackend")  # an existing class under a new kind
    assert "echo" in backend_kinds() and check_kind("echo") == "echo"
    assert backend_class("echo") is backends.synthetic.SyntheticBackend
    assert backend_choices(build_parser(), "generate") == backend_kinds()
