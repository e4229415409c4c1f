"""`dfpipe tokenize` (the service) and `dfpipe replay tokenize` (re-tokenize from the shard log)."""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any

from shared.exits import Exit


def _config(args: argparse.Namespace) -> Any:
    import msgspec

    from shared.cli import load

    cfg = load(args)
    if getattr(args, "template", None):
        cfg = msgspec.structs.replace(
            cfg, tokenizer=msgspec.structs.replace(cfg.tokenizer, chat_template_file=args.template)
        )
    return cfg


def _template_name(cfg: Any) -> str:
    return f"{cfg.tokenizer.chat_template_file} " if cfg.tokenizer.chat_template_file else ""


def _tokenize(args: argparse.Namespace) -> int:
    from .render import TemplateError
    from .service import run_service

    cfg = _config(args)
    try:
        service = asyncio.run(run_service(cfg, worker=args.worker, burst=args.burst))
    except TemplateError as e:
        print(f"dfpipe tokenize: the chat template {_template_name(cfg)}cannot give exact loss masks: {e}")
        return Exit.USAGE
    if service is None:
        print(f"run {cfg.run}: stopped before the tokenizer started")
        return Exit.OK
    c = service.counts
    print(f"run {cfg.run} [template {service.fingerprint}]: {c.shards} shards, {c.samples_kept}/{c.samples_in} "
          f"samples kept, {c.tokens} tokens ({c.supervised_tokens} supervised), drift {c.drift}")
    for reason, n in sorted(c.dropped.items()):
        print(f"  dropped {n:>7}  {reason}")
    if service.tripped is not None:
        print(f"QUALITY GATE TRIPPED: {service.tripped.message}")
        for ex in service.tripped.examples:
            print(f"  e.g. {ex}")
        return Exit.QUALITY_GATE
    return Exit.OK


async def _replay_async(cfg: Any, from_seq: int) -> Any:
    from shared.bus import Bus
    from shared.store import Store

    from .fingerprint import load_target_tokenizer
    from .replay import replay_tokenize

    tok = await asyncio.to_thread(load_target_tokenizer, cfg)
    store = await asyncio.to_thread(Store.open, cfg)
    async with await Bus.connect(cfg.bus, "tokenizer-replay", deadline_s=30) as bus:
        if missing := await bus.run_missing(cfg.run):
            print(f"dfpipe replay tokenize: {missing}", file=sys.stderr)
            raise SystemExit(Exit.USAGE)
        await bus.ensure_streams()
        return await replay_tokenize(cfg, bus, store, tok, from_seq=from_seq)


def _replay(args: argparse.Namespace) -> int:
    from shared.topology import Keys

    from .render import TemplateError

    cfg = _config(args)
    try:
        s = asyncio.run(_replay_async(cfg, args.from_seq))
    except TemplateError as e:
        print(f"dfpipe replay tokenize: the chat template {_template_name(cfg)}cannot give exact loss masks: {e}")
        return Exit.USAGE
    print(f"run {cfg.run}: replayed {s.shards} shards from seq {args.from_seq} under template {s.fingerprint}: "
          f"{s.written} written, {s.already_present} already present (unchanged), {len(s.failed)} failed")
    print(f"  output: {Keys.tokenized_prefix(cfg.run, s.fingerprint)}")
    for seq, key, err in s.failed:
        print(f"  failed seq {seq} {key}: {err}")
    if s.gate:
        print(f"QUALITY GATE TRIPPED: {s.gate}")
        return Exit.QUALITY_GATE
    return Exit.FAILED if s.failed else Exit.OK


async def _run_missing(cfg: Any) -> str:
    from shared.bus import Bus

    async with await Bus.connect(cfg.bus, "drops", deadline_s=10) as bus:
        return await bus.run_missing(cfg.run)


def _drops(args: argparse.Namespace) -> int:
    """Every record the tokenizer dropped, with its reason and the start of its answer (or the template's
    message), from the per-shard lists next to the tokenized shards; one template fingerprint or all."""
    from collections import Counter

    import msgspec

    from shared.cli import load, reader_config
    from shared.store import Store
    from shared.topology import Keys

    cfg = reader_config(load(args))
    store = Store.open(cfg, ensure_bucket=False)
    if missing := asyncio.run(_run_missing(cfg)):
        print(f"dfpipe drops: {missing}", file=sys.stderr)
        return Exit.USAGE
    prefix = Keys.tokenized_prefix(cfg.run, args.fingerprint)
    keys = [k for k in store.list(prefix) if "/drops/" in k and k.endswith(".jsonl")]
    counts: Counter[tuple[str, str]] = Counter()
    shown = 0
    for key in keys:
        fingerprint = key.split("/tokenized/", 1)[1].split("/", 1)[0]
        for line in store.get_bytes(key).splitlines():
            d = msgspec.json.decode(line)
            if args.reason and d["reason"] != args.reason:
                continue
            counts[(fingerprint, d["reason"])] += 1
            if args.limit is None or shown < args.limit:
                print(f"{fingerprint}  {d['prompt_id']}  [{d['reason']}]  {d['example']!r}")
                shown += 1
    if not counts:
        print(f"run {cfg.run}: no dropped records" + (f" with reason {args.reason}" if args.reason else ""))
    for (fingerprint, reason), n in sorted(counts.items()):
        print(f"  {fingerprint}  {reason}: {n}")
    return Exit.OK


def register(sub: Any, replay: Any) -> None:
    p = sub.add_parser("tokenize", help="the tokenizer service: completion shards -> training samples")
    p.add_argument("--run", required=True)
    p.add_argument("--worker", default="tokenizer")
    p.add_argument("--burst", action="store_true", help="stop once no shard is pending")
    p.set_defaults(func=_tokenize)
    d = sub.add_parser("drops", help="the records the tokenizer dropped, with reasons")
    d.add_argument("--run", required=True)
    d.add_argument("--reason", default=None, help="only this reason (e.g. template_error)")
    d.add_argument("--fingerprint", default=None, help="only this template fingerprint's output")
    d.add_argument("--limit", type=int, default=None, help="print at most this many records (the counts cover all)")
    d.set_defaults(func=_drops)
    r = replay.add_parser("tokenize", help="re-tokenize every completion shard from the shard log")
    r.add_argument("--run", required=True)
    r.add_argument("--from-seq", type=int, default=1, help="first SHARDS stream sequence to replay")
    r.add_argument("--template", default=None, help="a Jinja chat template file replacing the target's")
    r.set_defaults(func=_replay)
