"""The HTTP plumbing both server backends share: one pooled client, errors sorted into retry or refuse."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx

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
        """Poll `path` until it answers 200, or raise EngineError naming the last failure."""
        end = time.monotonic() + deadline_s
        last = "no answer"
        while time.monotonic() < end:
            try:
                resp = await self.http.request(method, path, timeout=10.0)
                if resp.status_code == 200:
                    return
                last = f"HTTP {resp.status_code}"
            except httpx.HTTPError as e:
                last = f"{type(e).__name__}"
            await asyncio.sleep(1.0)
        raise EngineError(f"engine at {self.base_url}{path} not ready after {deadline_s:.0f}s ({last})")

    async def close(self) -> None:
        await self.http.aclose()
