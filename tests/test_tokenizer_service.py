"""The tokenizer service end to end on the real stack: completion shards in S3 + ShardWritten events
in, tokenized Parquet shards + TokenizedShard events out; the quality gate on the real incident
(87% "OK."); a corrupt shard dead-lettered while the others go on; token-exact vs re-tokenized."""

from __future__ import annotations

import asyncio
import hashlib
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq

from services.generator.shards import shard_event
from services.tokenizer.fingerprint import load_target_tokenizer
from services.tokenizer.samples import SampleBuilder
from services.tokenizer.service import run_service
from shared.bus import Bus
from shared.messages import Alert, Subjects, TokenizedShard
from shared.records import ChatMessage, CompletionRecord, completions_to_parquet, read_samples
from shared.store import Keys, Store
from tests.conftest import make_config

ANSWER = "Paris is the capital of France, and it sits on the river Seine in the north of the country."


def records(run: str, start: int, n: int, answer=lambda i: ANSWER) -> list[CompletionRecord]:
    return [CompletionRecord(run=run, prompt_id=f"p{i:05d}", completion=answer(i), completion_tokens=20,
                             messages=[ChatMessage(role="user", content=f"Question number {i}: where is Paris?")])
            for i in range(start, start + n)]


async def write_shard(bus: Bus, store: Store, run: str, seq: int, recs: list[CompletionRecord],
                      data: bytes | None = None) -> str:
    key = Keys.completions(run, "w0", seq)
    good = completions_to_parquet(recs)
    body = good if data is None else data
    await asyncio.to_thread(store.put_bytes, key, body)
    ev = shard_event(run, key, "w0", seq, recs, hashlib.sha256(body).hexdigest(), len(body))
    await bus.publish(Subjects.shards(run), ev, msg_id=key)
    return key


async def tokenized_events(bus: Bus, run: str) -> list[TokenizedShard]:
    return [e async for _, e in bus.replay("TOKENIZED", Subjects.tokenized(run), 1, TokenizedShard)]


async def test_shards_become_deduped_parquet_samples_and_a_corrupt_one_is_dead_lettered(
        stack, bus, store, tmp_path: Path) -> None:
    cfg = make_config(stack, tokenizer={"min_supervised_tokens": 4})
    run = cfg.run
    tok = await asyncio.to_thread(load_target_tokenizer, cfg)
    first = records(run, 0, 6)
    exact = records(run, 6, 1)[0]
    exact.output_ids = [*tok.encode(exact.completion, add_special_tokens=False), tok.convert_tokens_to_ids("<|im_end|>")]
    second = [*records(run, 3, 1), exact, *records(run, 7, 3)]  # p00003 again: a redelivered prompt
    k1 = await write_shard(bus, store, run, 0, first)
    k2 = await write_shard(bus, store, run, 1, second)
    bad = await write_shard(bus, store, run, 2, records(run, 20, 2), data=b"not a parquet file at all")
    await asyncio.wait_for(run_service(cfg, burst=True, tokenizer=tok, progress_every_s=0.5), 120)

    events = await tokenized_events(bus, run)
    assert {e.source_key for e in events} == {k1, k2}
    fp = events[0].fingerprint
    ids: list[str] = []
    for e in events:
        assert e.key.startswith(f"runs/{run}/tokenized/{fp}/")
        data = store.get_bytes(e.key)
        local = tmp_path / Path(e.key).name
        local.write_bytes(data)
        table = pq.read_table(local)
        assert set(table.column_names) >= {"prompt_id", "input_ids", "loss_mask", "num_tokens", "num_supervised"}
        assert str(table.schema.field("input_ids").type) == "list<element: int32>"
        import datasets
        import pandas as pd

        assert len(pd.read_parquet(local)) == e.num_samples
        assert len(datasets.load_dataset("parquet", data_files=str(local), split="train")) == e.num_samples
        for s in read_samples(data):
            ids.append(s.prompt_id)
            supervised = [t for t, m in zip(s.input_ids, s.loss_mask, strict=True) if m]
            assert tok.decode(supervised) == ANSWER + "<|im_end|>"  # answer + end of turn, nothing else
    assert sorted(ids) == [f"p{i:05d}" for i in range(10)]  # p00003 once across shards
    assert sum(e.dropped.get("duplicate", 0) for e in events) == 1
    letters = await bus.dead_letters(run, "tokenize")
    assert len(letters) == 1
    letter = letters[0][1]
    assert bad in letter.error and "unreadable" in letter.error


