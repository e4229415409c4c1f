"""Per-sample checks: every dropped sample gets exactly one reason, and the reasons are counted.

Order (the first that applies is the reason): the generation was cut by max_new_tokens
(`truncated_generation`, under truncated_policy="drop"), the answer is empty (`empty_answer`),
thinking was on but the reasoning is empty (`empty_reasoning`), the chat template raises on the
conversation (`template_error`: e.g. roles it does not accept), the sample does not fit the
template (`render_mismatch`), fewer supervised tokens than `min_supervised_tokens`
(`below_min_supervised`, the "OK." incident), the answer ends in a loop (`degenerate_repetition`).
A prompt_id already emitted (at this generation or a newer one) is `duplicate` (dedupe, not a
quality problem: the gate ignores it).
"""

from __future__ import annotations

from shared.config import Config
from shared.records import CompletionRecord

TRUNCATED_GENERATION = "truncated_generation"
EMPTY_ANSWER = "empty_answer"
EMPTY_REASONING = "empty_reasoning"
TEMPLATE_ERROR = "template_error"
RENDER_MISMATCH = "render_mismatch"
BELOW_MIN_SUPERVISED = "below_min_supervised"
DEGENERATE_REPETITION = "degenerate_repetition"
DUPLICATE = "duplicate"

QUALITY_REASONS = (
    TRUNCATED_GENERATION, EMPTY_ANSWER, EMPTY_REASONING, TEMPLATE_ERROR, RENDER_MISMATCH, BELOW_MIN_SUPERVISED,
    DEGENERATE_REPETITION,
)


def min_supervised_tokens(cfg: Config) -> int:
    """tokenizer.min_supervised_tokens, or 2 x the drafter block size: a sample must hold two blocks."""
    return cfg.tokenizer.min_supervised_tokens or 2 * cfg.trainer.block_size


def precheck(rec: CompletionRecord, *, thinking: bool, truncated_policy: str) -> str | None:
    """Reasons that need no tokenizing."""
    if rec.truncated and truncated_policy == "drop":
        return TRUNCATED_GENERATION
    if not rec.completion.strip():
        return EMPTY_ANSWER
    if thinking and not (rec.reasoning or "").strip():
        return EMPTY_REASONING
    return None


def periodic_tail(ids: list[int], max_period: int) -> tuple[int, int]:
    """(period, length) of the longest tail of `ids` that repeats with a period <= max_period."""
    best = (0, 0)
    n = len(ids)
    for p in range(1, min(max_period, n // 2) + 1):
        run = 0
        i = n - 1
        while i - p >= 0 and ids[i] == ids[i - p]:
            run += 1
            i -= 1
        length = run + p if run else 0
        if length > best[1]:
            best = (p, length)
    return best


def is_degenerate(ids: list[int], *, max_period: int, min_tail: int) -> bool:
    """A generation that ends in a loop: a tail of >= min_tail tokens made of >= 4 copies of one short piece.

    Up to two final tokens (a trailing space or newline after the loop) are ignored.
    """
    for skip in range(3):
        period, length = periodic_tail(ids[: len(ids) - skip], max_period)
        if period > 0 and length >= max(min_tail, 4 * period):
            return True
    return False


def truncate(ids: list[int], mask: list[int], max_length: int) -> tuple[list[int], list[int], bool]:
    """Keep the first max_length tokens (the whole prompt, the start of the answer); say whether it cut."""
    if len(ids) <= max_length:
        return ids, mask, False
    return ids[:max_length], mask[:max_length], True
