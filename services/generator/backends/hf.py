"""In-process transformers, batched: requests that arrive together share one `generate()` call.

The model runs in one worker thread (the event loop stays free for heartbeats and acks); while a
batch generates, the next requests queue up and go out together as soon as it returns.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

from shared.config import Config
from shared.gpus import GpuGroup, LayoutError
from shared.service import startup_thread

from .base import GenRequest, GenResult, PromptRefused, check_template, render_prompt, split_reasoning

log = logging.getLogger("dflash.generator.hf")

BATCH_WAIT_S = 0.02


class HFBackend:
    engine = "hf"

    def __init__(self, cfg: Config, *, gpus: GpuGroup | None = None) -> None:
        self.cfg = cfg
        self.model = cfg.model.target
        self.device = cfg.model.device
        if gpus is not None:
            if gpus.tp > 1:
                raise LayoutError(f"GPUs {gpus.visible_devices}: the hf backend runs one GPU per engine; a group "
                                  "(tensor parallelism) needs --backend sglang")
            self.device = f"cuda:{gpus.gpus[0]}"
        self.batch_size = max(1, cfg.generator.batch_size)
        self._queue: asyncio.Queue[tuple[GenRequest, list[int], asyncio.Future[GenResult]]] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None
        self._lock = threading.Lock()
        self._batches = 0

    async def start(self) -> None:
        await startup_thread(self._load)  # a stop signal during the load need not wait for it
        self._task = asyncio.create_task(self._batcher())

    def _load(self) -> None:
        import torch

        from shared.model import load_causal_lm, load_tokenizer

        if self.device == "auto":
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.tok = load_tokenizer(self.model)
        check_template(self.tok, self.cfg.sampling.enable_thinking)
        self.tok.padding_side = "left"
        self.lm = load_causal_lm(self.model, device=self.device)
        eos = self.lm.generation_config.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos if eos is not None else self.tok.eos_token_id])
        self.pad_id = self.tok.pad_token_id if self.tok.pad_token_id is not None else min(self.eos_ids)

    async def close(self) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        while not self._queue.empty():
            _, _, fut = self._queue.get_nowait()
            if not fut.done():
                fut.cancel()

    async def generate(self, req: GenRequest) -> GenResult:
        ids = await asyncio.to_thread(self.prompt_ids, req)  # a refused prompt fails here, alone, not its batch
        fut: asyncio.Future[GenResult] = asyncio.get_running_loop().create_future()
        await self._queue.put((req, ids, fut))
        return await fut

    async def _batcher(self) -> None:
        while True:
            batch = [await self._queue.get()]
            # Requests freed by the previous batch come back a few loop turns apart: give them a
            # moment (BATCH_WAIT_S, small next to a generate() call) to join instead of splitting.
            loop = asyncio.get_running_loop()
            deadline = loop.time() + BATCH_WAIT_S
            while len(batch) < self.batch_size:
                if not self._queue.empty():
                    batch.append(self._queue.get_nowait())
                elif loop.time() < deadline:
                    await asyncio.sleep(0.002)  # polling: a cancelled get() could drop a request
                else:
                    break
            live = [(r, ids, f) for r, ids, f in batch if not f.cancelled()]
            if not live:
                continue
            try:
                results = await asyncio.to_thread(self.generate_batch, [r for r, _, _ in live], [i for _, i, _ in live])
            except Exception as e:
                if len(live) == 1:
                    results = [e]
                else:  # isolate the request that broke the batch: the others must not fail with it
                    log.warning("batch of %d failed (%s); retrying one by one", len(live), e)
                    results = []
                    for r, ids, _ in live:
                        try:
                            results.extend(await asyncio.to_thread(self.generate_batch, [r], [ids]))
                        except Exception as one:
                            results.append(one)
            for (_, _, fut), res in zip(live, results, strict=True):
                if fut.done():
                    continue
                if isinstance(res, BaseException):
                    fut.set_exception(res)
                else:
                    fut.set_result(res)

    def prompt_ids(self, req: GenRequest) -> list[int]:
        """The prompt's ids; PromptRefused when the template refuses it or it cannot fit the context."""
        text = render_prompt(self.tok, req.messages, self.cfg.sampling.enable_thinking)
        ids = self.tok(text, add_special_tokens=False)["input_ids"]
        limit, new = self.context_limit, self.cfg.sampling.max_new_tokens
        if limit and len(ids) + new > limit:
            raise PromptRefused(f"prompt of {len(ids)} tokens + max_new_tokens {new} exceeds the context limit of {limit}")
        return ids

    @property
    def context_limit(self) -> int:
        return self.cfg.generator.max_context_tokens or int(getattr(self.lm.config, "max_position_embeddings", 0))

    def generate_batch(self, reqs: list[GenRequest], prompts: list[list[int]]) -> list[GenResult]:
        """Blocking: one padded `generate()` for the whole batch of prompt ids (called from a worker thread)."""
        import torch

        s = self.cfg.sampling
        width = max(map(len, prompts))
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):  # left padding: every prompt ends where generation starts
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        kwargs: dict[str, Any] = dict(max_new_tokens=s.max_new_tokens, pad_token_id=self.pad_id,
                                      eos_token_id=sorted(self.eos_ids))
        if s.temperature > 0:
            kwargs.update(do_sample=True, temperature=s.temperature, top_p=s.top_p,
                          top_k=s.top_k if s.top_k > 0 else 0)
        else:
            kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        with self._lock, torch.inference_mode():
            torch.manual_seed(s.seed + self._batches)  # reproducible for a given batch order
            self._batches += 1
            out = self.lm.generate(input_ids=ids.to(self.device), attention_mask=mask.to(self.device), **kwargs)
        results = []
        for i, p in enumerate(prompts):
            gen = out[i, width:].tolist()
            stop = next((j for j, t in enumerate(gen) if t in self.eos_ids), None)
            emitted = gen[: stop + 1] if stop is not None else gen[: s.max_new_tokens]
            body = emitted[:-1] if stop is not None else emitted
            text = self.tok.decode(body, skip_special_tokens=True)
            answer, reasoning = split_reasoning(text) if s.enable_thinking else (text, None)
            results.append(GenResult(
                text=answer, reasoning=reasoning, output_ids=emitted, prompt_tokens=len(p),
                completion_tokens=len(emitted), finish_reason="stop" if stop is not None else "length",
            ))
        return results
