"""`dfpipe`: one entry point, one subcommand per job.

Each package registers its own subcommands: its `cli` module's `register(sub, replay)` is named in
pyproject.toml under `[project.entry-points."dfpipe.commands"]`, so a reader finds a command's whole
story in the package it belongs to, and `shared/` names no service.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable
from importlib.metadata import EntryPoint
from typing import Any

from shared.config import Config, ConfigError, load_config
from shared.exits import Exit
from shared.plugins import COMMANDS, registered


def command_registrars() -> list[EntryPoint]:
    """Every package's `register(sub, replay)` (pyproject.toml's `dfpipe.commands` entry points)."""
    return list(registered(COMMANDS))


def load(args: argparse.Namespace) -> Config:
    """The validated config, pointed at the embedded stack when one is running."""
    from shared.stack import connect_config

    cfg = load_config(getattr(args, "config", None))
    if getattr(args, "run", None):
        import msgspec

        from shared.topology import check_name

        cfg = msgspec.structs.replace(cfg, run=check_name("run", args.run))
    return connect_config(cfg)


def reader_config(cfg: Config) -> Config:
    """`cfg` for a one-shot reader (status, drops): S3 calls give up after the bus's read deadline too, so the
    command's bound is one figure (`bus.read_deadline_s`; the connection: 10 s), then Exit.UNREACHABLE."""
    import msgspec

    store = msgspec.structs.replace(cfg.store, retry_deadline_s=min(cfg.store.retry_deadline_s, cfg.bus.read_deadline_s))
    return msgspec.structs.replace(cfg, store=store)


# --- dfpipe stack ------------------------------------------------------------------------------


def _stack(args: argparse.Namespace) -> int:
    from shared.config import data_dir
    from shared.stack import EmbeddedStack, is_external, stack_down, stack_up

    cfg = load_config(args.config)
    if is_external():
        print("external stack configured (DFLASH_NATS_URL / DFLASH_S3_ENDPOINT): nothing to start or stop")
        print(f"  nats: {os.environ.get('DFLASH_NATS_URL', cfg.bus.url)}")
        print(f"  s3:   {os.environ.get('DFLASH_S3_ENDPOINT', cfg.store.endpoint)}")
        return Exit.OK
    root = data_dir(cfg)
    if args.action == "up":
        stack = stack_up(cfg)
        print(f"stack up (data in {root})")
        print(f"  nats  {stack.nats_url}  pid {stack.pids['nats']}")
        print(f"  s3    http://{stack.s3_endpoint}  bucket {stack.bucket}  pid {stack.pids['s3']}")
        print(f"  credentials: {root / 'credentials'} (0600)" if not os.environ.get("AWS_ACCESS_KEY_ID")
              else "  credentials: from AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY")
        return Exit.OK
    if args.action == "down":
        stopped = stack_down(cfg)
        print("stopped " + ", ".join(stopped) if stopped else f"no embedded stack recorded in {root}")
        return Exit.OK
    stack = EmbeddedStack.load(root)
    if stack is None:
        print(f"no embedded stack recorded in {root} (run `dfpipe stack up`)")
        return Exit.FAILED
    healthy = True
    for name, st in stack.status().items():
        mark = "healthy" if st["healthy"] else ("running, unhealthy" if st["alive"] else "not running")
        healthy &= bool(st["healthy"])
        print(f"  {name:5} port {st['port']:<6} pid {st['pid']:<8} {mark}")
    return Exit.OK if healthy else Exit.FAILED


def _register_stack(sub: Any) -> None:
    p = sub.add_parser("stack", help="the embedded nats-server + SeaweedFS S3 (up | status | down)")
    p.add_argument("action", choices=["up", "status", "down"])
    p.set_defaults(func=_stack)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dfpipe", description=__doc__.splitlines()[0])
    parser.add_argument("--config", "-c", default=None, help="TOML config file (default: $DFLASH_CONFIG)")
    parser.add_argument("--log-level", default=os.environ.get("DFLASH_LOG_LEVEL", "INFO"))
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    replay_parser = sub.add_parser("replay", help="re-run a stage from the logs (dead letters, shards)")
    replay = replay_parser.add_subparsers(dest="replay_target", required=True, metavar="STAGE")
    _register_stack(sub)
    for registrar in command_registrars():
        try:
            register = registrar.load()
        except ModuleNotFoundError as e:
            if e.name and registrar.module.startswith(e.name):
                continue  # that package is not part of this build
            raise
        register(sub, replay)
    if not replay.choices:
        sub._name_parser_map.pop("replay", None)  # no stage offers replay yet
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return int(func(args) or Exit.OK)
    except ConfigError as e:
        print(f"dfpipe: config error: {e}", file=sys.stderr)
        return Exit.USAGE
    except Exception as e:
        from shared.failures import Failure, classify, describe

        failure = classify(e)
        if failure is Failure.TRANSIENT:
            # NATS or S3 did not answer within the command's bound (a read retried through its deadline, a
            # connection that never came up): one line saying what, not a traceback
            print(f"dfpipe {args.command}: stack unreachable: {describe(e)}", file=sys.stderr)
            return Exit.UNREACHABLE
        if failure is not Failure.FATAL:
            raise
        # a worker stopped by a fault of its settings (shared.bus.Halt, shared.store.StoreMisconfigured): the
        # reason, not a traceback
        print(f"dfpipe {args.command}: stopped: {e}", file=sys.stderr)
        return Exit.HALTED
    except KeyboardInterrupt:
        return Exit.INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
