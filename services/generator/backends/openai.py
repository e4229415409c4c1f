"""Any OpenAI-compatible server: chat (`/v1/chat/completions`) or completions (`/v1/completions`).

The chat endpoint lets the server apply the chat template; thinking is passed as
`chat_template_kwargs.enable_thinking` (vLLM, SGLang and `transformers serve` read it). The
completions endpoint sends the prompt rendered with the target's own template, locally. Output
token ids are not part of the OpenAI API, so this backend is not token-exact: the tokenizer
re-tokenizes and reports the drift.

Keeping the engine full: vLLM's `/metrics` (always on) gives `vllm:num_requests_running` and
`vllm:num_requests_waiting` (it exposes no `max_num_seqs`); where no such /metrics answers (`transformers serve`,
llama.cpp) the level follows measured throughput (services/generator/engine_fill.py). vLLM and SGLang abort a
request whose client disconnected, which is what a cancelled request here does.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

from shared.config import Config
from shared.gpus import GpuGroup

from ..engine_fill import AUTO_UPPER, EngineLoad, parse_prometheus
from .base import (
    EngineError,
    GenRequest,
    GenResult,
    chat_dicts,
    check_template,
    render_prompt,
    split_reasoning,
)
from .http import EngineClient

log = logging.getLogger("dflash.generator.openai")
VLLM_LOAD = {"vllm:num_requests_running", "vllm:num_requests_waiting"}


class OpenAIBackend:
    engine = "openai"

    def __init__(self, cfg: Config, *, gpus: GpuGroup | None = None) -> None:  # unused: the server owns its GPUs
        g = cfg.generator
        self.cfg = cfg
        self.endpoint = g.openai_endpoint
        self.model = g.engine_model or cfg.model.target
        self.engine = f"openai:{self.endpoint}"
        self.client = EngineClient(g.engine_url, g.request_timeout_s or 3600.0, g.max_inflight or AUTO_UPPER,
                                   api_key=os.environ.get("OPENAI_API_KEY", ""))
        self.url = self.client.base_url
        self.tok: Any = None
        self.has_metrics = True  # False once /metrics answered without vLLM's counts: stop asking
        self.warned: set[str] = set()

    async def start(self) -> None:
        if self.endpoint == "completions":
            from shared.model import load_tokenizer

            self.tok = load_tokenizer(self.cfg.model.target)
            check_template(self.tok, self.cfg.sampling.enable_thinking)
        await self.client.wait_ready("/v1/models", self.cfg.generator.engine_ready_s or 600.0)

    async def engine_limit(self) -> int | None:
        return None  # vLLM exposes no max_num_seqs; the level comes from running/queued or throughput

    async def engine_load(self) -> EngineLoad | None:
        """Running and waiting requests from vLLM's /metrics; None when it has none (warned once)."""
        if not self.has_metrics:
            return None
        try:
            resp = await self.client.get("/metrics")
        except EngineError as e:
            if "metrics-slow" not in self.warned:
                self.warned.add("metrics-slow")
                log.warning("%s (running/queued counts missing this poll)", e)
            return None
        m = parse_prometheus(resp.text, VLLM_LOAD) if resp.status_code == 200 else {}
        if len(m) == len(VLLM_LOAD):
            return EngineLoad(running=int(m["vllm:num_requests_running"]), queued=int(m["vllm:num_requests_waiting"]))
        self.has_metrics = False
        log.warning("engine at %s: /metrics answered HTTP %d without vllm:num_requests_running/waiting; "
                    "the level follows measured throughput", self.url, resp.status_code)
        return None

    async def close(self) -> None:
        await self.client.close()

    def sampling(self) -> dict[str, Any]:
        s = self.cfg.sampling
        body: dict[str, Any] = {"model": self.model, "max_tokens": s.max_new_tokens, "temperature": s.temperature,
                                "top_p": s.top_p, "seed": s.seed}
        if s.top_k > 0:
            body["top_k"] = s.top_k  # an extension vLLM and SGLang accept
        return body

    async def generate(self, req: GenRequest) -> GenResult:
        s = self.cfg.sampling
        body = self.sampling()
        if self.endpoint == "chat":
            body.update(messages=chat_dicts(req.messages),
                        chat_template_kwargs={"enable_thinking": s.enable_thinking})
            data = await self.client.post("/v1/chat/completions", body)
            choice = self.first_choice(data, "/v1/chat/completions")
            msg = choice.get("message") or {}
            text = msg.get("content") or ""
            reasoning = msg.get("reasoning_content") or msg.get("reasoning")
        else:
            body["prompt"] = await asyncio.to_thread(render_prompt, self.tok, req.messages, s.enable_thinking)
            data = await self.client.post("/v1/completions", body)
            choice = self.first_choice(data, "/v1/completions")
            text, reasoning = choice.get("text") or "", None
        if reasoning is None and s.enable_thinking:
            text, reasoning = split_reasoning(text)
        usage = data.get("usage") if isinstance(data.get("usage"), dict) else {}
        return GenResult(
            text=text, reasoning=reasoning, prompt_tokens=int(usage.get("prompt_tokens") or 0),
            completion_tokens=int(usage.get("completion_tokens") or 0),
            finish_reason=choice.get("finish_reason") or "stop",
        )

    def first_choice(self, data: Any, path: str) -> dict[str, Any]:
        """choices[0] of an answer; a body of another shape is an engine error naming the URL (retried)."""
        choices = data.get("choices") if isinstance(data, dict) else None
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            raise EngineError(f"engine at {self.url}: {path} answered without choices[0]: {str(data)[:200]}")
        return choices[0]
