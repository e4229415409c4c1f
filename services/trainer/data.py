"""The training data: tokenized shards announced on the TOKENIZED log, deduped by prompt_id, in a
deterministic per-epoch order so a resumed run sees exactly the samples it would have seen.

The shard list is re-read at the start of every epoch, so training can begin while generation
and tokenization still run (later shards join the next epoch). Only the newest template
fingerprint is used (a re-tokenization supersedes the old output). Every `holdout_mod`-th
prompt (by prompt_id hash) is held out of training for `dflash eval`.
"""

from __future__ import annotations

import hashlib

import torch

from shared.bus import Bus
from shared.messages import Subjects, TokenizedShard
from shared.records import TokenizedSample, read_samples
from shared.store import Store


def held_out(prompt_id: str, holdout_mod: int) -> bool:
    return holdout_mod > 0 and int(hashlib.sha256(prompt_id.encode()).hexdigest()[:8], 16) % holdout_mod == 0


async def shard_keys(bus: Bus, run: str) -> list[str]:
    events = [e async for _, e in bus.replay("TOKENIZED", Subjects.tokenized(run), 1, TokenizedShard)]
    if not events:
        return []
    newest = events[-1].fingerprint
    return sorted({e.key for e in events if e.fingerprint == newest and e.num_samples > 0})


def load_samples(store: Store, keys: list[str], *, holdout_mod: int, train: bool) -> list[TokenizedSample]:
    """One sample per prompt_id (the first by shard key, then row), the held-out ones or the others."""
    seen: set[str] = set()
    out = []
    for key in sorted(keys):
        for s in read_samples(store.get_bytes(key)):
            if s.prompt_id in seen or s.num_supervised < 2 or held_out(s.prompt_id, holdout_mod) == train:
                continue
            seen.add(s.prompt_id)
            out.append(s)
    return sorted(out, key=lambda s: s.prompt_id)


def epoch_order(n: int, seed: int, epoch: int) -> list[int]:
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(n, generator=g).tolist()
