"""Any OpenAI-compatible server: chat (`/v1/chat/completions`) or completions (`/v1/completions`).

The chat endpoint lets the server apply the chat template; thinking is passed as
`chat_template_kwargs.enable_thinking` (vLLM, SGLang and `transformers serve` read it). The
completions endpoint sends the prompt rendered with the target's own template, locally. Output
token ids are not part of the OpenAI API, so this backend is not token-exact: the tokenizer
re-tokenizes and reports the drift.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

from shared.config import Config

from .base import GenRequest, GenResult, chat_dicts, check_template, render_prompt, split_reasoning
from .http import EngineClient


class OpenAIBackend:
    engine = "openai"

    def __init__(self, cfg: Config, *, gpu: int | None = None) -> None:  # gpu unused: the server owns its GPUs
        g = cfg.generator
        self.cfg = cfg
        self.endpoint = g.openai_endpoint
        self.model = g.engine_model or cfg.model.target
        self.engine = f"openai:{self.endpoint}"
        self.client = EngineClient(g.engine_url, g.request_timeout_s, g.max_inflight,
                                   api_key=os.environ.get("OPENAI_API_KEY", ""))
        self.tok: Any = None

    async def start(self) -> None:
        if self.endpoint == "completions":
            from shared.model import load_tokenizer

            self.tok = load_tokenizer(self.cfg.model.target)
            check_template(self.tok, self.cfg.sampling.enable_thinking)
        await self.client.wait_ready("/v1/models", self.cfg.generator.request_timeout_s)

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
            choice = data["choices"][0]
            msg = choice.get("message") or {}
            text = msg.get("content") or ""
            reasoning = msg.get("reasoning_content") or msg.get("reasoning")
        else:
            body["prompt"] = await asyncio.to_thread(render_prompt, self.tok, req.messages, s.enable_thinking)
            data = await self.client.post("/v1/completions", body)
            choice = data["choices"][0]
            text, reasoning = choice.get("text") or "", None
        if reasoning is None and s.enable_thinking:
            text, reasoning = split_reasoning(text)
        usage = data.get("usage") or {}
        return GenResult(
            text=text, reasoning=reasoning, prompt_tokens=int(usage.get("prompt_tokens") or 0),
            completion_tokens=int(usage.get("completion_tokens") or 0),
            finish_reason=choice.get("finish_reason") or "stop",
        )
