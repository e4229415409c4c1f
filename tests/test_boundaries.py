"""Every boundary a user or a peer feeds, with bad input: a clear answer, the stage goes on, nothing lost.

Config files, chat template files, shards in S3, bus messages from a newer build, `s3://` prompt
sources, and the read-only commands on a run or a stack that does not exist yet. Real nats-server,
SeaweedFS and SmolLM2's tokenizer throughout.
"""

from __future__ import annotations

import asyncio
import io
import os
import re
import subprocess
import sys
from pathlib import Path

import msgspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from services.feeder.sources import SourceError, local_copy
from services.tokenizer.fingerprint import load_target_tokenizer
from services.tokenizer.render import TemplateError
from services.tokenizer.samples import SampleBuilder
from shared.bus import consumer_for
from shared.config import ConfigError, load_config
from shared.messages import SCHEMA_VERSION, PromptTask, ShardWritten
from shared.records import completions_to_parquet
from shared.stack import EmbeddedStack, Ports
from shared.store import sha256_bytes
from shared.topology import Keys, Subjects
from tests.conftest import make_config, new_run
from tests.test_bus import run_worker, task
from tests.test_tokenizer_service import announce, burst, tokenized_events, topic_record, write_shard

ROOT = Path(__file__).resolve().parents[1]


def cli(env: dict, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shared.cli", "--log-level", "WARNING", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


# --- config files ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("toml", "match"),
    [
        ('run = "r"\n\n[generator]\nbatch_size = 2\nmax_inflght = 4\n', r", line 5: unknown config key 'generator\.max_inflght'"),
        ("# mine\n[genrator]\nbatch_size = 2\n", r", line 2: unknown config key 'genrator'"),
        ('[tokenizer]\nmax_length = 10\n[generator]\nmax_inflight = "many"\n', r", line 4: config key 'generator\.max_inflight': Expected `int`"),
        ('[generator]\nbackend = "vllm"\n', r", line 2: config key 'generator\.backend': 'vllm' is not a backend"),
        ('run = "r"\n[bus]\nurl = \n', r"is not valid TOML: .*\(at line 3, column 7\)"),
        ("[bus\n", r"is not valid TOML: .*line 1"),
    ],
)
def test_a_bad_config_file_names_the_key_and_the_line(tmp_path, toml, match) -> None:
    path = tmp_path / "c.toml"
    path.write_text(toml)
    with pytest.raises(ConfigError, match=match):
        load_config(path, env={})


def test_a_config_file_that_is_not_text_is_named(tmp_path) -> None:
    path = tmp_path / "c.toml"
    path.write_bytes(b"run = '\xff'\n")
    with pytest.raises(ConfigError, match="is not UTF-8 text"):
        load_config(path, env={})


# --- chat template files ---------------------------------------------------------------------------


@pytest.mark.parametrize(("template", "match"), [
    ("{% for m in messages %}{{ m.content }\n", "fails on a plain conversation at line 1: TemplateSyntaxError"),
    ("{{ raise_exception('not for this model') }}", "fails on a plain conversation: .*not for this model"),
])
@pytest.mark.stack  # loads the target's tokenizer
def test_a_chat_template_that_does_not_compile_or_render_is_a_template_error(tmp_path, template, match) -> None:
    path = tmp_path / "t.jinja"
    path.write_text(template)
    cfg = load_config(env={})
    cfg = msgspec.structs.replace(cfg, tokenizer=msgspec.structs.replace(cfg.tokenizer, chat_template_file=str(path)))
    tok = load_target_tokenizer(cfg)
    with pytest.raises(TemplateError, match=match):
        SampleBuilder(tok, cfg)


def test_the_tokenizer_cli_refuses_a_broken_template_file_in_one_line(stack, stack_env, tmp_path) -> None:
    path = tmp_path / "broken.jinja"
    path.write_text("{% if %}")
    r = cli({**stack_env, "DFLASH_TOKENIZER__CHAT_TEMPLATE_FILE": f'"{path}"'}, "tokenize", "--run", new_run(), "--burst")
    assert r.returncode == 2, r.stdout + r.stderr
    assert f"the chat template {path} cannot give exact loss masks" in r.stdout and "Traceback" not in r.stderr


# --- shards in S3 ----------------------------------------------------------------------------------


