"""The HTTP plumbing both server backends share: pooled clients, errors sorted into retry (EngineError:
transient) or refuse (PromptRefused: poison), see shared.failures.

Generation requests go round-robin over several small connection pools (POOL_SIZE connections each), not one
big one: httpcore matches waiting requests to connections by scanning its whole pool on every event, which
at hundreds of requests in flight cost more CPU than everything else the generator does (measured: 10.9 s
of 25 s busy for 200 completions at ~100 in flight)."""

from __future__ import annotations

import itertools
import math
import ssl
from typing import Any

import httpx

from shared.failures import GaveUp, retry_async

from .base import EngineError, PromptRefused

RETRYABLE_STATUS = {408, 409, 425, 429}
POOL_SIZE = 16


class EngineClient:
    def __init__(self, base_url: str, timeout_s: float, max_connections: int, api_key: str = "") -> None:
        if not base_url:
            raise ValueError("generator.engine_url is required for this backend (e.g. http://127.0.0.1:30000)")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.base_url = base_url.rstrip("/")
        tls = ssl.create_default_context()  # once: each client would load the CA bundle again (~0.2 s each)

        def pool(n: int) -> httpx.AsyncClient:
            return httpx.AsyncClient(
                base_url=self.base_url, timeout=httpx.Timeout(timeout_s, connect=10.0), headers=headers, verify=tls,
                limits=httpx.Limits(max_connections=n, max_keepalive_connections=n))

        self.pools = [pool(POOL_SIZE) for _ in range(max(1, math.ceil(max_connections / POOL_SIZE)))]
        self.next_pool = itertools.cycle(self.pools)
        self.http = pool(4)  # health, reports, aborts: never queued behind generations

    async def post(self, path: str, body: dict[str, Any]) -> Any:
        try:
            resp = await next(self.next_pool).post(path, json=body)
        except httpx.TimeoutException as e:
            raise EngineError(f"POST {path}: timed out ({type(e).__name__})") from None
        except httpx.TransportError as e:
            raise EngineError(f"POST {path}: {type(e).__name__}: {e}") from None
        if resp.status_code >= 500 or resp.status_code in RETRYABLE_STATUS:
            raise EngineError(f"POST {path}: HTTP {resp.status_code}: {resp.text[:300]}")
        if resp.status_code >= 400:
            raise PromptRefused(f"POST {path}: HTTP {resp.status_code}: {resp.text[:500]}")
        try:
            return resp.json()
        except ValueError:
            raise EngineError(f"POST {path}: response is not JSON: {resp.text[:200]!r}") from None

    async def get(self, path: str, timeout_s: float = 2.0) -> httpx.Response:
        """A GET for the engine's own reports (/metrics, /get_server_info): a short timeout, since a slow report
        must not hold up the loop that reads it; EngineError names the URL and what went wrong."""
        try:
            return await self.http.get(path, timeout=timeout_s)
        except httpx.TimeoutException:
            raise EngineError(f"engine at {self.base_url}: GET {path} took longer than {timeout_s:g}s") from None
        except httpx.TransportError as e:
            raise EngineError(f"engine at {self.base_url}: GET {path}: {type(e).__name__}: {e}") from None

    async def wait_ready(self, path: str, deadline_s: float, method: str = "GET") -> None:
        """Poll `path` until it answers 200 (retried under the failure policy), or raise EngineError naming the
        last failure."""

        async def probe() -> None:
            try:
                resp = await self.http.request(method, path, timeout=10.0)
            except httpx.HTTPError as e:
                raise EngineError(type(e).__name__) from None
            if resp.status_code != 200:
                raise EngineError(f"HTTP {resp.status_code}")

        try:
            await retry_async(f"engine at {self.base_url}{path}", probe, deadline_s=deadline_s)
        except GaveUp as e:
            raise EngineError(f"engine at {self.base_url}{path} not ready after {deadline_s:.0f}s ({e.last})") from None

    async def close(self) -> None:
        await self.http.aclose()
        for p in self.pools:
            await p.aclose()
