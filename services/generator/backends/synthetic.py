"""`--backend synthetic`: a load generator for benchmarks and tests — never a default, never training data.

It answers every prompt at once (or at `generator.synthetic_rate` completions/s per worker) with a
deterministic pseudo-completion: token ids drawn from the target tokenizer's plain-word tokens, seeded by
the prompt_id (a redelivered prompt gets the same answer), `synthetic_min_tokens`..`synthetic_max_tokens`
long (uniform; default 40..80 tokens: above the tokenizer's default minimum of 2 × block_size supervised
tokens, small enough that a 914K-prompt run tokenizes in minutes on 2 cores), ending with the end-of-turn
token as SGLang returns it. The record is token-exact like the sglang backend's (`output_ids` + the
decoded text), so shards, events, the tokenizer and the trainer's data run unchanged.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
import time
from typing import Any

from shared.config import Config
from shared.gpus import GpuGroup
from shared.service import startup_thread

from .base import GenRequest, GenResult, check_template, render_prompt


def word_token_ids(tok: Any, limit: int = 4096) -> list[int]:
    """Ids of tokens that are one lowercase word with its leading space (they decode and re-tokenize
    as themselves in running text, so the answers are plain and seldom drift)."""
    words = []
    for piece, i in tok.get_vocab().items():
        text = piece[1:] if piece.startswith("Ġ") else None  # byte-level BPE's leading space
        if text and 3 <= len(text) <= 8 and text.isascii() and text.isalpha() and text.islower():
            words.append(i)
    if len(words) < 64:
        raise RuntimeError("synthetic backend: the target tokenizer has too few plain-word tokens to draw from")
    return sorted(words)[:limit]


class SyntheticBackend:
    engine = "synthetic"

    def __init__(self, cfg: Config, *, gpus: GpuGroup | None = None) -> None:
        g = cfg.generator
        if not 1 <= g.synthetic_min_tokens <= g.synthetic_max_tokens:
            raise ValueError(f"generator.synthetic_min_tokens ({g.synthetic_min_tokens}) must be >= 1 and <= "
                             f"generator.synthetic_max_tokens ({g.synthetic_max_tokens})")
        if g.synthetic_rate < 0:
            raise ValueError(f"generator.synthetic_rate = {g.synthetic_rate}: completions/s per worker, 0 for no limit")
        self.cfg = cfg
        self.model = f"synthetic:{cfg.model.target}"
        self.tok: Any = None
        self.words: list[int] = []
        self.stop_id = 0
        self._next_slot = 0.0  # the rate limit's next free start time (monotonic)

    async def start(self) -> None:
        from shared.model import load_tokenizer

        self.tok = await startup_thread(load_tokenizer, self.cfg.model.target)
        check_template(self.tok, self.cfg.sampling.enable_thinking)
        self.words = word_token_ids(self.tok)
        self.stop_id = self.tok.eos_token_id

    async def close(self) -> None:
        return None

    def completion_ids(self, prompt_id: str) -> list[int]:
        """The prompt's pseudo-completion, the stop token included (as SGLang's output_ids keep it)."""
        g = self.cfg.generator
        rng = random.Random(hashlib.sha256(prompt_id.encode()).digest())
        n = rng.randint(g.synthetic_min_tokens, g.synthetic_max_tokens)
        return [rng.choice(self.words) for _ in range(n - 1)] + [self.stop_id]

    def _result(self, req: GenRequest) -> GenResult:
        prompt = render_prompt(self.tok, req.messages, self.cfg.sampling.enable_thinking)
        ids = self.completion_ids(req.prompt_id)
        return GenResult(text=self.tok.decode(ids[:-1]), output_ids=ids,
                         prompt_tokens=len(self.tok(prompt, add_special_tokens=False)["input_ids"]),
                         completion_tokens=len(ids), finish_reason="stop")

    async def _pace(self) -> None:
        rate = self.cfg.generator.synthetic_rate
        if rate <= 0:
            return
        now = time.monotonic()
        start = max(now, self._next_slot)
        self._next_slot = start + 1.0 / rate
        if start > now:
            await asyncio.sleep(start - now)

    async def generate(self, req: GenRequest) -> GenResult:
        await self._pace()
        return await asyncio.to_thread(self._result, req)  # template + tokenizer: off the loop