async def test_truncated_and_other_schema_completion_shards_are_dead_lettered_and_the_stage_goes_on(
        stack, bus, store) -> None:
    cfg = make_config(stack)
    run = cfg.run
    tok = await asyncio.to_thread(load_target_tokenizer, cfg)
    recs = [topic_record(run, i) for i in range(3)]
    data = completions_to_parquet(recs)
    # truncated: the upload stopped half way (the checksum recorded is the truncated bytes', so only the
    # Parquet reader can tell)
    cut = data[: len(data) // 2]
    key = Keys.completions(run, "gen-0", 0)
    store.put_bytes(key, cut)
    truncated = await announce(bus, run, key, "gen-0", 0, recs, sha256_bytes(cut), len(cut))
    # another schema: a valid Parquet file, but not completion records
    other = io.BytesIO()
    pq.write_table(pa.Table.from_pylist([{"prompt": "hi", "score": 0.5}]), other)
    key = Keys.completions(run, "gen-0", 1)
    store.put_bytes(key, other.getvalue())
    foreign = await announce(bus, run, key, "gen-0", 1, recs, sha256_bytes(other.getvalue()), len(other.getvalue()))
    good = await write_shard(bus, store, run, "gen-1", 0, [topic_record(run, i) for i in range(3, 6)])

    service = await burst(cfg, tok)
    assert service.counts.shards == 1
    assert [e.source_key for e in await tokenized_events(bus, run)] == [good.key]
    letters = [letter for _, letter in await bus.dead_letters(run, "tokenize")]
    assert len(letters) == 2 and all(letter.error.startswith("poison: ") for letter in letters)
    errors = {k: next(letter.error for letter in letters if k in letter.error) for k in (truncated.key, foreign.key)}
    assert "not a readable Parquet" in errors[truncated.key]
    assert "prompt_id" in errors[foreign.key] or "schema" in errors[foreign.key], errors[foreign.key]
    info = await bus.js.consumer_info("SHARDS", f"tokenize-{run}")
    assert info.num_pending == info.num_ack_pending == 0


# --- bus messages from a newer build ---------------------------------------------------------------


async def test_a_newer_schema_message_is_dead_lettered_with_its_version_and_the_worker_goes_on(cfg, bus) -> None:
    spec = consumer_for("generate", cfg.run)
    newer = msgspec.msgpack.encode({**msgspec.to_builtins(task(cfg.run, "new")), "type": "prompt_task",
                                    "v": SCHEMA_VERSION + 1, "priority": 3})
    await bus.publish_raw(Subjects.prompts(cfg.run), newer)
    await bus.publish(Subjects.prompts(cfg.run), task(cfg.run, "old"))
    seen = []

    async def handle(d):
        seen.append(d.data.prompt_id)

    stats = await run_worker(bus, spec, cfg.run, handle, until=lambda s: s.acked + s.dead_lettered == 2)
    assert seen == ["old"] and (stats.acked, stats.dead_lettered, stats.retried) == (1, 1, 0)
    ((_, letter),) = await bus.dead_letters(cfg.run, "generate")
    assert f"schema v{SCHEMA_VERSION + 1} is newer than this build's v{SCHEMA_VERSION}" in letter.error
    assert letter.payload == newer and letter.num_delivered == 1  # dead-lettered at once: no redelivery loop


async def test_a_log_reader_skips_a_newer_schema_message_instead_of_failing_at_every_start(cfg, bus) -> None:
    subject = Subjects.shards(cfg.run)
    event = ShardWritten(run=cfg.run, key="k1", worker="w", seq=1, num_records=1, prompt_ids=["a"], sha256="x",
                         size_bytes=1)
    await bus.publish(subject, event)
    await bus.publish_raw(subject, msgspec.msgpack.encode({**msgspec.to_builtins(event), "type": "shard_written",
                                                           "v": SCHEMA_VERSION + 1, "key": "k2"}))
    await bus.publish_raw(subject, b"\xc1 not msgpack")
    await bus.publish(subject, msgspec.structs.replace(event, key="k3"))
    assert [e.key async for _, e in bus.read_log("SHARDS", subject, 1, ShardWritten)] == ["k1", "k3"]


# --- s3:// prompt sources --------------------------------------------------------------------------


def test_s3_prompts_in_a_missing_bucket_or_with_refused_credentials_name_the_bucket(stack, cfg, store, monkeypatch):
    store.put_bytes("inputs/p.jsonl", b'{"prompt": "hi"}\n')
    with pytest.raises(SourceError, match=r"bucket 'no-such-bucket' does not exist"), \
            local_copy("s3://no-such-bucket/p.jsonl", cfg):
        pass
    with pytest.raises(SourceError, match=rf"no such object in bucket '{stack.bucket}'"), \
            local_copy(f"s3://{stack.bucket}/inputs/missing.jsonl", cfg):
        pass
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    with pytest.raises(SourceError, match=rf"refused stat inputs/p.jsonl in bucket '{stack.bucket}': (AccessDenied|SignatureDoesNotMatch)"), \
            local_copy(f"s3://{stack.bucket}/inputs/p.jsonl", cfg):
        pass


def test_feed_cli_exit_codes_for_a_refused_source(stack, stack_env, store, tmp_path) -> None:
    good = tmp_path / "good.jsonl"
    good.write_text('{"prompt": "one"}\n')
    run = new_run()
    r = cli(stack_env, "feed", "--run", run, "s3://no-such-bucket/p.jsonl", str(good))
    assert r.returncode == 2, r.stdout + r.stderr
    assert "refused s3://no-such-bucket/p.jsonl" in r.stderr and "bucket 'no-such-bucket' does not exist" in r.stderr
    assert "accepted 1" in r.stdout and "Traceback" not in r.stderr  # the good source was still fed
    manifest = msgspec.json.decode(store.get_bytes(Keys.manifest(run)))
    assert set(manifest["refused"]) == {"s3://no-such-bucket/p.jsonl"} and manifest["total_accepted"] == 1
    bad_env = {**stack_env, "AWS_SECRET_ACCESS_KEY": "not-the-secret"}
    r = cli(bad_env, "feed", "--run", run, str(good))
    assert r.returncode == 3 and re.search(rf"refused .* in bucket '{stack.bucket}': (AccessDenied|SignatureDoesNotMatch)",
                                           r.stderr), r.stderr


def test_run_refuses_a_missing_bucket_before_starting_anything(stack, stack_env, store) -> None:
    run = new_run()
    r = cli(stack_env, "run", "--run", run, "--prompts", "s3://no-such-bucket/prompts.jsonl", "--plain", "--no-dashboard")
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.strip().splitlines() == [
        "dfpipe run: s3://no-such-bucket/prompts.jsonl: bucket 'no-such-bucket' does not exist at "
        f"{stack.s3_endpoint} (create it, or set store.create_bucket)"]
    assert not list(store.list(f"runs/{run}/"))  # nothing started: no feeder crash loop


# --- read-only commands on a run or a stack that does not exist -------------------------------------


READ_ONLY = [("status",), ("drops",), ("eval",), ("replay", "tokenize"), ("replay", "generate", "--failed")]


@pytest.fixture(scope="module")
def fresh_stack_env(tmp_path_factory):
    """A stack on which nothing has run: no streams at all."""
    root = tmp_path_factory.mktemp("fresh")
    s = EmbeddedStack(root, Ports.free())
    s.start()
    try:
        yield {**os.environ, **s.env(), "DFLASH_DATA_DIR": str(root)}
    finally:
        s.stop()


@pytest.mark.parametrize("command", READ_ONLY, ids=" ".join)
@pytest.mark.stack  # fresh_stack_env starts its own stack
def test_read_only_commands_on_a_fresh_stack_answer_in_one_line(fresh_stack_env, command) -> None:
    r = cli(fresh_stack_env, *command, "--run", "nothing-yet")
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.strip().endswith("no run 'nothing-yet': this stack has no dflash-pipeline streams yet "
                                     f"(nothing was fed or started on NATS at {fresh_stack_env['DFLASH_NATS_URL']})")
    assert len(r.stderr.strip().splitlines()) == 1 and not r.stdout


@pytest.mark.parametrize("command", READ_ONLY, ids=" ".join)
def test_read_only_commands_on_a_misspelt_run_answer_in_one_line(stack_env, bus, command) -> None:
    r = cli(stack_env, *command, "--run", "no-such-run-x1")
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.strip().splitlines() == [
        f"dfpipe {' '.join(command[:2] if command[0] == 'replay' else command[:1])}: no run 'no-such-run-x1' on this "
        "stack: nothing was fed to it and no service reported for it (check the name)"]


async def test_dashboard_says_in_one_line_that_its_run_is_not_there_yet(cfg, bus) -> None:
    from dashboard.cli import _run_note

    note = await asyncio.to_thread(_run_note, cfg)
    assert note == f"no run {cfg.run!r} on this stack: nothing was fed to it and no service reported for it " \
                   "(check the name); the page shows it once it starts"
    await bus.publish(Subjects.prompts(cfg.run), PromptTask(run=cfg.run, prompt_id="p", messages=task(cfg.run, "p").messages))
    assert await asyncio.to_thread(_run_note, cfg) == ""
