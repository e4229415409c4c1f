"""Inference backends behind one small interface, so the generator loop never knows which engine runs.

- `hf`: in-process transformers, batched (the embedded default, CPU or GPU).
- `sglang`: SGLang's native `/generate`, token ids in and out (token-exact).
- `openai`: any OpenAI-compatible server (vLLM, SGLang, llama.cpp, `transformers serve`).
- `synthetic`: a load generator for benchmarks and tests (deterministic pseudo-completions as token ids),
  never a default and never a source of training data.
"""

from __future__ import annotations

from shared.config import Config
from shared.gpus import GpuGroup

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

__all__ = ["Backend", "EngineError", "GenRequest", "GenResult", "PromptRefused", "chat_dicts", "check_template",
           "make_backend", "render_prompt", "split_reasoning"]


def make_backend(cfg: Config, *, gpus: GpuGroup | None = None) -> Backend:
    """The configured backend; `gpus`: the GPU group its engine runs on (None: CPU, or an engine not ours)."""
    kind = cfg.generator.backend
    if kind == "hf":
        from .hf import HFBackend

        return HFBackend(cfg, gpus=gpus)
    if kind == "sglang":
        from .sglang import SGLangBackend

        return SGLangBackend(cfg, gpus=gpus)
    if kind == "synthetic":
        from .synthetic import SyntheticBackend

        return SyntheticBackend(cfg, gpus=gpus)
    from .openai import OpenAIBackend

    return OpenAIBackend(cfg)
