"""Render a completion with the target's own chat template and find which characters the model generated.

No per-family strings: the layout of the regenerated assistant turn is read off the template
itself by rendering the conversation with sentinel strings in place of the answer (and the
reasoning), and comparing with the generation prompt:

    P    = template(messages, add_generation_prompt=True)          what the engine was given
    F_s  = template(messages + [assistant(SENTINEL)])               the same turn, rendered
    F_s  = P + pre + SENTINEL + post                                 (or P + open + R + close + SENTINEL + post)
    post = <text up to and including the first stop token> + tail

`pre` is scaffolding the template inserts by itself (an empty `<think></think>` block): mask 0.
`open`/`close` wrap the reasoning the model wrote itself: mask = train_on_reasoning. The stop
token (the tokenizer's eos / generation_config eos ids) ends the supervised span; `tail`
(e.g. the newline after `<|im_end|>`) is mask 0. A template for which `P` is not a prefix of
`F_s` as a string, whose own scaffolding after P does not tokenize to a token prefix continuation
(or whose stop token is not a token boundary), or that loses the answer or the stop token, raises
`TemplateError` when the renderer is built: it would give wrong masks.

Each sample is then rendered for real and checked against its layout (same prompt, same
scaffolding, answer and reasoning equal up to surrounding whitespace, which templates trim).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shared.messages import ChatMessage

CONTENT_SENTINEL = "dflashsentinelanswer"
REASONING_SENTINEL = "dflashsentinelreasoning"


class TemplateError(ValueError):
    """The chat template cannot give exact loss masks (prefix property or turn structure violated)."""


class RenderMismatch(ValueError):
    """One sample's real rendering does not fit its template layout (counted as a drop, not fatal)."""


class TemplateRaised(RenderMismatch):
    """The template itself refused one conversation (a `raise_exception` for roles it does not accept, a
    content type it cannot print): that sample is dropped with the template's message, the shard goes on."""


@dataclass(frozen=True)
class Layout:
    """Where the regenerated turn's pieces sit, relative to the end of the generation prompt."""

    pre: str  # scaffolding inserted by the template before the answer when no reasoning is rendered
    open: str  # before the reasoning (when rendered)
    close: str  # between reasoning and answer (when rendered)
    eot: str  # text after the answer up to and including the stop token: supervised
    tail: str  # after the stop token: not supervised


@dataclass(frozen=True)
class RenderedTurn:
    """One sample as consecutive text pieces: prompt | pre | head (reasoning) | answer (+ eot) | tail."""

    prompt: str  # the generation prompt P, byte for byte what the engine was given
    pre: str
    head: str  # open + reasoning + close, "" when no reasoning is rendered
    answer: str  # the rendered answer followed by the eot text
    eot: str  # the supervised text after the answer (ends with the stop token)
    tail: str


def stop_token_ids(tokenizer: Any) -> list[int]:
    """The ids that end a generation: the tokenizer's eos plus generation_config.json's eos ids."""
    ids: list[int] = []
    if tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    gen = Path(str(getattr(tokenizer, "name_or_path", ""))) / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        for i in eos if isinstance(eos, list) else [eos]:
            if i is not None and int(i) not in ids:
                ids.append(int(i))
    return ids


def _message_dict(m: ChatMessage) -> dict[str, Any]:
    d: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.reasoning:
        d["reasoning_content"] = m.reasoning  # transformers aliases it to `thinking`/`reasoning` too
    return d


def _first_token_difference(a: list[int], b: list[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))