async def test_the_ok_incident_trips_the_gate_with_the_reason(stack, stack_env, bus, store) -> None:
    """87% of answers collapsed to "OK.": the gate trips within its first window, says why, stops consuming."""
    cfg = make_config(stack, tokenizer={"gate_window": 50, "min_supervised_tokens": 4})
    run = cfg.run
    tok = await asyncio.to_thread(load_target_tokenizer, cfg)
    for seq in range(6):  # 300 records in shards of 50
        await write_shard(bus, store, run, seq, records(run, seq * 50, 50, lambda i: "OK." if i % 100 < 87 else ANSWER))
    service = await asyncio.wait_for(run_service(cfg, burst=True, tokenizer=tok, progress_every_s=0.5), 120)
    assert service.tripped is not None
    alerts = [a async for _, a in bus.replay("PROGRESS", Subjects.alert(run, "tokenize"), 1, Alert)]
    alerts = alerts or [a for _, a in await bus.latest_per_subject("PROGRESS", f"dflash.{run}.>")
                        if isinstance(a, Alert)]
    gate = [a for a in alerts if a.kind == "quality_gate"]
    assert gate, alerts
    assert "OK." in " ".join(gate[-1].examples) and gate[-1].message
    tokenized = await tokenized_events(bus, run)
    assert len(tokenized) < 6  # it stopped consuming instead of tokenizing the whole run
    status = subprocess.run([sys.executable, "-m", "shared.cli", "status", "--run", run], env=stack_env,
                            capture_output=True, text=True, timeout=60)
    assert "quality" in status.stdout.lower() and gate[-1].message[:40] in status.stdout, status.stdout


def test_token_exact_and_retokenized_paths_agree_on_smollm2_output(target_dir: Path) -> None:
    import torch

    from shared.config import load_config
    from shared.model import load_causal_lm, load_tokenizer

    cfg = load_config(env={})
    tok, lm = load_tokenizer(str(target_dir)), load_causal_lm(str(target_dir))
    recs = []
    for i, q in enumerate(["Name three colours.", "What is 2 + 2?", "Say hello in French."]):
        msgs = [{"role": "user", "content": q}]
        prompt = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        ids = tok(prompt, add_special_tokens=False, return_tensors="pt").input_ids
        with torch.no_grad():
            out = lm.generate(ids, max_new_tokens=24, do_sample=False)[0, ids.shape[1]:].tolist()
        text = tok.decode(out, skip_special_tokens=True)
        recs.append(CompletionRecord(run="r", prompt_id=f"q{i}", messages=[ChatMessage(role="user", content=q)],
                                     completion=text, output_ids=out, completion_tokens=len(out),
                                     finish_reason="stop" if out[-1] == tok.convert_tokens_to_ids("<|im_end|>") else "length"))
    cfg = load_config(env={"DFLASH_TOKENIZER__TRUNCATED_POLICY": "keep", "DFLASH_TOKENIZER__MIN_SUPERVISED_TOKENS": "2"})
    builder = SampleBuilder(tok, cfg)
    exact = builder.build(recs)
    plain = builder.build([CompletionRecord(**{**{f: getattr(r, f) for f in r.__struct_fields__}, "output_ids": None})
                           for r in recs])
    assert len(exact.samples) == len(plain.samples) == 3
    assert exact.exact == 3 and plain.exact == 0
    differing = sum(a.input_ids != b.input_ids for a, b in zip(exact.samples, plain.samples, strict=True))
    assert exact.drift == differing  # the reported drift is the real count of differing samples
    assert differing == 0, "SmolLM2's greedy answers re-tokenize to its own output ids"
    for a, b in zip(exact.samples, plain.samples, strict=True):
        assert a.loss_mask == b.loss_mask


async def test_replay_with_a_fixed_template_writes_a_new_fingerprint_and_keeps_the_old(
        stack, stack_env, bus, store, tmp_path: Path) -> None:
    cfg = make_config(stack, tokenizer={"min_supervised_tokens": 4})
    run = cfg.run
    tok = await asyncio.to_thread(load_target_tokenizer, cfg)
    await write_shard(bus, store, run, 0, records(run, 0, 4))
    await asyncio.wait_for(run_service(cfg, burst=True, tokenizer=tok, progress_every_s=0.5), 120)
    old = {k: store.get_bytes(k) for k in store.list(f"runs/{run}/tokenized/")}
    assert len(old) == 1
    fixed = tmp_path / "template.jinja"
    fixed.write_text(tok.chat_template.replace("named SmolLM, trained by Hugging Face", "that answers briefly"))
    r = subprocess.run([sys.executable, "-m", "shared.cli", "replay", "tokenize", "--run", run, "--template", str(fixed)],
                       env={**stack_env, "DFLASH_TOKENIZER__MIN_SUPERVISED_TOKENS": "4"}, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    now = set(store.list(f"runs/{run}/tokenized/"))
    assert len(now) == 2 and set(old) <= now
    for k, data in old.items():
        assert store.get_bytes(k) == data  # the old output is untouched
    events = await tokenized_events(bus, run)
    assert len({e.fingerprint for e in events}) == 2
    (new_key,) = now - set(old)
    sample = read_samples(store.get_bytes(new_key))[0]
    assert "that answers briefly" in tok.decode(sample.input_ids)
