"""What every inference backend shares: the request and result, the errors, the interface, and chat rendering."""

from __future__ import annotations

from typing import Any, Protocol

import msgspec

from shared.failures import Failure
from shared.messages import ChatMessage


class GenRequest(msgspec.Struct, kw_only=True):
    prompt_id: str
    messages: list[ChatMessage]
    attempt: int = 1


class GenResult(msgspec.Struct, kw_only=True):
    text: str
    reasoning: str | None = None
    output_ids: list[int] | None = None  # as emitted, the stop token included when the engine keeps it
    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str = "stop"
    spec_accept_length: float | None = None


class EngineError(RuntimeError):
    """A transient engine failure (timeout, 5xx, connection refused): retried with backoff."""

    failure = Failure.TRANSIENT


class PromptRefused(ValueError):
    """The engine refused this prompt itself (e.g. HTTP 400: too long): retrying will not help."""

    failure = Failure.POISON


class Backend(Protocol):
    """Built as `Kind(cfg, *, gpu)` by `make_backend` (backends/__init__.py's table)."""

    engine: str  # e.g. "hf", "sglang", "openai:vllm"
    model: str

    async def start(self) -> None: ...

    async def generate(self, req: GenRequest) -> GenResult: ...

    async def close(self) -> None: ...


def chat_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    return [{"role": m.role, "content": m.content} for m in messages]


def render_prompt(tokenizer: Any, messages: list[ChatMessage], enable_thinking: bool) -> str:
    """The conversation in the target's own chat template, ending with the assistant generation prompt.

    A template that raises on the conversation (roles it does not accept, as Llama-2/Mistral/Gemma
    templates do) refuses the prompt: it would raise on every redelivery, so it is a dead letter at once,
    with the template's message, as a server's HTTP 400 for the same prompt is."""
    try:
        return tokenizer.apply_chat_template(
            chat_dicts(messages), tokenize=False, add_generation_prompt=True, enable_thinking=enable_thinking
        )
    except Exception as e:  # the template is user code
        raise PromptRefused(f"the chat template refused the conversation: {type(e).__name__}: {e}") from None


def check_template(tokenizer: Any, enable_thinking: bool) -> None:
    """Refuse to start when the template cannot render one plain user message: every prompt would be
    refused and dead-lettered within seconds of the start, for a setup error (no template, a broken one)."""
    try:
        render_prompt(tokenizer, [ChatMessage(role="user", content="Hello.")], enable_thinking)
    except PromptRefused as e:
        raise RuntimeError(f"the target's chat template cannot render a one-message conversation ({e}): "
                           "fix the template (model.target) before generating") from None


def split_reasoning(text: str, open_tag: str = "<think>", close_tag: str = "</think>") -> tuple[str, str | None]:
    """(answer, reasoning) for an engine that returned a thinking block inline; (text, None) otherwise."""
    head, sep, tail = text.partition(close_tag)
    if not sep:
        return text, None
    reasoning = head.split(open_tag, 1)[-1].strip()
    return tail.lstrip("\n"), reasoning
