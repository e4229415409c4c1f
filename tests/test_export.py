"""`dfpipe export-data` on a run built shard by shard (duplicates, a regeneration, truncation, drops), the
bad input of `dfpipe export`, and the eval's held-out pick reading only the shards it needs.

The drafter export of a really trained checkpoint, loaded by the reference and checked against the engines'
contracts, is in tests/test_interop.py (DFlash) and tests/test_dflash2.py (DFlash 2): they reuse the
checkpoints those modules train.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from pathlib import Path

from services.export.dataset import DUPLICATE, NOT_TOKENIZED, tokenized_key
from services.export.destination import MANIFEST
from shared.bus import Bus
from shared.exits import Exit
from shared.messages import ChatMessage, TokenizedShard, TrainerProgress
from shared.records import CompletionRecord, TokenizedSample, completions_to_parquet, samples_to_parquet
from shared.store import Store
from shared.topology import Keys, Subjects
from tests.conftest import make_config, new_run

FP = "fp0123456789"


def _record(run: str, i: int, *, gen: int = 0, finish: str = "stop", text: str = "", worker: str = "w0",
            ids: list[int] | None = None) -> CompletionRecord:
    return CompletionRecord(run=run, prompt_id=f"p{i:03d}", messages=[ChatMessage(role="system", content="Be brief."),
                            ChatMessage(role="user", content=f"question {i}")],
                            completion=text or f"answer {i} gen {gen}", reasoning=f"thinking {i}" if i % 2 else None,
                            output_ids=ids, completion_tokens=5, prompt_tokens=9, finish_reason=finish,
                            generation=gen, worker=worker, model="target")


def _sample(rec: CompletionRecord) -> TokenizedSample:
    ids = [1, 2, 3, 4, 5, int(rec.prompt_id[1:]) + 10]
    return TokenizedSample(prompt_id=rec.prompt_id, input_ids=ids, loss_mask=[0, 0, 0, 1, 1, 1], num_tokens=6,
                           num_supervised=3, generation=rec.generation)


def _build_run(stack, run: str) -> dict:
    """Three completions shards of two workers and the tokenizer's output for two of them:
    - p000..p009 in w0/00000000; p003 again (same generation) in w1/00000000, where the tokenizer kept it;
    - p005 regenerated (generation 1) in w1/00000001; p007 truncated; p008 dropped (empty_answer);
    - w1/00000001 (p005 gen 1, p010, p011) not tokenized yet."""
    cfg = make_config(stack, run)
    store = Store.open(cfg)
    a = [_record(run, i, finish="length" if i == 7 else "stop", ids=[7, 8, 9] if i < 4 else None) for i in range(10)]
    b = [_record(run, 3, worker="w1", text="answer 3 second copy"), _record(run, 12, worker="w1")]
    c = [_record(run, 5, gen=1, worker="w1"), _record(run, 10, worker="w1"), _record(run, 11, worker="w1")]
    shards = {Keys.completions(run, "w0", 0): a, Keys.completions(run, "w1", 0): b, Keys.completions(run, "w1", 1): c}
    for key, recs in shards.items():
        store.put_bytes(key, completions_to_parquet(recs))
    kept_a = [r for r in a if r.prompt_id not in ("p003", "p008")]  # p003: the tokenizer took w1's copy first
    tokenized = {Keys.completions(run, "w0", 0): kept_a, Keys.completions(run, "w1", 0): b}
    drops = {"prompt_id": "p008", "reason": "empty_answer", "example": "", "num_supervised": 0}
    store.put_bytes(Keys.tokenized_drops(run, FP, "w0.00000000"), (json.dumps(drops) + "\n").encode())

    async def announce() -> None:
        async with await Bus.connect(cfg.bus, "pytest", deadline_s=10) as bus:
            await bus.ensure_streams()
            for src, recs in tokenized.items():
                key = tokenized_key(run, FP, src)
                data = samples_to_parquet([_sample(r) for r in recs])
                store.put_bytes(key, data)
                await bus.publish(Subjects.tokenized(run), TokenizedShard(
                    run=run, key=key, source_key=src, fingerprint=FP, num_samples=len(recs), num_tokens=6 * len(recs),
                    num_supervised=3 * len(recs), sha256=hashlib.sha256(data).hexdigest()), msg_id=key)

    asyncio.run(announce())
    return {"cfg": cfg, "store": store, "unique": 13}


def _cli(stack, monkeypatch, capsys, *argv: str) -> tuple[int, str, str]:
    """`dfpipe ARGV` in this process (no interpreter start-up per call), pointed at the test stack."""
    from shared.cli import main

    for k, v in stack.env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("DFLASH_DATA_DIR", str(stack.root))
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def _sums(folder: Path) -> dict[str, str]:
    return {line.split("  ", 1)[1]: line.split("  ", 1)[0] for line in (folder / MANIFEST).read_text().splitlines()}


def test_export_data_both_formats_load_with_datasets_and_a_reexport_is_identical(stack, monkeypatch, capsys,
                                                                                  tmp_path: Path) -> None:
    import datasets

    run = new_run()
    built = _build_run(stack, run)
    out = tmp_path / "ds"
    code, stdout, err = _cli(stack, monkeypatch, capsys, "export-data", "--run", run, "--format", "parquet,sharegpt",
                             "--samples", "--rows-per-file", "5", "--source", "unit test prompts",
                             "--license", "CC0-1.0", str(out))
    assert code == Exit.OK, err
    assert f"{built['unique']} completions (9 kept by the tokenizer, 1 truncated)" in stdout, stdout
    parquet = datasets.load_dataset("parquet", data_files=str(out / "data/*.parquet"), split="train", cache_dir=str(tmp_path / "hf"))
    sharegpt = datasets.load_dataset("json", data_files=str(out / "sharegpt/*.jsonl"), split="train", cache_dir=str(tmp_path / "hf"))
    samples = datasets.load_dataset("parquet", data_files=str(out / "samples/*.parquet"), split="train", cache_dir=str(tmp_path / "hf"))
    assert len(parquet) == len(sharegpt) == built["unique"] == len(set(parquet["prompt_id"]))
    assert sorted(parquet["prompt_id"]) == sorted([*samples["prompt_id"], "p005", "p008", "p010", "p011"])
    rows = {r["prompt_id"]: r for r in parquet}
    assert rows["p005"]["generation"] == 1 and rows["p005"]["completion"] == "answer 5 gen 1"  # the regeneration
    assert not rows["p005"]["kept"] and rows["p005"]["drop_reason"] == NOT_TOKENIZED
    assert rows["p003"]["completion"] == "answer 3 second copy" and rows["p003"]["kept"]  # the copy it trained on
    assert rows["p008"]["drop_reason"] == "empty_answer" and not rows["p008"]["kept"]
    assert rows["p007"]["truncated"] and rows["p007"]["finish_reason"] == "length" and rows["p007"]["kept"]
    assert rows["p001"]["output_ids"] == [7, 8, 9] and rows["p009"]["output_ids"] is None
    assert rows["p001"]["messages"][1] == {"role": "user", "content": "question 1", "reasoning": None}
    assert rows["p001"]["reasoning"] == "thinking 1" and rows["p002"]["reasoning"] is None
    conv = next(r for r in sharegpt if r["id"] == "p001")
    assert [m["from"] for m in conv["conversations"]] == ["system", "human", "gpt"]
    assert conv["conversations"][-1]["value"] == "answer 1 gen 0" and conv["reasoning"] == "thinking 1"
    assert samples.filter(lambda s: s["prompt_id"] == "p004")[0]["loss_mask"] == [0, 0, 0, 1, 1, 1]
    card = (out / "README.md").read_text()
    assert "unit test prompts" in card and "CC0-1.0" in card and FP in card and "| empty_answer | 1 |" in card
    assert f"| {NOT_TOKENIZED} | 3 |" in card and "truncated (finish_reason = length): 1 (7.7%)" in card
    sums = _sums(out)
    assert set(sums) == {str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()} - {MANIFEST}
    assert all(hashlib.sha256((out / f).read_bytes()).hexdigest() == h for f, h in sums.items())
    assert len([f for f in sums if f.startswith("data/")]) == 3  # 13 rows at 5 per file

    # again, to S3 this time: the same files, byte for byte, in the same order
    again = f"s3://{stack.bucket}/exports/{run}"
    code, _, err = _cli(stack, monkeypatch, capsys, "export-data", "--run", run, "--format", "parquet",
                        "--format", "sharegpt", "--samples", "--rows-per-file", "5", "--source", "unit test prompts",
                        "--license", "CC0-1.0", again)
    assert code == Exit.OK, err
    store = built["store"]
    theirs = {line.split("  ", 1)[1]: line.split("  ", 1)[0]
              for line in store.get_bytes(f"exports/{run}/{MANIFEST}").decode().splitlines()}
    assert theirs == sums

    # a destination that is not empty, an unknown format: one line each, nothing written
    code, _, err = _cli(stack, monkeypatch, capsys, "export-data", "--run", run, str(out))
    assert code == Exit.USAGE and err.count("\n") == 1 and "is not an empty folder" in err
    code, _, err = _cli(stack, monkeypatch, capsys, "export-data", "--run", run, again)
    assert code == Exit.USAGE and "already holds objects" in err
    code, _, err = _cli(stack, monkeypatch, capsys, "export-data", "--run", run, "--format", "csv", str(tmp_path / "x"))
    assert code == Exit.USAGE and "unknown --format csv" in err and not (tmp_path / "x").exists()
    assert DUPLICATE not in card  # every winner that was tokenized was kept


def _checkpoint(store: Store, run: str, step: int) -> None:
    from types import SimpleNamespace

    from services.trainer.model import DFlashDrafter

    tc = SimpleNamespace(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, vocab_size=500, num_hidden_layers=12, rms_norm_eps=1e-5, rope_theta=1e5,
                         max_position_embeddings=512)
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        DFlashDrafter.for_target(tc, num_layers=1, block_size=8, layer_ids=[1, 3, 5, 7, 9], mask_token_id=7).save(Path(tmp))
        for name in ("config.json", "model.safetensors"):
            store.put_file(f"{Keys.checkpoint(run, step)}drafter/{name}", Path(tmp) / name)
    store.put_bytes(Keys.checkpoint_latest(run), json.dumps({"step": step, "key": Keys.checkpoint(run, step)}).encode())


def _progress(stack, run: str, state: str, step: int = 2) -> None:
    cfg = make_config(stack, run)

    async def publish() -> None:
        async with await Bus.connect(cfg.bus, "pytest", deadline_s=10) as bus:
            await bus.ensure_streams()
            await bus.publish(Subjects.progress(run, "train", "trainer"),
                              TrainerProgress(run=run, worker="trainer", step=step, total_steps=10, state=state,
                                              ts=time.time()))

    asyncio.run(publish())


def test_export_refuses_bad_input_with_one_line_and_writes_nothing(stack, monkeypatch, capsys, tmp_path: Path) -> None:
    run = new_run()
    store = Store.open(make_config(stack, run))
    dest = tmp_path / "drafter"
    _progress(stack, run, "waiting for data", step=0)
    code, _, err = _cli(stack, monkeypatch, capsys, "export", "--run", run, "--step", "2", str(dest))
    assert (code, err) == (Exit.USAGE, f"dfpipe export: run {run} has no checkpoint yet (train it first: "
                                       f"dfpipe train --run {run})\n")
    _checkpoint(store, run, 2)
    _checkpoint(store, run, 4)
    code, _, err = _cli(stack, monkeypatch, capsys, "export", "--run", run, "--step", "3", str(dest))
    assert (code, err) == (Exit.USAGE, f"dfpipe export: run {run} has no checkpoint at step 3 (it has steps 2, 4)\n")
    _progress(stack, run, "running", step=4)  # the trainer is training now
    code, _, err = _cli(stack, monkeypatch, capsys, "export", "--run", run, str(dest))
    assert code == Exit.BUSY and err.count("\n") == 1 and "is still training (step 4 of 10" in err
    assert "pass --step N" in err
    dest.mkdir()
    (dest / "keep.txt").write_text("mine")
    code, _, err = _cli(stack, monkeypatch, capsys, "export", "--run", run, "--step", "2", str(dest))
    assert code == Exit.USAGE and err.count("\n") == 2 and "is not an empty folder" in err  # warning + refusal
    assert [p.name for p in dest.iterdir()] == ["keep.txt"]
    code, _, err = _cli(stack, monkeypatch, capsys, "export", "--run", "nosuchrun" + run, str(tmp_path / "n"))
    assert code == Exit.USAGE and "no run" in err and not (tmp_path / "n").exists()
    # while it trains, --step exports a checkpoint it has written, with a warning; nothing partial is left
    ok = tmp_path / "step2"
    code, stdout, err = _cli(stack, monkeypatch, capsys, "export", "--run", run, "--step", "2", str(ok))
    assert code == Exit.OK, err
    assert err.startswith(f"warning: run {run}'s trainer is still training (step 4)") and "step 2" in stdout
    assert {"config.json", "model.safetensors", "README.md", "export.json", MANIFEST} <= {p.name for p in ok.iterdir()}
    assert not [p for p in tmp_path.iterdir() if ".partial-" in p.name]
    facts = json.loads((ok / "export.json").read_text())
    assert facts["checkpoint"] == Keys.checkpoint(run, 2) and facts["eval"] is None
    assert "not recorded by the run" in (ok / "README.md").read_text() or facts["identity_note"]


def test_eval_pick_reads_only_the_shards_it_needs(stack) -> None:
    """200 tokenized shards of 5 samples: the eval's 6 held-out prompts come from the first shards announced,
    found by reading a handful of them (the old pick read all 200). The pick is the same every time."""
    from services.trainer.data import (
        ShardCache,
        held_out,
        pick_held_out,
        prompt_part,
        shard_keys_in_log_order,
    )

    run = new_run()
    cfg = make_config(stack, run, trainer={"holdout_mod": 3, "eval_prompts": 6})
    store = Store.open(cfg)
    keys = [f"runs/{run}/tokenized/{FP}/w{i % 3}-{i:08d}.parquet" for i in range(200)]

    def sample(n: int) -> TokenizedSample:
        return TokenizedSample(prompt_id=f"q{n:05d}", input_ids=[5, 6, n, 1, 2], loss_mask=[0, 0, 0, 1, 1],
                               num_tokens=5, num_supervised=2)

    async def write_and_announce() -> None:
        async with await Bus.connect(cfg.bus, "pytest", deadline_s=10) as bus:
            await bus.ensure_streams()
            for i, key in enumerate(keys):
                data = samples_to_parquet([sample(5 * i + j) for j in range(5)])
                await asyncio.to_thread(store.put_bytes, key, data)
                await bus.publish(Subjects.tokenized(run), TokenizedShard(
                    run=run, key=key, source_key="-", fingerprint=FP, num_samples=5, num_tokens=25,
                    num_supervised=10, sha256=hashlib.sha256(data).hexdigest()), msg_id=key)
            return await shard_keys_in_log_order(bus, run)

    ordered = asyncio.run(write_and_announce())
    assert ordered == keys  # the log's order, not the keys' (w0-00000003 sorts before w1-00000001)

    reads: list[str] = []

    class CountingStore(Store):

        def get_bytes(self, key: str, *, verify: bool = True) -> bytes:
            reads.append(key)
            return super().get_bytes(key, verify=verify)

    counting = CountingStore.open(cfg)
    picks = [pick_held_out(counting, ordered, holdout_mod=3, want=6, cache=ShardCache.temporary()) for _ in range(2)]
    assert picks[0] == picks[1] and len(picks[0]) == 6
    expected = [n for n in range(1000) if held_out(f"q{n:05d}", 3)][:6]
    assert picks[0] == [prompt_part(sample(n)) for n in expected]
    needed = expected[-1] // 5 + 1  # the shard holding the 6th held-out prompt
    assert len(reads) == 2 * needed and needed < 20, (needed, len(reads))


def test_dfpipe_run_ends_by_printing_the_export_commands_and_they_parse(capsys) -> None:
    import shlex
    from types import SimpleNamespace

    from services.pipeline.run import print_artifacts
    from shared.cli import build_parser
    from shared.config import load_config
    from shared.status import RunStatus

    cfg = load_config(env={})
    store = SimpleNamespace(uri=lambda key: f"s3://b/{key}")
    report = {"tau": 1.9, "prompts": 16, "speedup": 0.9, "lossless": True}
    print_artifacts(cfg, store, report, RunStatus(run=cfg.run))  # type: ignore[arg-type]
    lines = [line.split("#")[0].strip() for line in capsys.readouterr().out.splitlines() if "dfpipe export" in line]
    assert [shlex.split(line)[1] for line in lines] == ["export", "export-data"]
    for line in lines:
        args = build_parser().parse_args(shlex.split(line)[1:])
        assert args.run == cfg.run and args.dir.startswith(f"./{cfg.run}-")
    print_artifacts(cfg, store, None, RunStatus(run=cfg.run))  # not trained: only the data to export
    assert next(line for line in capsys.readouterr().out.splitlines() if "dfpipe export" in line).strip().startswith(
        "dfpipe export-data")
