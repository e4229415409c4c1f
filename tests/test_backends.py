"""The server backends: `openai` against a real `transformers serve`, `sglang` by a contract test.

The SGLang contract test is the one place a server is stood in for: SGLang cannot run on these
CPU-only machines, so a small HTTP server speaks SGLang's documented `/generate` and
`/health_generate` shapes and records what the backend sends. It is labelled as such; the test
marked `gpu` runs the real server where one is available.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar

import httpx
import msgspec
import pytest

from services.generator.backends import GenRequest, GenResult, render_prompt
from services.generator.backends.openai import OpenAIBackend
from services.generator.backends.sglang import SGLangBackend, parse_generate_response
from shared.gpus import GpuGroup
from shared.messages import ChatMessage
from shared.model import load_tokenizer
from tests.conftest import make_config

MSGS = [ChatMessage(role="user", content="What is the capital of France? One word.")]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def transformers_server(target_dir: Path, tmp_path_factory):
    exe = shutil.which("transformers", path=os.path.dirname(sys.executable))
    if exe is None:
        pytest.fail("`transformers` CLI missing: install transformers[serving] (the dev extra)")
    port = free_port()
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    proc = subprocess.Popen([exe, "serve", str(target_dir), "--host", "127.0.0.1", "--port", str(port),
                             "--device", "cpu"], stdout=open(log, "wb"), stderr=subprocess.STDOUT,  # noqa: SIM115
                            start_new_session=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        end = time.monotonic() + 180
        while time.monotonic() < end:
            if proc.poll() is not None:
                pytest.fail(f"transformers serve exited: {log.read_text()[-2000:]}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        else:
            pytest.fail(f"transformers serve not healthy: {log.read_text()[-2000:]}")
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
async def test_openai_backend_against_transformers_serve(stack, transformers_server, target_dir, endpoint):
    cfg = make_config(stack, generator={"backend": "openai", "engine_url": transformers_server,
                                        "engine_model": str(target_dir), "openai_endpoint": endpoint,
                                        "request_timeout_s": 120.0},
                      sampling={"max_new_tokens": 12, "temperature": 0.0})
    backend = OpenAIBackend(cfg)
    await backend.start()
    try:
        results = await asyncio.gather(*(backend.generate(GenRequest(prompt_id=f"p{i}", messages=MSGS))
                                         for i in range(2)))
    finally:
        await backend.close()
    for r in results:
        assert r.text.strip(), r
        assert r.finish_reason in ("stop", "length")
        assert 0 < r.completion_tokens <= 12 and r.prompt_tokens > 5
        assert r.output_ids is None  # the OpenAI API returns text only: not token-exact


async def test_openai_backend_drives_a_generator_run(stack, bus, store, tmp_path, transformers_server, target_dir):
    from services.generator.service import run_generator
    from shared.records import read_completions
    from tests.test_generator import FAST, completed_ids_eq, fed_ids, prompts_file, shard_events, wait_for

    cfg = make_config(stack, generator={**FAST["generator"], "backend": "openai", "engine_url": transformers_server,
                                        "engine_model": str(target_dir)}, sampling=FAST["sampling"])
    ids = await fed_ids(cfg, bus, store, prompts_file(tmp_path, 4, "oa"))
    stop = asyncio.Event()
    worker = asyncio.create_task(run_generator(cfg, "oa0", stop=stop))
    await wait_for(lambda: completed_ids_eq(bus, cfg.run, ids), 240, "openai-backed run")
    stop.set()
    await asyncio.wait_for(worker, 120)
    recs = [r for e in await shard_events(bus, cfg.run) for r in read_completions(store.get_bytes(e.key))]
    assert {r.engine for r in recs} == {"openai:chat"} and all(r.completion for r in recs)


# --- SGLang: contract test (a stand-in speaking the documented shapes) -----------------------------


class SGLangContract(BaseHTTPRequestHandler):
    """SGLang's documented native API: the stop token stays in output_ids and is trimmed from text."""

    requests: ClassVar[list[dict]] = []
    fail_first = 0
    healthy = True

    def log_message(self, *args) -> None:
        pass

    def _send(self, code: int, body: dict | str) -> None:
        data = (json.dumps(body) if isinstance(body, dict) else body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self._send(200 if self.path == "/health_generate" and self.healthy else 503, {})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        cls = type(self)
        cls.requests.append(body)
        if cls.fail_first > 0:
            cls.fail_first -= 1
            self._send(503, "engine overloaded")
            return
        n = body["sampling_params"]["max_new_tokens"]
        stop = len(body["input_ids"]) % 2 == 0
        out = [42] * (3 if stop else n) + ([2] if stop else [])
        self._send(200, {
            "text": "*" * 3 if stop else "*" * n,
            "output_ids": out,
            "meta_info": {"id": body.get("rid"), "finish_reason": {"type": "stop", "matched": 2} if stop
                          else {"type": "length", "length": n}, "prompt_tokens": len(body["input_ids"]),
                          "completion_tokens": len(out), "cached_tokens": 0, "spec_verify_ct": 2},
        })


@pytest.fixture
def sglang_contract():
    SGLangContract.requests, SGLangContract.fail_first = [], 0
    server = ThreadingHTTPServer(("127.0.0.1", 0), SGLangContract)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


async def test_sglang_contract_request_and_response_shapes(stack, sglang_contract, target_dir):
    cfg = make_config(stack, generator={"backend": "sglang", "engine_url": sglang_contract},
                      sampling={"max_new_tokens": 5, "temperature": 0.6, "top_p": 0.9, "top_k": 20})
    backend = SGLangBackend(cfg)
    await backend.start()
    try:
        result = await backend.generate(GenRequest(prompt_id="p1", messages=MSGS))
        SGLangContract.fail_first = 1
        with pytest.raises(Exception, match="HTTP 503"):
            await backend.generate(GenRequest(prompt_id="p2", messages=MSGS, attempt=1))
        await backend.generate(GenRequest(prompt_id="p2", messages=MSGS, attempt=2))
    finally:
        await backend.close()
    tok = load_tokenizer(str(target_dir))
    expected_ids = tok(render_prompt(tok, MSGS, False), add_special_tokens=False)["input_ids"]
    first = SGLangContract.requests[0]
    assert first["input_ids"] == expected_ids  # token ids in: the target's own template, rendered locally
    assert first["sampling_params"] == {"max_new_tokens": 5, "temperature": 0.6, "top_p": 0.9, "top_k": 20,
                                        "skip_special_tokens": True}
    rids = [r["rid"] for r in SGLangContract.requests]
    assert len(set(rids)) == 3  # a retry never reuses a request id
    assert result.output_ids is not None and result.completion_tokens == len(result.output_ids)
    expected_reason = "stop" if len(expected_ids) % 2 == 0 else "length"
    assert result.finish_reason == expected_reason
    assert result.spec_accept_length == pytest.approx(result.completion_tokens / 2)


def test_sglang_response_parsing_is_strict():
    ok = parse_generate_response({"text": "hi", "output_ids": [5, 2], "meta_info": {
        "finish_reason": {"type": "length", "length": 2}, "prompt_tokens": 7, "completion_tokens": 2,
        "spec_accept_length": 1.8}}, 7)
    assert (ok.finish_reason, ok.output_ids, ok.spec_accept_length) == ("length", [5, 2], 1.8)
    with pytest.raises(ValueError, match="unexpected /generate response"):
        parse_generate_response({"error": "boom"}, 3)


@pytest.mark.gpu
async def test_sglang_real_server(stack, target_dir):
    torch = pytest.importorskip("torch")
    pytest.importorskip("sglang")
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    port = free_port()
    cfg = make_config(stack, generator={"backend": "sglang", "engine_url": f"http://127.0.0.1:{port}", "launch": True},
                      sampling={"max_new_tokens": 16, "temperature": 0.0})
    backend = SGLangBackend(cfg, gpus=GpuGroup((0,)))
    await backend.start()
    try:
        r = await backend.generate(GenRequest(prompt_id="g", messages=MSGS))
    finally:
        await backend.close()
    tok = load_tokenizer(str(target_dir))
    assert r.output_ids and r.completion_tokens == len(r.output_ids)
    if r.finish_reason == "stop":
        assert r.output_ids[-1] == tok.eos_token_id  # the stop token is kept in the ids
    assert tok.decode(r.output_ids, skip_special_tokens=True).strip() == r.text.strip()
    assert msgspec.json.decode(msgspec.json.encode(r), type=GenResult) == r  # the result survives the wire


def test_a_template_that_cannot_render_one_message_stops_the_backend_at_start(target_dir):
    """A broken template would refuse every prompt (each a dead letter within seconds): the backends check one
    plain message at start instead. SmolLM2's own template passes."""
    import copy

    from services.generator.backends import check_template

    tok = load_tokenizer(str(target_dir))
    check_template(tok, False)
    broken = copy.deepcopy(tok)
    broken.chat_template = "{{ raise_exception('this template is unfinished') }}"
    with pytest.raises(RuntimeError, match=r"cannot render a one-message conversation.*this template is unfinished"):
        check_template(broken, False)
