"""SGLang's native `/generate`: token ids in, token ids out, so the completion is exactly what the target emitted.

Request: `{"input_ids": [...], "sampling_params": {"max_new_tokens", "temperature", "top_p", "top_k"},
"rid": ...}`; response: `{"text", "output_ids", "meta_info": {"finish_reason": {"type": ...},
"prompt_tokens", "completion_tokens", "spec_verify_ct"?, "spec_accept_length"?}}`. Readiness is
`GET /health_generate` (it runs a one-token generation, so it fails while the engine cannot
serve). `max_new_tokens` is always sent (SGLang's default is 128); every attempt gets a fresh
`rid` (a retried request id would collide with the one still in the server).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import subprocess
import sys
import uuid
from typing import Any
from urllib.parse import urlparse

from shared.config import Config
from shared.gpus import GpuGroup
from shared.service import startup_thread

from .base import GenRequest, GenResult, check_template, render_prompt, split_reasoning
from .http import EngineClient

log = logging.getLogger("dflash.generator.sglang")


def sampling_params(cfg: Config) -> dict[str, Any]:
    s = cfg.sampling
    params: dict[str, Any] = {"max_new_tokens": s.max_new_tokens, "temperature": s.temperature, "top_p": s.top_p,
                              "skip_special_tokens": True}
    if s.top_k > 0:
        params["top_k"] = s.top_k
    return params


def parse_generate_response(data: Any, prompt_tokens: int) -> GenResult:
    """One `/generate` response → GenResult; a shape we don't know is an error, not a silent default."""
    if not isinstance(data, dict) or "meta_info" not in data or "text" not in data:
        raise ValueError(f"unexpected /generate response (no text/meta_info): {str(data)[:200]}")
    meta = data["meta_info"]
    finish = meta.get("finish_reason")
    reason = finish.get("type", "stop") if isinstance(finish, dict) else (finish or "stop")
    ids = data.get("output_ids")
    completion_tokens = int(meta.get("completion_tokens") or (len(ids) if ids else 0))
    accept = meta.get("spec_accept_length")
    if accept is None and meta.get("spec_verify_ct"):
        accept = completion_tokens / float(meta["spec_verify_ct"])
    return GenResult(
        text=data["text"], output_ids=list(ids) if ids is not None else None,
        prompt_tokens=int(meta.get("prompt_tokens") or prompt_tokens), completion_tokens=completion_tokens,
        finish_reason="length" if reason == "length" else ("abort" if reason == "abort" else "stop"),
        spec_accept_length=float(accept) if accept is not None else None,
    )


class SGLangBackend:
    engine = "sglang"

    def __init__(self, cfg: Config, *, gpus: GpuGroup | None = None) -> None:
        g = cfg.generator
        self.cfg, self.gpus = cfg, gpus
        self.model = g.engine_model or cfg.model.target
        self.url = g.engine_url or "http://127.0.0.1:30000"
        self.client = EngineClient(self.url, g.request_timeout_s, g.max_inflight)
        self.proc: subprocess.Popen[bytes] | None = None
        self.tok: Any = None

    def launch_command(self) -> list[str]:
        """The server for this worker's GPU group: tensor parallel over the whole group (`--tp-size`)."""
        from shared.model import resolve_target

        port = urlparse(self.url).port or 30000
        tp = ["--tp-size", str(self.gpus.tp)] if self.gpus is not None else []
        return [sys.executable, "-m", "sglang.launch_server", "--model-path", str(resolve_target(self.cfg.model.target)),
                "--host", "127.0.0.1", "--port", str(port), *tp, *self.cfg.generator.launch_args]

    def launch_env(self, base: dict[str, str]) -> dict[str, str]:
        """The server's environment: `base` with `CUDA_VISIBLE_DEVICES` set to the group (its GPUs become 0..tp-1)."""
        env = dict(base)
        if self.gpus is not None:
            env["CUDA_VISIBLE_DEVICES"] = self.gpus.visible_devices
        return env

    async def start(self) -> None:
        from shared.model import load_tokenizer

        self.tok = await startup_thread(load_tokenizer, self.cfg.model.target)
        check_template(self.tok, self.cfg.sampling.enable_thinking)
        if self.cfg.generator.launch:
            env = self.launch_env(dict(os.environ))
            cmd = self.launch_command()
            log.info("launching %s (CUDA_VISIBLE_DEVICES=%s)", " ".join(cmd), env.get("CUDA_VISIBLE_DEVICES", ""))
            self.proc = subprocess.Popen(cmd, env=env, start_new_session=True)
        await self.client.wait_ready("/health_generate", deadline_s=1800.0 if self.proc else 120.0)

    async def close(self) -> None:
        await self.client.close()
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                await asyncio.to_thread(self.proc.wait, 60)
            if self.proc.poll() is None:
                self.proc.kill()

    def request_body(self, req: GenRequest) -> tuple[dict[str, Any], int]:
        text = render_prompt(self.tok, req.messages, self.cfg.sampling.enable_thinking)
        ids = self.tok(text, add_special_tokens=False)["input_ids"]
        body = {"input_ids": ids, "sampling_params": sampling_params(self.cfg),
                "rid": f"{req.prompt_id}-{req.attempt}-{uuid.uuid4().hex[:8]}"}
        return body, len(ids)

    async def generate(self, req: GenRequest) -> GenResult:
        body, n_prompt = await asyncio.to_thread(self.request_body, req)  # template + tokenizer: off the loop
        result = parse_generate_response(await self.client.post("/generate", body), n_prompt)
        if self.cfg.sampling.enable_thinking:
            result.text, result.reasoning = split_reasoning(result.text)
        return result