class ChatRenderer:
    """The target tokenizer's template, with the layout of the regenerated turn derived from it."""

    def __init__(self, tokenizer: Any, *, enable_thinking: bool, render_reasoning: bool | None = None) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise TemplateError("the target tokenizer has no chat template")
        self.tok = tokenizer
        self.enable_thinking = enable_thinking
        # Reasoning is part of the sequence exactly when the target thinks while serving.
        self.render_reasoning = enable_thinking if render_reasoning is None else render_reasoning
        self.stop_ids = stop_token_ids(tokenizer)
        added = tokenizer.get_added_vocab()
        self.stop_strings = [s for s in tokenizer.convert_ids_to_tokens(self.stop_ids) if s in added]
        if not self.stop_strings:
            raise TemplateError(
                f"none of the stop token ids {self.stop_ids} is a special token of the tokenizer: "
                "cannot find the end of the assistant turn"
            )
        self._layouts: dict[tuple[Any, ...], Layout] = {}
        try:
            self.probe()
        except TemplateError:
            raise
        except Exception as e:  # the template is user code: one that does not compile or raises on a plain chat
            line = f" at line {e.lineno}" if isinstance(getattr(e, "lineno", None), int) else ""
            raise TemplateError(f"the chat template fails on a plain conversation{line}: {type(e).__name__}: {e}") from None

    # --- rendering ------------------------------------------------------------------------------

    def render(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool) -> str:
        return self.tok.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt,
            enable_thinking=self.enable_thinking,
        )

    def render_many(self, conversations: list[list[dict[str, Any]]], *, add_generation_prompt: bool) -> list[str]:
        """`render` for many conversations in one call (the template's per-call setup is paid once)."""
        return self.tok.apply_chat_template(
            conversations, tokenize=False, add_generation_prompt=add_generation_prompt,
            enable_thinking=self.enable_thinking,
        ) if conversations else []

    def encode(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def _assistant(self, content: str, reasoning: str | None) -> dict[str, Any]:
        d: dict[str, Any] = {"role": "assistant", "content": content}
        if reasoning is not None:
            d["reasoning_content"] = reasoning
        return d

    # --- the layout -----------------------------------------------------------------------------

    def layout_for(self, context: list[dict[str, Any]], with_reasoning: bool) -> tuple[str, Layout]:
        """(P, layout) for this context, from a sentinel rendering; TemplateError when the structure breaks."""
        prompt = self.render(context, add_generation_prompt=True)
        full = self.render(
            [*context, self._assistant(CONTENT_SENTINEL, REASONING_SENTINEL if with_reasoning else None)],
            add_generation_prompt=False,
        )
        if not full.startswith(prompt):
            at = _first_token_difference(list(prompt), list(full))
            raise TemplateError(
                "the generation prompt is not a prefix of the rendered conversation (prefix property violated) "
                f"at character {at}: prompt ends {prompt[max(0, at - 30):at + 30]!r}, "
                f"conversation has {full[max(0, at - 30):at + 30]!r}"
            )
        rest = full[len(prompt):]
        if rest.count(CONTENT_SENTINEL) != 1:
            raise TemplateError(f"the template renders the assistant answer {rest.count(CONTENT_SENTINEL)} times, not once")
        i = rest.index(CONTENT_SENTINEL)
        pre, open_, close = rest[:i], "", ""
        if with_reasoning:
            if rest.count(REASONING_SENTINEL) != 1 or rest.index(REASONING_SENTINEL) > i:
                raise TemplateError(
                    "thinking is on but the template does not render the assistant's reasoning "
                    "(reasoning_content/thinking/reasoning) once before the answer; "
                    "set sampling.enable_thinking to match how the target is served"
                )
            j = rest.index(REASONING_SENTINEL)
            pre, open_, close = "", rest[:j], rest[j + len(REASONING_SENTINEL):i]
        post = rest[i + len(CONTENT_SENTINEL):]
        hits = [(post.find(s), s) for s in self.stop_strings if s in post]
        if not hits:
            raise TemplateError(
                f"the assistant turn {post!r} after the answer holds no stop token ({self.stop_strings}): "
                "the end of turn cannot be supervised"
            )
        at, stop = min(hits)
        return prompt, Layout(pre=pre, open=open_, close=close, eot=post[:at + len(stop)], tail=post[at + len(stop):])

    def probe(self) -> None:
        """Check the template on canonical conversations, string and token prefix property included."""
        contexts = [
            [{"role": "user", "content": "What is 2 + 2?"}],
            [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
            [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
             {"role": "user", "content": "And now?"}],
        ]
        for context in contexts:
            prompt, lay = self.layout_for(context, self.render_reasoning)
            full = prompt + lay.pre + lay.open + (REASONING_SENTINEL if self.render_reasoning else "") + lay.close
            full += CONTENT_SENTINEL + lay.eot + lay.tail
            # Template-owned text must tokenize cleanly after the prompt, and the end of turn must be a token
            # boundary. The answer boundary needs no such check: the answer is tokenized after the prompt's
            # tokens, the way the engine generated it (see samples.py).
            checks = [("end-of-turn", full[: len(full) - len(lay.tail)], full)]
            if lay.pre or lay.open:
                checks.append(("generation prompt", prompt, prompt + lay.pre + lay.open))
            for name, piece, whole in checks:
                ids = self.encode(whole)
                pids = self.encode(piece)
                if ids[: len(pids)] != pids:
                    at = _first_token_difference(pids, ids)
                    raise TemplateError(
                        f"the {name} does not tokenize to a token prefix of the conversation (prefix property "
                        f"violated) at token {at}: {self.tok.convert_ids_to_tokens(pids[at:at + 3])} vs "
                        f"{self.tok.convert_ids_to_tokens(ids[at:at + 3])}"
                    )

    # --- one sample -----------------------------------------------------------------------------

    def turns(self, items: list[tuple[list[ChatMessage], str, str | None]]) -> list[RenderedTurn | RenderMismatch]:
        """Render completions (messages, content, reasoning) and split each into its pieces; a RenderMismatch
        in place of a turn that does not fit its layout. One batched template call per kind for all of them."""
        if not items:
            return []
        contexts = [[_message_dict(m) for m in messages] for messages, _, _ in items]
        reasonings = [reasoning if self.render_reasoning and reasoning else None for _, _, reasoning in items]
        prompts = self._render_each(contexts, add_generation_prompt=True)
        fulls = self._render_each([[*c, self._assistant(content, r)] for c, (_, content, _), r
                                   in zip(contexts, items, reasonings, strict=True)], add_generation_prompt=False)
        out: list[RenderedTurn | RenderMismatch] = []
        for context, (_, content, _), reasoning, prompt, full in zip(contexts, items, reasonings, prompts, fulls,
                                                                     strict=True):
            if isinstance(prompt, TemplateRaised) or isinstance(full, TemplateRaised):
                out.append(prompt if isinstance(prompt, TemplateRaised) else full)
                continue
            try:
                out.append(self._fit(context, prompt, full, content, reasoning))
            except RenderMismatch as e:
                out.append(e)
        return out

    def _render_each(self, conversations: list[list[dict[str, Any]]], *,
                     add_generation_prompt: bool) -> list[str | TemplateRaised]:
        """`render_many`, except that a conversation the template raises on gets a TemplateRaised in its place
        (the batch is rendered again one by one to find which), so one bad prompt never fails its shard."""
        try:
            return list(self.render_many(conversations, add_generation_prompt=add_generation_prompt))
        except Exception:  # the template is user code: anything it raises is one sample's drop
            pass
        out: list[str | TemplateRaised] = []
        for conversation in conversations:
            try:
                out.append(self.render(conversation, add_generation_prompt=add_generation_prompt))
            except Exception as e:
                out.append(TemplateRaised(f"the chat template raised {type(e).__name__}: {e}"))
        return out

    def turn(self, messages: list[ChatMessage], content: str, reasoning: str | None) -> RenderedTurn:
        """One completion's pieces; RenderMismatch if it does not fit the layout."""
        turn = self.turns([(messages, content, reasoning)])[0]
        if isinstance(turn, RenderMismatch):
            raise turn
        return turn

    def _fit(self, context: list[dict[str, Any]], prompt: str, full: str, content: str,
             reasoning: str | None) -> RenderedTurn:
        key = (reasoning is not None, tuple(m["role"] for m in context))
        layout = self._layouts.get(key)
        try:
            if layout is None:
                raise RenderMismatch("no layout yet")
            return self._split(prompt, full, layout, content, reasoning)
        except RenderMismatch:
            # The template may depend on the conversation: derive this sample's own layout and retry.
            prompt_s, layout = self.layout_for(context, reasoning is not None)
            if prompt_s != prompt:
                raise RenderMismatch("the generation prompt renders differently twice") from None
            turn = self._split(prompt, full, layout, content, reasoning)
            self._layouts[key] = layout
            return turn

    def _split(self, prompt: str, full: str, lay: Layout, content: str, reasoning: str | None) -> RenderedTurn:
        post = lay.eot + lay.tail
        head_start = len(prompt) + len(lay.pre)
        if not (full.startswith(prompt + lay.pre) and full.endswith(post) and len(full) - len(post) >= head_start):
            raise RenderMismatch("the rendered turn does not fit the template's layout")
        middle = full[head_start: len(full) - len(post)]
        if reasoning is None:
            if middle.strip() != content.strip():
                raise RenderMismatch("the rendered answer differs from the completion beyond whitespace")
            return RenderedTurn(prompt, lay.pre, "", middle + lay.eot, lay.eot, lay.tail)
        if not middle.startswith(lay.open):
            raise RenderMismatch("the rendered reasoning does not start with the template's opening")
        body = middle[len(lay.open):]
        at = body.find(lay.close)
        while at >= 0:
            answer = body[at + len(lay.close):]
            if answer.strip() == content.strip() and body[:at].strip() == reasoning.strip():
                head = lay.open + body[: at + len(lay.close)]
                return RenderedTurn(prompt, "", head, answer + lay.eot, lay.eot, lay.tail)
            at = body.find(lay.close, at + 1)
        raise RenderMismatch("the rendered reasoning or answer differs from the completion beyond whitespace")
