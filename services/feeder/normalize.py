"""One normalized conversation per input record, whatever shape the record came in.

Accepted shapes (first match wins):
- OpenAI: `{"messages": [{"role", "content"}, ...]}`; content may be a string or a list of
  `{"type": "text", "text": ...}` parts (non-text parts are rejected).
- ShareGPT: `{"conversations": [{"from", "value"}, ...]}` with from = human|user|gpt|assistant|
  chatgpt|bard|bing|model|system|tool|function|observation.
- Plain: `{"prompt": "..."}` (optional `"system"`).
- Alpaca: `{"instruction": "...", "input": "..."}` (input optional; optional `"system"`).

Multi-turn policy: the pipeline regenerates the *last* assistant turn. A conversation that ends
with an assistant turn has that turn removed (it is the one regenerated); everything before it
is kept as context, earlier assistant turns included, as the source wrote them. After that the
conversation must end with a user (or tool) turn, else it is rejected.

Normalization for the prompt id: Unicode NFC, `\\r\\n` → `\\n`, surrounding whitespace stripped
from every content; the id is the sha256 of the canonical JSON of [[role, content], ...], cut to
32 hex digits (128 bits), so the same conversation always gets the same id in every run.
"""

from __future__ import annotations

import hashlib
import unicodedata
from typing import Any

import msgspec

from shared.messages import ChatMessage

from .reasons import Reason

ROLE_ALIASES = {
    "system": "system", "user": "user", "human": "user", "assistant": "assistant", "gpt": "assistant",
    "chatgpt": "assistant", "bard": "assistant", "bing": "assistant", "model": "assistant", "tool": "tool",
    "function": "tool", "observation": "tool", "ipython": "tool",
}

_canonical = msgspec.json.Encoder()


class RejectedRecord(ValueError):
    """A record the feeder cannot use; the message is the reason written to rejects.jsonl, `code` what it is counted as."""

    def __init__(self, code: Reason, message: str) -> None:
        self.code = code
        super().__init__(message)


class UnknownShape(RejectedRecord):
    """An object with none of the four shapes' fields: a file made only of these is refused once, not per record."""

    def __init__(self, keys: list[str]) -> None:
        self.keys = keys
        shown = ", ".join(keys[:8]) or "none"
        super().__init__(Reason.UNKNOWN_SHAPE, f"no messages, conversations, prompt or instruction field (keys: {shown})")


def _text(value: Any, where: str) -> str:
    if isinstance(value, str):
        text = value
    elif isinstance(value, list):  # OpenAI content parts
        parts = []
        for part in value:
            if not isinstance(part, dict) or part.get("type", "text") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise RejectedRecord(Reason.CONTENT_NOT_TEXT, f"{where}: unsupported content part {kind!r} (only text parts)")
            parts.append(part["text"])
        text = "".join(parts)
    elif value is None:
        raise RejectedRecord(Reason.MISSING_CONTENT, f"{where}: missing content")
    else:
        raise RejectedRecord(Reason.CONTENT_NOT_TEXT, f"{where}: content must be a string, not {type(value).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # a JSON escape of half a surrogate pair: no Unicode text, no prompt
        raise RejectedRecord(Reason.INVALID_UNICODE, f"{where}: content is not valid Unicode (a lone surrogate escape)") from None
    text = unicodedata.normalize("NFC", text.replace("\r\n", "\n")).strip()
    if not text:
        raise RejectedRecord(Reason.EMPTY_CONTENT, f"{where}: empty content")
    return text


def _turns(items: Any, role_key: str, content_key: str, field: str) -> list[ChatMessage]:
    if not isinstance(items, list) or not items:
        raise RejectedRecord(Reason.BAD_TURNS, f"{field!r} must be a non-empty list")
    out = []
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise RejectedRecord(Reason.BAD_TURNS, f"{field}[{i}] must be an object")
        raw_role = item.get(role_key)
        role = ROLE_ALIASES.get(str(raw_role).lower()) if isinstance(raw_role, str) else None
        if role is None:
            raise RejectedRecord(Reason.UNKNOWN_ROLE, f"{field}[{i}]: unknown role {raw_role!r}")
        content = item.get(content_key)
        if role == "assistant" and i == len(items) - 1:
            # the turn to regenerate: its content is not needed and may be empty
            out.append(ChatMessage(role="assistant", content=""))
            continue
        out.append(ChatMessage(role=role, content=_text(content, f"{field}[{i}]")))
    return out


def _with_system(record: dict[str, Any], user: str) -> list[ChatMessage]:
    msgs = []
    if record.get("system") not in (None, ""):
        msgs.append(ChatMessage(role="system", content=_text(record["system"], "system")))
    msgs.append(ChatMessage(role="user", content=user))
    return msgs


def normalize(record: Any) -> list[ChatMessage]:
    """The conversation to complete (ending with a user/tool turn), or RejectedRecord saying why."""
    if not isinstance(record, dict):
        raise RejectedRecord(Reason.NOT_OBJECT, f"record must be a JSON object, not {type(record).__name__}")
    if "messages" in record:
        msgs = _turns(record["messages"], "role", "content", "messages")
    elif "conversations" in record:
        msgs = _turns(record["conversations"], "from", "value", "conversations")
    elif "prompt" in record:
        msgs = _with_system(record, _text(record["prompt"], "prompt"))
    elif "instruction" in record:
        instruction = _text(record["instruction"], "instruction")
        extra = record.get("input")
        user = f"{instruction}\n\n{_text(extra, 'input')}" if isinstance(extra, str) and extra.strip() else instruction
        msgs = _with_system(record, user)
    else:
        raise UnknownShape(sorted(map(str, record)))
    if msgs and msgs[-1].role == "assistant":
        msgs.pop()  # regenerated: see the multi-turn policy above
    if not msgs:
        raise RejectedRecord(Reason.NO_USER_TURN, "nothing before the assistant turn")
    if msgs[-1].role not in ("user", "tool"):
        raise RejectedRecord(Reason.BAD_LAST_TURN, f"conversation must end with a user turn, not {msgs[-1].role}")
    if all(m.role == "system" for m in msgs):
        raise RejectedRecord(Reason.NO_USER_TURN, "no user turn")
    return msgs


def prompt_id(messages: list[ChatMessage]) -> str:
    canonical = _canonical.encode([[m.role, m.content] for m in messages])
    return hashlib.sha256(canonical).hexdigest()[:32]
