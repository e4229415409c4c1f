"""The data-completeness decision (shared/ledger.py): when a trainer may count a pass as an epoch, and
when `dfpipe run` moves from generation to tokenization to training. Pure: the ledger's numbers in."""

from __future__ import annotations

import dataclasses

from hypothesis import given, settings
from hypothesis import strategies as st

from shared.ledger import StageCounts, data_complete, generation_done, tokenization_done

DONE = StageCounts(fed=True, accepted=10, completed=8, generate_dead=2, in_flight=0, queued=0, shards=3,
                   tokenized_shards=2, tokenize_dead=1)


def test_a_finished_run_is_complete() -> None:
    assert generation_done(DONE) and tokenization_done(DONE) and data_complete(DONE)


def test_tokenized_shards_announced_by_hand_with_nothing_fed_are_the_whole_data() -> None:
    nothing = StageCounts(fed=False, accepted=0, completed=0, generate_dead=0, in_flight=0, queued=0, shards=0,
                          tokenized_shards=0, tokenize_dead=0)
    assert data_complete(nothing) and not generation_done(nothing) and not tokenization_done(nothing)


@settings(max_examples=200, deadline=None)
@given(change=st.sampled_from([
    {"fed": False},  # the feeder is still feeding
    {"in_flight": 1},  # a generator holds a prompt
    {"completed": 7},  # a prompt neither completed nor dead-lettered
    {"tokenized_shards": 1},  # a completion shard not yet tokenized
    {"shards": 4},
    {"accepted": 11},
]), queued=st.integers(0, 5))
def test_any_unfinished_stage_makes_the_data_incomplete(change: dict, queued: int) -> None:
    c = dataclasses.replace(DONE, queued=queued, **change)
    assert not data_complete(c)
    if "tokenized_shards" in change or "shards" in change:
        assert generation_done(c) and not tokenization_done(c)
    else:
        assert not generation_done(c)


@settings(max_examples=200, deadline=None)
@given(queued=st.integers(1, 100), shards=st.integers(0, 3))
def test_prompts_queued_before_any_feed_manifest_are_not_complete(queued: int, shards: int) -> None:
    """A feed under way (prompts queued, manifest not written yet) is not 'nothing fed'."""
    c = StageCounts(fed=False, accepted=0, completed=0, generate_dead=0, in_flight=0, queued=queued, shards=shards,
                    tokenized_shards=shards, tokenize_dead=0)
    assert not data_complete(c)
