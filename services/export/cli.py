"""`dfpipe export` and `dfpipe export-data`."""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any

from shared.exits import Exit


def _refused(line: str, code: Exit) -> int:
    print(line, file=sys.stderr)
    return code


def _export(args: argparse.Namespace) -> int:
    from shared.bus import Bus
    from shared.cli import load
    from shared.store import Store

    from .destination import DestinationNotEmpty
    from .drafter import ExportRefused, export_drafter

    if args.step is not None and args.step < 0:
        return _refused(f"dfpipe export: --step must be >= 0, not {args.step}", Exit.USAGE)
    cfg = load(args)

    async def main() -> dict[str, Any]:
        store = await asyncio.to_thread(Store.open, cfg)
        async with await Bus.connect(cfg.bus, "export", deadline_s=30) as bus:
            return await export_drafter(cfg, store, bus, args.dir, args.step,
                                        warn=lambda line: print(line, file=sys.stderr))

    try:
        facts = asyncio.run(main())
    except ExportRefused as e:
        return _refused(str(e), e.code)
    except DestinationNotEmpty as e:
        return _refused(f"dfpipe export: {e}", Exit.USAGE)
    ev = facts["eval"]
    print(f"exported run {cfg.run} step {facts['step']} ({facts['checkpoint']}) to {facts['drafter_dir']}: "
          f"config.json, model.safetensors, {len(facts['tokenizer_files'])} tokenizer files, README.md, SHA256SUMS")
    print(f"  τ {ev['tau']:.3f} on {ev['prompts']} held-out prompts (eval of this checkpoint)" if ev
          else f"  not evaluated: {facts['eval_note']}")
    print(f"  serve it: see {facts['drafter_dir']}/README.md, section Serving")
    return Exit.OK


def _export_data(args: argparse.Namespace) -> int:
    from shared.bus import Bus
    from shared.cli import load
    from shared.store import Store

    from .dataset import FORMATS, export_data
    from .destination import DestinationNotEmpty, open_destination

    formats = tuple(dict.fromkeys(f.strip() for arg in (args.format or ["parquet"]) for f in arg.split(",")))
    if bad := [f for f in formats if f not in FORMATS]:
        return _refused(f"dfpipe export-data: unknown --format {', '.join(bad)} (choose from {', '.join(FORMATS)})",
                        Exit.USAGE)
    if args.rows_per_file < 1:
        return _refused(f"dfpipe export-data: --rows-per-file must be >= 1, not {args.rows_per_file}", Exit.USAGE)
    cfg = load(args)

    async def main() -> dict[str, Any]:
        from .drafter import run_card_facts

        store = await asyncio.to_thread(Store.open, cfg)
        async with await Bus.connect(cfg.bus, "export-data", deadline_s=30) as bus:
            if missing := await bus.run_missing(cfg.run):
                raise DestinationNotEmpty(missing)  # reported as a refusal like the others, nothing written
            fingerprint, facts = await run_card_facts(cfg, bus, store)
        dest = await asyncio.to_thread(open_destination, cfg, args.dir)
        try:
            return await asyncio.to_thread(
                export_data, cfg, store, dest, fingerprint, formats=formats, rows_per_file=args.rows_per_file,
                samples=args.samples, source=args.source, license=args.license, card_facts=facts)
        except BaseException:
            await asyncio.to_thread(dest.abort)
            raise

    try:
        facts = asyncio.run(main())
    except DestinationNotEmpty as e:
        return _refused(f"dfpipe export-data: {e}", Exit.USAGE)
    c = facts["counts"]
    print(f"exported run {cfg.run}: {c['rows']} completions ({c['kept']} kept by the tokenizer, {c['truncated']} "
          f"truncated) from {c['records']} records in {c['shards']} shards, as {', '.join(formats)}"
          f"{' + tokenized samples' if args.samples else ''}, to {args.dir} ({len(facts['files'])} files, "
          "README.md, SHA256SUMS)")
    return Exit.OK


def register(sub: Any, replay: Any) -> None:
    e = sub.add_parser("export", help="a run's drafter as a folder an engine serves: config, weights, tokenizer, "
                                      "model card with serving commands, sha256 manifest")
    e.add_argument("--run", required=True)
    e.add_argument("--step", type=int, default=None,
                   help="the checkpoint's step (default: the one the eval measured, else the latest)")
    e.add_argument("dir", help="a new or empty folder, or s3://BUCKET/PREFIX")
    e.set_defaults(func=_export)
    d = sub.add_parser("export-data", help="a run's regenerated completions as Parquet and/or ShareGPT JSONL, "
                                           "with a dataset card and a sha256 manifest")
    d.add_argument("--run", required=True)
    d.add_argument("--format", action="append", help="parquet (default) and/or sharegpt; repeat or comma-separate")
    d.add_argument("--samples", action="store_true", help="also the tokenized samples (ids + loss mask) as Parquet")
    d.add_argument("--source", default="", help="where the prompts came from, for the card (as you declare it)")
    d.add_argument("--license", default="", help="the prompts' licence, for the card (as you declare it)")
    d.add_argument("--rows-per-file", type=int, default=20_000, help="rows per output file")
    d.add_argument("dir", help="a new or empty folder, or s3://BUCKET/PREFIX")
    d.set_defaults(func=_export_data)
