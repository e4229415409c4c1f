"""Inference backends behind one small interface, so the generator loop never knows which engine runs.

- `hf`: in-process transformers, batched (the embedded default, CPU or GPU).
- `sglang`: SGLang's native `/generate`, token ids in and out (token-exact).
- `openai`: any OpenAI-compatible server (vLLM, SGLang, llama.cpp, `transformers serve`).
- `synthetic`: a load generator for benchmarks and tests (deterministic pseudo-completions as token ids),
  never a default and never a source of training data.
"""

from __future__ import annotations

from importlib import import_module

from shared.config import Config, ConfigError
from shared.gpus import GpuGroup
from shared.plugins import BACKENDS as PLUGIN_GROUP
from shared.plugins import registered

from .base import (
    Backend,
    EngineError,
    GenRequest,
    GenResult,
    PromptRefused,
    chat_dicts,
    check_template,
    render_prompt,
    split_reasoning,
)

__all__ = [
    "BACKENDS",
    "Backend",
    "EngineError",
    "GenRequest",
    "GenResult",
    "PromptRefused",
    "backend_class",
    "backend_kinds",
    "chat_dicts",
    "check_kind",
    "check_template",
    "make_backend",
    "render_prompt",
    "split_reasoning",
]


# Every backend kind, registered in one place: pyproject.toml's `dfpipe.backends` entry points (kind ->
# "module:Class"), imported only when chosen (the hf backend brings torch). Adding a backend is its file plus one
# line there; the `--backend` choices of `dfpipe generate` and `dfpipe run`, the check of `generator.backend` at
# config load, and make_backend all read it.
BACKENDS: dict[str, str] = {ep.name: ep.value for ep in registered(PLUGIN_GROUP)}


def backend_kinds() -> list[str]:
    """The registered kinds, sorted (for `choices=` and error messages)."""
    return sorted(BACKENDS)


def check_kind(kind: str) -> str:
    """`kind` if it is registered; otherwise a ConfigError naming the known ones."""
    if kind not in BACKENDS:
        raise ConfigError(f"generator.backend = {kind!r} is not a backend; known: {', '.join(backend_kinds())}")
    return kind


def backend_class(kind: str) -> type[Backend]:
    module, _, name = BACKENDS[check_kind(kind)].partition(":")
    return getattr(import_module(module), name)


def make_backend(cfg: Config, *, gpus: GpuGroup | None = None) -> Backend:
    """The configured backend for this worker (`gpus`: the GPU group its engine runs on; None: CPU, or an
    engine not ours)."""
    return backend_class(cfg.generator.backend)(cfg, gpus=gpus)
