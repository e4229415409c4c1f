"""SGLang's native `/generate`: token ids in, token ids out, so the completion is exactly what the target emitted.

Request: `{"input_ids": [...], "sampling_params": {"max_new_tokens", "temperature", "top_p", "top_k"},
"rid": ...}`; response: `{"text", "output_ids", "meta_info": {"finish_reason": {"type": ...},
"prompt_tokens", "completion_tokens", "spec_verify_ct"?, "spec_accept_length"?}}`. Readiness is
`GET /health_generate` (it runs a one-token generation, so it fails while the engine cannot
serve). `max_new_tokens` is always sent (SGLang's default is 128); every attempt gets a fresh
`rid` (a retried request id would collide with the one still in the server), prefixed with the worker's name.

Keeping the engine full (services/generator/engine_fill.py): its batch limit comes from `/get_server_info`
(`internal_states[].effective_max_running_requests_per_dp`, one per DP rank; `max_running_requests` at the top
level is the launch argument, null unless set), its running and queued requests from `/metrics` (a launched
server gets `--enable-metrics`) or else `/v1/loads` (0.5.21+). A request the generator stops waiting for — a
timeout, a drain's cancel — is aborted on the engine (`POST /abort_request {"rid"}`; SGLang's scheduler matches
rids by prefix, so at start `{"rid": "<worker>/"}` also aborts what an earlier, killed process of this worker
left decoding).
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

from shared.children import dies_with_parent
from shared.config import Config
from shared.gpus import GpuGroup
from shared.service import startup_thread

from ..engine_fill import AUTO_UPPER, EngineLoad, parse_prometheus
from .base import EngineError, GenRequest, GenResult, check_template, render_prompt, split_reasoning
from .http import EngineClient

log = logging.getLogger("dflash.generator.sglang")


def sampling_params(cfg: Config) -> dict[str, Any]:
    s = cfg.sampling
    params: dict[str, Any] = {"max_new_tokens": s.max_new_tokens, "temperature": s.temperature, "top_p": s.top_p,
                              "skip_special_tokens": True}
    if s.top_k > 0:
        params["top_k"] = s.top_k
    return params


SGLANG_LOAD = {"sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:gen_throughput"}


def parse_generate_response(data: Any, prompt_tokens: int) -> GenResult:
    """One `/generate` response → GenResult; a shape we don't know is an error, not a silent default."""
    if not isinstance(data, dict) or not isinstance(data.get("meta_info"), dict) or "text" not in data:
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
        self.client = EngineClient(self.url, g.request_timeout_s or 3600.0, g.max_inflight or AUTO_UPPER)
        self.proc: subprocess.Popen[bytes] | None = None
        self.tok: Any = None
        self.rid_prefix = ""  # "<worker>/": set by the generator, so a restarted worker can abort what it left
        self.load_source: str | None = "/metrics"  # where running/queued come from; None once neither answers
        self.warned: set[str] = set()

    def launch_command(self) -> list[str]:
        """The server for this worker's GPU group: tensor parallel over the whole group (`--tp-size`)."""
        from shared.model import resolve_target

        port = urlparse(self.url).port or 30000
        tp = ["--tp-size", str(self.gpus.tp)] if self.gpus is not None else []
        extra = list(self.cfg.generator.launch_args)
        if "--enable-metrics" not in extra:
            extra.append("--enable-metrics")  # running/queued counts: how the generator keeps the batch full
        return [sys.executable, "-m", "sglang.launch_server", "--model-path", str(resolve_target(self.cfg.model.target)),
                "--host", "127.0.0.1", "--port", str(port), *tp, *extra]

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
            self.proc = subprocess.Popen(cmd, env=env, start_new_session=True, preexec_fn=dies_with_parent())
        ready_s = self.cfg.generator.engine_ready_s or (1800.0 if self.proc else 120.0)
        await self.client.wait_ready("/health_generate", deadline_s=ready_s)
        if self.rid_prefix:  # a killed earlier process of this worker may have left requests decoding
            await self.abort(self.rid_prefix)

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
                "rid": f"{self.rid_prefix}{req.prompt_id}-{req.attempt}-{uuid.uuid4().hex[:8]}"}
        return body, len(ids)

    async def generate(self, req: GenRequest) -> GenResult:
        body, n_prompt = await asyncio.to_thread(self.request_body, req)  # template + tokenizer: off the loop
        try:
            data = await self.client.post("/generate", body)
        except asyncio.CancelledError:  # a timeout or a drain gave up on it: the engine must not decode for nobody
            await asyncio.shield(self.abort(body["rid"]))
            raise
        try:
            result = parse_generate_response(data, n_prompt)
        except ValueError as e:
            raise EngineError(f"engine at {self.url}: {e}") from None
        if self.cfg.sampling.enable_thinking:
            result.text, result.reasoning = split_reasoning(result.text)
        return result

    async def abort(self, rid: str) -> None:
        """Abort a request (or, by prefix, every request whose rid starts with `rid`) on the engine; a failure
        is logged, never raised (the engine may be the reason the request was given up)."""
        try:
            resp = await self.client.http.post("/abort_request", json={"rid": rid}, timeout=5.0)
            if resp.status_code >= 400:
                log.warning("engine at %s: /abort_request for %r answered HTTP %d", self.url, rid, resp.status_code)
        except Exception as e:  # best effort by design
            log.warning("engine at %s: could not abort %r: %s: %s", self.url, rid, type(e).__name__, e)

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self.warned:
            self.warned.add(key)
            log.warning("%s", message)

    async def engine_limit(self) -> int | None:
        """The engine's batch limit from /get_server_info: effective_max_running_requests_per_dp summed over DP
        ranks (internal_states[]), else the launch argument max_running_requests; None (and a warning naming
        what was wrong) when it says neither."""
        try:
            resp = await self.client.get("/get_server_info", timeout_s=5.0)
            info = resp.json() if resp.status_code == 200 else None
        except EngineError as e:
            self._warn_once("info", f"{e}; the batch limit is found from the engine's load instead")
            return None
        except ValueError:
            info = "not JSON"
        if not isinstance(info, dict):
            what = f"HTTP {resp.status_code}" if resp.status_code != 200 else "a body that is not a JSON object"
            self._warn_once("info", f"engine at {self.url}: /get_server_info answered {what}; "
                            "the batch limit is found from the engine's load instead")
            return None
        states = info.get("internal_states")
        per_dp = [s.get("effective_max_running_requests_per_dp") for s in states if isinstance(s, dict)] \
            if isinstance(states, list) else []
        if per_dp and all(isinstance(v, int) and v > 0 for v in per_dp):
            return sum(per_dp)
        if isinstance(info.get("max_running_requests"), int) and info["max_running_requests"] > 0:
            return info["max_running_requests"] * max(1, int(info.get("dp_size") or 1))
        self._warn_once("info", f"engine at {self.url}: /get_server_info has neither "
                        "internal_states[].effective_max_running_requests_per_dp nor max_running_requests; "
                        "the batch limit is found from the engine's load instead")
        return None

    async def engine_load(self) -> EngineLoad | None:
        """Running and queued requests (and tokens/s) from /metrics, else /v1/loads; None when neither answers
        in the expected shape (warned once, naming the URL and what was wrong)."""
        if self.load_source == "/metrics":
            try:
                resp = await self.client.get("/metrics")
            except EngineError as e:
                self._warn_once("metrics-slow", f"{e} (running/queued counts missing this poll)")
                return None
            if resp.status_code == 200:
                m = parse_prometheus(resp.text, SGLANG_LOAD)
                if "sglang:num_running_reqs" in m and "sglang:num_queue_reqs" in m:
                    return EngineLoad(running=int(m["sglang:num_running_reqs"]),
                                      queued=int(m["sglang:num_queue_reqs"]),
                                      tokens_per_s=m.get("sglang:gen_throughput"))
            self._warn_once("metrics", f"engine at {self.url}: /metrics answered HTTP {resp.status_code} without "
                            "sglang:num_running_reqs/num_queue_reqs (launch SGLang with --enable-metrics); "
                            "trying /v1/loads")
            self.load_source = "/v1/loads"
        if self.load_source == "/v1/loads":
            try:
                resp = await self.client.get("/v1/loads")
                loads = resp.json().get("loads") if resp.status_code == 200 else None
            except EngineError as e:
                self._warn_once("loads-slow", f"{e} (running/queued counts missing this poll)")
                return None
            except (ValueError, AttributeError):
                loads = None
            if isinstance(loads, list) and loads and all(isinstance(x, dict) and "num_running_reqs" in x
                                                         and "num_waiting_reqs" in x for x in loads):
                max_running = [x.get("max_running_requests") for x in loads]
                return EngineLoad(
                    running=sum(int(x["num_running_reqs"]) for x in loads),
                    queued=sum(int(x["num_waiting_reqs"]) for x in loads),
                    max_running=sum(max_running) if all(isinstance(v, int) and v > 0 for v in max_running) else None)
            self._warn_once("loads", f"engine at {self.url}: neither /metrics nor /v1/loads gives running/queued "
                            "requests; the level follows measured throughput")
            self.load_source = None
        return None
