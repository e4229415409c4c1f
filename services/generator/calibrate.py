"""`dfpipe calibrate`: real numbers before committing days of GPUs.

A sample of the run's own prompts goes through each engine at rising fixed concurrencies (1, 2, 4, ...) until
tokens/s stops rising (two levels in a row without a 5% rise over the best so far: one may be a noisy dip);
then the knee (the lowest concurrency within 5% of the peak) is narrowed by bisection between the last level
below it and the first at it. Each level keeps exactly
`concurrency` requests in flight (a closed loop over the sample, cycled) for `rounds × concurrency` requests
(at least `min_requests`), and counts only its steady part: completion tokens finished between the
`concurrency`-th finish (the ramp is over) and the `concurrency`-th from last (the drain begins), over that
wall time. The engine is driven through the generator's own backend (sglang, openai or hf), so what is
measured is what the generator will meet.

With `--launch` and several layouts (`tp1`, `tp2`, `tp1+mtp`, ...) each layout's engines are started on the
same GPUs in turn (an SGLang server per group, as `dfpipe generate --launch` starts it, plus the engine's
speculative-decoding flags for `+mtp`), calibrated, and stopped; the layout with the most tokens/s over all
its engines is the one to run.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
import re
import statistics
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import msgspec

from shared.calibration import (
    KNEE_SHARE,
    Calibration,
    EngineCalibration,
    LayoutCalibration,
    Lengths,
    Level,
    knee_of,
)
from shared.config import Config
from shared.gpus import GpuGroup, LayoutError, parse_layout
from shared.messages import ChatMessage

from .backends import Backend, EngineError, GenRequest, GenResult, PromptRefused, make_backend

log = logging.getLogger("dflash.calibrate")

RISE = 0.05  # a level must beat the best so far by this much, or throughput has stopped rising


@dataclass
class Sweep:
    """How hard and how long one engine is driven."""

    start: int = 1
    max_concurrency: int = 1024
    rounds: int = 3  # requests per level = rounds × concurrency: one round of ramp, one steady, one of drain
    min_requests: int = 8
    patience: int = 2  # levels in a row without a 5% rise before the sweep stops (one may be a noisy dip)
    refine: bool = True  # bisect the knee between the doubling levels


class _Done(msgspec.Struct):
    start: float
    end: float
    tokens: int
    truncated: bool


def _quantile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


async def run_level(backend: Backend, prompts: list[list[ChatMessage]], concurrency: int, requests: int,
                    offset: int = 0) -> tuple[Level, list[_Done], int]:
    """`requests` generations with exactly `concurrency` in flight; (the level, every finished request, errors)."""
    order = itertools.cycle(range(len(prompts)))
    for _ in range(offset % len(prompts)):
        next(order)
    started = 0
    done: list[_Done] = []
    errors = 0

    async def worker(w: int) -> None:
        nonlocal started, errors
        while started < requests:
            started += 1
            i = next(order)
            t = time.monotonic()
            try:
                r: GenResult = await backend.generate(GenRequest(prompt_id=f"calibrate-{i}", messages=prompts[i],
                                                                 attempt=started))
            except (EngineError, PromptRefused) as e:
                errors += 1
                log.warning("calibration request failed: %s", e)
                continue
            done.append(_Done(t, time.monotonic(), r.completion_tokens, r.finish_reason == "length"))

    await asyncio.gather(*(worker(w) for w in range(concurrency)))
    if not done:
        raise EngineError(f"all {requests} requests at concurrency {concurrency} failed")
    finishes = sorted(done, key=lambda d: d.end)
    a = min(concurrency, len(finishes)) - 1  # the ramp is over at the concurrency-th finish
    b = len(finishes) - concurrency - 1  # the last request starts at the (n - concurrency)-th finish: the drain
    window = finishes[b].end - finishes[a].end if b > a else 0.0
    if b - a >= max(2, concurrency // 2) and window > 0:  # a steady part of at least half a round
        tokens = sum(d.tokens for d in finishes[a + 1:b + 1])
    else:  # too few to have a steady part: the whole level
        window = max(1e-9, finishes[-1].end - min(d.start for d in done))
        tokens = sum(d.tokens for d in done)
    latencies = [d.end - d.start for d in done]
    level = Level(concurrency=concurrency, requests=len(done), tokens_per_s=tokens / window,
                  latency_mean_s=statistics.fmean(latencies), latency_p50_s=_quantile(latencies, 0.5),
                  latency_p90_s=_quantile(latencies, 0.9))
    log.info("concurrency %d: %.1f tokens/s over %d requests (latency p50 %.2fs)", concurrency, level.tokens_per_s,
             len(done), level.latency_p50_s)
    return level, done, errors


async def calibrate_engine(backend: Backend, name: str, prompts: list[list[ChatMessage]], sweep: Sweep,
                           say: Callable[[str], None] = print) -> EngineCalibration:
    """One engine's sweep: levels up to where tokens/s stops rising, then the knee narrowed."""
    levels: dict[int, Level] = {}
    finished: list[_Done] = []
    errors = 0
    offset = 0

    async def measure(c: int) -> Level:
        nonlocal errors, offset
        n = max(sweep.min_requests, sweep.rounds * c)
        level, done, errs = await run_level(backend, prompts, c, n, offset)
        offset += n
        levels[c] = level
        finished.extend(done)
        errors += errs
        say(f"  {name}: concurrency {c:>5}: {level.tokens_per_s:10.1f} tokens/s, latency p50 "
            f"{level.latency_p50_s:.2f}s p90 {level.latency_p90_s:.2f}s ({level.requests} requests)")
        return level

    c, best, flat = sweep.start, 0.0, 0
    while c <= sweep.max_concurrency and flat < sweep.patience:
        level = await measure(c)
        flat = flat + 1 if level.tokens_per_s < best * (1 + RISE) else 0
        best = max(best, level.tokens_per_s)
        c *= 2
    peak, _, knee = knee_of(list(levels.values()))
    if sweep.refine:  # between the highest level below the knee's share and the knee
        while True:
            below = [lv.concurrency for lv in levels.values()
                     if lv.concurrency < knee and lv.tokens_per_s < KNEE_SHARE * peak]
            lo = max(below, default=0)
            mid = (lo + knee) // 2
            if not below or knee - lo <= max(1, knee // 16) or mid in levels:
                break
            await measure(mid)
            peak, _, knee = knee_of(list(levels.values()))
    peak, best_c, knee = knee_of(list(levels.values()))
    tokens = [d.tokens for d in finished]
    ordered = sorted(levels.values(), key=lambda lv: lv.concurrency)
    return EngineCalibration(
        engine=name, levels=ordered, peak_tokens_per_s=peak, best_concurrency=best_c, knee=knee,
        latency_s=levels[knee], requests=len(finished), errors=errors,
        completion_tokens=Lengths(mean=statistics.fmean(tokens), p10=_quantile(tokens, 0.1),
                                  p50=_quantile(tokens, 0.5), p90=_quantile(tokens, 0.9), max=max(tokens)),
        truncation_rate=sum(d.truncated for d in finished) / len(finished),
    )


def sample_prompts(sources: list[str], cfg: Config, size: int, seed: int = 0) -> tuple[list[list[ChatMessage]], int]:
    """A uniform sample (reservoir, seeded) of the records the feeder would accept from `sources`, and how many
    such records there are (the job's size, for its ETA)."""
    from services.feeder.sources import accepted_prompts

    rng = random.Random(seed)
    sample: list[list[ChatMessage]] = []
    seen = 0
    for _, _, messages in accepted_prompts(sources, cfg):
        seen += 1
        if len(sample) < size:
            sample.append(messages)
        elif (j := rng.randrange(seen)) < size:
            sample[j] = messages
    if not sample:
        raise ValueError(f"no usable prompt in {', '.join(sources)}")
    return sample, seen


@dataclass(frozen=True)
class LayoutSpec:
    """`tp2` or `tp2+mtp`: a group size and whether the engine's speculative decoding (MTP) is on."""

    name: str
    tp: int
    mtp: bool


def parse_layouts(text: str) -> list[LayoutSpec]:
    out = []
    for item in (s.strip() for s in text.split(",") if s.strip()):
        m = re.fullmatch(r"tp(\d+)(\+mtp)?", item)
        if not m or int(m.group(1)) < 1:
            raise LayoutError(f"--layouts: {item!r} is not a layout (tp1, tp2, tp4+mtp, ...)")
        out.append(LayoutSpec(item, int(m.group(1)), bool(m.group(2))))
    if not out:
        raise LayoutError("--layouts names no layout")
    return out


# Starts one engine of a layout on a group (the i-th of the layout) and returns the backend that drives it.
EngineLauncher = Callable[[Config, LayoutSpec, GpuGroup, int], Awaitable[Backend]]


async def launch_sglang(cfg: Config, layout: LayoutSpec, group: GpuGroup, index: int) -> Backend:
    """The SGLang server `dfpipe generate --launch --gpus <group>` would start, with MTP flags for `+mtp`."""
    from services.pipeline.layout import DEFAULT_ENGINE_URL, with_port

    g = cfg.generator
    args = [*g.launch_args, *(cfg.calibrate.mtp_args if layout.mtp else [])]
    url = with_port(g.engine_url or DEFAULT_ENGINE_URL, index)
    gen = msgspec.structs.replace(g, backend="sglang", launch=True, launch_args=args, engine_url=url)
    backend = make_backend(msgspec.structs.replace(cfg, generator=gen), gpus=group)
    await backend.start()
    return backend


async def compare_layouts(cfg: Config, gpus: str, layouts: list[LayoutSpec], prompts: list[list[ChatMessage]],
                          sweep: Sweep, launcher: EngineLauncher = launch_sglang,
                          say: Callable[[str], None] = print) -> list[LayoutCalibration]:
    """Each layout on the same GPUs, its engines one after the other (each alone on its group)."""
    results = []
    for layout in layouts:
        groups = parse_layout(gpus, layout.tp)
        say(f"layout {layout.name}: {len(groups)} engine(s) on GPUs {' | '.join(g.visible_devices for g in groups)}")
        engines = []
        for i, group in enumerate(groups):
            backend = await launcher(cfg, layout, group, i)
            try:
                name = getattr(backend, "url", f"{backend.engine}:{group.visible_devices}")
                engines.append(await calibrate_engine(backend, name, prompts, sweep, say))
            finally:
                await backend.close()
        result = LayoutCalibration(name=layout.name, tp=layout.tp, mtp=layout.mtp,
                                   gpus=[g for grp in groups for g in grp.gpus], engines=engines)
        say(f"layout {layout.name}: {result.tokens_per_s:,.1f} tokens/s over {len(engines)} engine(s)")
        results.append(result)
    return results


def recommend(layouts: list[LayoutCalibration]) -> LayoutCalibration:
    """The layout to run: the most tokens/s over all its engines (a tie goes to the smaller groups: fault isolation)."""
    return max(layouts, key=lambda lc: (lc.tokens_per_s, -lc.tp))


def calibration_of(cfg: Config, backend_kind: str, prompts: int, engines: list[EngineCalibration],
                   layouts: list[LayoutCalibration] | None = None) -> Calibration:
    best = recommend(layouts) if layouts else None
    return Calibration(run=cfg.run, backend=backend_kind, max_new_tokens=cfg.sampling.max_new_tokens,
                       prompts_sampled=prompts, engines=best.engines if best else engines, layouts=layouts or [],
                       recommended=best.name if best else "")


def describe(c: Calibration, prompts_total: int | None = None) -> str:
    """The report: per engine, then the layouts compared, then the job's ETA when the prompt count is known."""
    lines = []
    for e in c.engines:
        lines.append(
            f"engine {e.engine}: peak {e.peak_tokens_per_s:,.1f} tokens/s at concurrency {e.best_concurrency}; knee "
            f"{e.knee} (lowest within {1 - KNEE_SHARE:.0%} of the peak); latency at the knee p50 "
            f"{e.latency_s.latency_p50_s:.2f}s p90 {e.latency_s.latency_p90_s:.2f}s; completion tokens mean "
            f"{e.completion_tokens.mean:,.0f} (p10 {e.completion_tokens.p10:,.0f}, p50 {e.completion_tokens.p50:,.0f}, "
            f"p90 {e.completion_tokens.p90:,.0f}, max {e.completion_tokens.max:,}); truncated at max_new_tokens "
            f"{c.max_new_tokens}: {e.truncation_rate:.1%}" + (f"; {e.errors} request(s) failed" if e.errors else ""))
    if c.layouts:
        for lc in sorted(c.layouts, key=lambda lc: -lc.tokens_per_s):
            lines.append(f"layout {lc.name:<10} {lc.tokens_per_s:12,.1f} tokens/s over {len(lc.engines)} engine(s)")
        lines.append(f"run {c.recommended}: the most tokens/s on these GPUs")
    if prompts_total:
        eta = c.eta_s(prompts_total)
        lines.append(f"{prompts_total:,} prompts × {c.mean_completion_tokens:,.0f} tokens ÷ ({c.tokens_per_s_per_engine:,.1f}"
                     f" tokens/s × {len(c.engines)} engine(s)) = {eta / 86400:,.2f} days ({eta / 3600:,.1f} h)")
    return "\n".join(lines)


async def calibrate_configured(cfg: Config, prompts: list[list[ChatMessage]], sweep: Sweep, urls: list[str],
                               say: Callable[[str], None] = print) -> list[EngineCalibration]:
    """The engines the run is configured with, one after the other: `urls` (sglang/openai), or one in-process hf
    engine."""
    results = []
    for url in urls or [""]:
        gen = msgspec.structs.replace(cfg.generator, engine_url=url) if url else cfg.generator
        backend = make_backend(msgspec.structs.replace(cfg, generator=gen))
        await backend.start()
        try:
            name = url or f"{backend.engine}:{getattr(backend, 'device', '')}"
            results.append(await calibrate_engine(backend, name, prompts, sweep, say))
        finally:
            await backend.close()
    return results


def starting_config(cfg: Config) -> Config:
    """The generator's config starting at the concurrency the run's calibration measured for its engine (its best level),
    when `calibrate.start_generators` and a calibration names this engine; else `cfg` as it is. (Blocking: S3.)"""
    from shared.calibration import load_calibration
    from shared.store import Store, StoreError

    g = cfg.generator
    if not cfg.calibrate.start_generators or g.backend not in ("sglang", "openai"):
        return cfg
    try:
        calibration = load_calibration(Store.open(cfg), cfg.run)
    except (StoreError, ValueError) as e:
        log.warning("run %s: the calibration could not be read (%s); starting at fallback_inflight %d", cfg.run, e,
                    g.fallback_inflight)
        return cfg
    url = g.engine_url or "http://127.0.0.1:30000"
    measured = calibration.engine(url) if calibration else None
    if measured is None:
        return cfg
    log.info("engine %s: starting at the calibrated concurrency %d (dfpipe calibrate measured %.1f tokens/s there)",
             url, measured.best_concurrency, measured.peak_tokens_per_s)
    # the level it starts at (the adaptive fill moves on from there; max_inflight stays the user's upper bound)
    return msgspec.structs.replace(cfg, generator=msgspec.structs.replace(g, fallback_inflight=measured.best_concurrency))
