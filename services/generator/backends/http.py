"""The HTTP plumbing both server backends share: one pooled client, errors sorted into retry (EngineError:
transient) or refuse (PromptRefused: poison), see shared.failures."""

from __future__ import annotations

from typing import Any

import httpx

from shared.failures import GaveUp, retry_async

from .base import EngineError, PromptRefused

RETRYABLE_STATUS = {408, 409, 425, 429}


class EngineClient:
    def __init__(self, base_url: str, timeout_s: float, max_connections: int, api_key: str = "") -> None:
        if not base_url:
            raise ValueError("generator.engine_url is required for this backend (e.g. http://127.0.0.1:30000)")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.base_url = base_url.rstrip("/")
        self.http = httpx.AsyncClient(
            base_url=self.base_url, timeout=httpx.Timeout(timeout_s, connect=10.0), headers=headers,
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
        )

    async def post(self, path: str, body: dict[str, Any]) -> Any:
        try:
            resp = await self.http.post(path, json=body)
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
