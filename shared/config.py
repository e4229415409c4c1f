"""One typed configuration for every service: a TOML file plus `DFLASH_*` environment overrides.

Precedence: defaults < TOML file (`--config` or `DFLASH_CONFIG`) < environment.
Environment keys: `DFLASH_<SECTION>__<KEY>` (e.g. `DFLASH_GENERATOR__MAX_INFLIGHT=32`), values
parsed as TOML scalars; plus the short aliases in `ENV_ALIASES` used by compose and clusters.
Every section forbids unknown keys, so a typo fails at start with the key named.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec


class ConfigError(ValueError):
    pass


class Section(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    pass


class BusConfig(Section):
    url: str = "nats://127.0.0.1:4222"  # comma-separated for a cluster
    connect_timeout_s: float = 5.0
    reconnect_wait_s: float = 2.0
    # Credentials come from the environment (DFLASH_NATS_USER/DFLASH_NATS_PASSWORD or DFLASH_NATS_TOKEN),
    # or from a creds file; never from this file.
    creds_file: str = ""
    replicas: int = 1  # stream replicas: 3 on a JetStream cluster
    progress_max_age_s: float = 30 * 86400.0  # a dashboard opened on day 3 still sees day 1
    duplicate_window_s: float = 24 * 3600.0
    # How long a reader of run state (ledger, status, `dfpipe run`'s poll, dashboard, eval) retries a JetStream
    # call that fails transiently: a leader election takes a few seconds, a cluster node's restart ~15 s, so 30 s
    # rides through a failover; a longer outage is reported (one-shot commands exit UNREACHABLE).
    read_deadline_s: float = 30.0


class StoreConfig(Section):
    endpoint: str = "127.0.0.1:8333"  # host:port, or https://s3.amazonaws.com
    bucket: str = "dflash"
    secure: bool = False
    region: str = "us-east-1"
    # Credentials: AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, else this 0600 file (two lines: key, secret),
    # else the embedded stack's generated file in the data dir.
    credentials_file: str = ""
    retry_deadline_s: float = 120.0  # transient faults are retried with backoff for this long
    create_bucket: bool = True


class StackConfig(Section):
    data_dir: str = ""  # default: $XDG_DATA_HOME/dflash
    host: str = "127.0.0.1"
    nats_port: int = 4222
    nats_monitor_port: int = 8222
    s3_port: int = 8333
    # weed mini opens about a dozen more ports; they are derived from this base unless set.
    weed_port_base: int = 19300
    # JetStream's fsync (nats-server `sync_interval`) for the embedded single node: "always" fsyncs every
    # write before it is acked, so a power cut loses nothing acknowledged (nats-server's own default, 2 min,
    # can lose up to that much acked work: Jepsen, NATS 2.12.1). Measured cost in bench/results/bus.json;
    # an interval ("2m", "10s") is the choice where a replicated cluster already covers one machine's loss.
    nats_sync: Annotated[str, msgspec.Meta(pattern=r"^(always|[0-9]+(ms|s|m|h))$")] = "always"


class ModelConfig(Section):
    target: str = "smollm2"  # alias (see shared/model.py) or a local HF directory
    device: str = "auto"  # auto | cpu | cuda | cuda:N


class SamplingConfig(Section):
    temperature: float = 0.7
    top_p: float = 0.95
    top_k: int = -1  # -1: off
    max_new_tokens: int = 4096
    enable_thinking: bool = False  # must match how the target will be served
    seed: int = 0


class FeederConfig(Section):
    max_prompt_tokens: int = 8192
    publish_window: int = 2000  # async publishes in flight before waiting for acks
    # A record (line, array element) longer than this is rejected unread: it bounds the feeder's memory
    # whatever the input (a few times this, see docs/prompts.md, "What happens to bad input"), far above any prompt within max_prompt_tokens.
    max_record_bytes: int = 16 << 20


class GeneratorConfig(Section):
    # hf (the embedded default) | sglang | openai | synthetic (a load generator, benchmarks/tests only): the kinds
    # are registered in pyproject.toml (`dfpipe.backends`, shared/plugins.py), which load_config checks
    backend: str = "hf"
    # An upper bound on the requests one generator keeps in flight; 0: none set — the level follows the engine
    # (services/generator/engine_fill.py: its max_running_requests and running/queued counts, or measured
    # throughput) up to 1024 (memory stays ~200 MB); the in-process hf/synthetic backends then use fallback_inflight.
    max_inflight: int = 0
    # The safe fixed level while the engine reports nothing yet (or never does): today's former default.
    fallback_inflight: int = 16
    adaptive: bool = True  # False: exactly max_inflight (or fallback_inflight) in flight, as before (benches)
    engine_poll_s: float = 0.5  # how often the engine's load is read (a slot freed is refilled within this)
    engine_ready_s: float = 0.0  # how long to wait for the engine's health check; 0: 1800 s launched, 120 s not
    batch_size: int = 8  # hf backend: prompts per generate() call
    shard_records: int = 256
    shard_seconds: float = 60.0
    shard_idle_s: float = 1.0  # a shard is also written once the engine has been idle this long (the queue ran dry)
    ack_wait_s: float = 60.0
    max_deliver: int = 5
    # A cap on the run's unacked prompts, shared by all its workers (0: none; each worker holds at most its
    # level + shard_records). Below workers x that, no worker fills a shard; when set, a worker's level stays
    # below it less a shard (engine_fill.auto_upper).
    max_ack_pending: int = 0
    engine_url: str = ""  # sglang/openai backends
    engine_model: str = ""  # model name sent to an openai-compatible server
    openai_endpoint: Literal["chat", "completions"] = "chat"
    # 0: automatic — the longest completion that can wait in a full engine's queue (engine_fill.RequestTimeout:
    # 3 x max_new_tokens x the measured per-token time, at least 120 s; 1800 s until measured)
    request_timeout_s: float = 0.0
    launch: bool = False  # sglang: start `python -m sglang.launch_server` for this GPU
    launch_args: list[str] = []  # passed through, e.g. speculative flags
    max_context_tokens: int = 0  # prompt + max_new_tokens limit; 0: the model's own (hf backend)
    drain_s: float = 60.0  # on SIGTERM: how long in-flight generations may finish before they are requeued
    progress_every_s: float = 3.0
    # backend "synthetic" (a load generator for benchmarks and tests): completion lengths uniform in
    # [min, max] tokens (small, so 914K prompts tokenize in minutes), at most `synthetic_rate` completions/s
    # per worker (0: as fast as the worker goes)
    synthetic_min_tokens: int = 40
    synthetic_max_tokens: int = 80
    synthetic_rate: float = 0.0


class TokenizerConfig(Section):
    max_length: int = 4096
    min_supervised_tokens: int = 0  # 0: 2 x trainer.block_size
    truncated_policy: Literal["drop", "keep"] = "drop"
    train_on_reasoning: bool = True
    gate_window: int = 200
    gate_threshold: float = 0.2
    gate_override: bool = False  # keep going past a tripped gate (logged and shown, never silent)
    max_ack_pending: int = 16
    ack_wait_s: float = 60.0  # a killed worker's shards come back after this (in-flight ones are heartbeated)
    # Same-answer collapse: the most common answer text over a full gate window above this share trips the gate.
    gate_identical_threshold: float = 0.5
    # An answer ending in >= repetition_min_tail tokens of one piece of <= repetition_max_period tokens
    # repeated (at least 4 times) is degenerate.
    repetition_max_period: int = 32
    repetition_min_tail: int = 64
    max_inflight: int = 2  # shards handled at once (download overlaps tokenizing; tokenizing is serialized)
    processes: int = 0  # processes building each shard's samples, the service's own included; 0: one per CPU (max 8)
    chat_template_file: str = ""  # a Jinja file replacing the target tokenizer's template (a template fix)


class TrainerConfig(Section):
    # "dflash": the paper's drafter; "dflash2": DFlash 2, which adds per-layer convolutions and a candidate
    # selector (services/trainer/model_dflash2.py) with the four knobs below, at the released drafters' values
    arch: Literal["dflash", "dflash2"] = "dflash"
    conv_kernel_size: int = 2  # dflash2: taps of each layer's causal convolution over the block's slots
    conv_group_size: int = 16  # dflash2: channels sharing one dynamic kernel (divides the hidden size)
    selector_rank: int = 256  # dflash2: width of the selector's predecessor/successor codebooks
    selector_top_k: int = 16  # dflash2: candidates per slot the selector walks over
    selector_loss_weight: float = 1.0  # dflash2: loss = DFlash loss + this × selector loss (same slot weights)
    block_size: int = 16
    num_layers: int = 5
    num_feature_layers: int = 5
    target_layer_ids: list[int] = []  # empty: the paper's rule
    anchors_per_sequence: int = 512
    lr: float = 6e-4
    weight_decay: float = 0.0
    warmup_ratio: float = 0.04
    grad_clip: float = 1.0
    grad_accum: int = 1
    token_budget: int = 16384  # tokens per micro-batch of the target forward
    epochs: int = 6
    max_steps: int = 0  # 0: derived from epochs
    max_length: int = 4096
    checkpoint_every: int = 200
    logits_chunk: int = 2048
    autocast: Literal["auto", "bf16", "off"] = "auto"  # drafter bf16 autocast: auto (GPU, or a CPU where bf16 times faster) | bf16 | off
    # The frozen target's training forward on CPU: fp32 weights, "bf16" autocasts its matmuls (~1.7x
    # on CPUs with AVX512-BF16/AMX, features within ~0.5%; ~7x slower on AVX2-only CPUs, which emulate
    # bf16), "auto" only where a timed probe finds bf16 matmuls faster than fp32 (services/trainer/build.py:
    # emulated or AVX2-restricted bf16 is not picked); GPU targets load as bf16 weights either way.
    # `dfpipe eval` always decodes with the target as loaded.
    target_autocast: Literal["off", "auto", "bf16"] = "off"
    # >0: the drafter proposes only from the K ids most frequent in the training labels (EAGLE-3's
    # draft vocabulary), so the frozen head costs K/V of the whole one; labels outside are not trained on.
    draft_vocab: int = 0
    # "random" as the paper; "target" starts the drafter from the target's layers above the deepest
    # feature layer (DFlashDrafter.init_from_target), which learns faster in short runs.
    init: Literal["random", "target"] = "random"
    # false: each slot's label is the regenerated token (the paper); true: the target's whole next-token
    # distribution there (EAGLE's soft labels), from a forward run to the top; the argmax is the same token.
    soft_labels: bool = False
    seed: int = 0
    holdout_mod: int = 20  # every 20th prompt (by id hash) is held out of training for `dfpipe eval`
    progress_every: int = 1  # steps between TrainerProgress events
    wait_for_data_s: float = 3600.0  # how long to wait for the first tokenized shard, and for a new one while the data is incomplete
    eval_prompts: int = 16
    eval_max_new_tokens: int = 64
    # Stop after this much training time (0: no limit), checkpointed as "done"; the cosine schedule then
    # follows whichever of steps and time is further along (so such runs are not bit-reproducible).
    max_train_s: float = 0.0
    # `dfpipe run` only (0: off): the whole run, from the command to the eval's report, within this many seconds.
    # When training starts, its time budget becomes what is left of it, less the eval's expected time on this
    # machine (services/pipeline/expect.py), and at most max_train_s when that is set. The demo's 20 minutes.
    # Only where that time is estimated: the in-process hf backend on a CPU.
    run_budget_s: float = 0.0
    # Local disk cache of the tokenized shards as flat token/mask arrays, shared by the ranks of a node
    # (empty: <stack.data_dir>/cache/tokenized). Needs about 5 bytes per token of the run's data.
    data_cache_dir: str = ""
    # signals: the run's training lease (one trainer per run). A holder renews it every third of this; a
    # trainer killed without releasing it blocks a new one for at most this long (30 s: a few missed renewals
    # on a loaded machine, short enough that a restart after a crash waits little).
    lease_ttl_s: float = 30.0


class DashboardConfig(Section):
    host: str = "127.0.0.1"
    port: int = 8501


class ViewConfig(Section):
    """How every view of a run (`dfpipe status`, `dfpipe run`'s display, the dashboard: `shared.view`) judges it."""

    # Rates and ETAs over the last five minutes: several completion shards even at a modest rate, short
    # enough that a slowdown shows within minutes.
    rate_window_s: float = 300.0
    # A worker with no progress report for a minute is silent (not counted in rates): six missed heartbeats of
    # the slowest reporter (the trainer's, every 10 s); a generator reports every 3 s.
    silent_after_s: float = 60.0
    # The trainer logs one progress line (step of total, loss, τ, steps/s, ETA) this often.
    log_every_s: float = 30.0


class LayoutConfig(Section):
    """How `dfpipe run` places engines and training on GPUs (shared/gpus.py: `--gpus`, `--tp`)."""

    # The engines' URLs, one per GPU group in order (`dfpipe run --engine-urls`). Empty: generator.engine_url,
    # whose port is advanced by the group's index when the generators launch their engines, so N servers on
    # one host do not collide (30000, 30001, ...).
    engine_urls: list[str] = []
    # GPUs training runs on when the engines are not the pipeline's to stop (`--train-gpus`). Empty: every
    # GPU of the run's groups, once the engines `dfpipe run` launched (or the hf generators) have stopped.
    train_gpus: list[int] = []
    # CPU-only runs: `dfpipe run` trains under torchrun with this many gloo ranks. Default 1 (one process):
    # ranks on the same CPU share its cores, so more only pays on a machine with cores to spare.
    cpu_train_ranks: int = 1


class CalibrateConfig(Section):
    """`dfpipe calibrate` (services/generator/calibrate.py) and what the run does with its result."""

    # Prompts sampled from the run's own files: a few hundred give a completion-length mean within a few
    # percent (lognormal-ish lengths, sd ~0.6 of the mean) and cover every level's requests with repeats.
    sample: int = 300
    # The sweep doubles concurrency until tokens/s stops rising 5%; this bounds it (SGLang's own
    # max_running_requests rarely exceeds 1024 on one GPU).
    max_concurrency: int = 1024
    # `+mtp` layouts: the engine's speculative decoding with the model's own MTP heads, as SGLang's docs
    # give it for MTP-enabled models ("Multi Token Prediction": EAGLE with 3 steps, top-k 1, 4 draft tokens).
    mtp_args: list[str] = msgspec.field(default_factory=lambda: [
        "--speculative-algorithm", "EAGLE", "--speculative-num-steps", "3", "--speculative-eagle-topk", "1",
        "--speculative-num-draft-tokens", "4"])
    # A generator starts with the concurrency the run's calibration measured for its engine (its best level)
    # instead of generator.max_inflight. Default on: a calibrated level is the engine's own measured peak.
    start_generators: bool = True


class Config(Section):
    run: str = "default"
    bus: BusConfig = msgspec.field(default_factory=BusConfig)
    store: StoreConfig = msgspec.field(default_factory=StoreConfig)
    stack: StackConfig = msgspec.field(default_factory=StackConfig)
    model: ModelConfig = msgspec.field(default_factory=ModelConfig)
    sampling: SamplingConfig = msgspec.field(default_factory=SamplingConfig)
    feeder: FeederConfig = msgspec.field(default_factory=FeederConfig)
    generator: GeneratorConfig = msgspec.field(default_factory=GeneratorConfig)
    tokenizer: TokenizerConfig = msgspec.field(default_factory=TokenizerConfig)
    trainer: TrainerConfig = msgspec.field(default_factory=TrainerConfig)
    dashboard: DashboardConfig = msgspec.field(default_factory=DashboardConfig)
    layout: LayoutConfig = msgspec.field(default_factory=LayoutConfig)
    calibrate: CalibrateConfig = msgspec.field(default_factory=CalibrateConfig)
    view: ViewConfig = msgspec.field(default_factory=ViewConfig)


# Short names for the settings that deployments set most (compose, clusters, AWS).
ENV_ALIASES: dict[str, tuple[str, ...]] = {
    "DFLASH_RUN": ("run",),
    "DFLASH_NATS_URL": ("bus", "url"),
    "DFLASH_S3_ENDPOINT": ("store", "endpoint"),
    "DFLASH_S3_BUCKET": ("store", "bucket"),
    "DFLASH_S3_SECURE": ("store", "secure"),
    "DFLASH_DATA_DIR": ("stack", "data_dir"),
    "DFLASH_MODEL": ("model", "target"),
}
# DFLASH_* variables that are read elsewhere and are not config keys.
ENV_NOT_CONFIG = {
    "DFLASH_CONFIG",
    "DFLASH_MODEL_CACHE",
    "DFLASH_NATS_USER",
    "DFLASH_NATS_PASSWORD",
    "DFLASH_NATS_TOKEN",
    "DFLASH_DASHBOARD_PASSWORD",
    "DFLASH_LOG_LEVEL",
}


# Keys that moved, old -> new: a config that still sets the old one is told the new name.
MOVED_KEYS: dict[tuple[str, ...], tuple[str, ...]] = {("dashboard", "silent_after_s"): ("view", "silent_after_s")}


def _parse_env_value(raw: str) -> Any:
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


def _set(tree: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    for part in path[:-1]:
        node = tree.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"config key {'.'.join(path)!r}: {part!r} is not a section")
        tree = node
    tree[path[-1]] = value


def _env_overrides(env: dict[str, str]) -> list[tuple[str, tuple[str, ...], Any]]:
    out = []
    for name, raw in sorted(env.items()):
        if not name.startswith("DFLASH_") or name in ENV_NOT_CONFIG:
            continue
        if name in ENV_ALIASES:
            out.append((name, ENV_ALIASES[name], _parse_env_value(raw)))
        elif "__" in name:
            path = tuple(p.lower() for p in name[len("DFLASH_") :].split("__"))
            out.append((name, path, _parse_env_value(raw)))
        else:
            known = ", ".join(sorted([*ENV_ALIASES, *ENV_NOT_CONFIG]))
            raise ConfigError(
                f"unknown environment variable {name}: use DFLASH_<SECTION>__<KEY> or one of {known}"
            )
    return out


def _describe(err: msgspec.ValidationError, source: str, toml_text: str = "") -> str:
    # msgspec says e.g. "Object contains unknown field `x` - at `$.bus`" or "Expected `int`, got `str` - at `$.bus.port`"
    text = str(err)
    msg, _, where = text.partition(" - at `")
    where = where.rstrip("`").removeprefix("$").lstrip(".")
    if msg.startswith("Object contains unknown field"):
        field = msg.split("`")[1]
        key = f"{where}.{field}" if where else field
        if (moved := MOVED_KEYS.get(tuple(key.split(".")))) is not None:
            return f"{source}{_line_of(toml_text, key)}: config key {key!r} is now {'.'.join(moved)!r}"
        return f"{source}{_line_of(toml_text, key)}: unknown config key {key!r}"
    return f"{source}{_line_of(toml_text, where)}: config key {where or '(root)'!r}: {msg}"


def _line_of(toml_text: str, key: str) -> str:
    """", line N" where `key` (dotted: section.name) is set in the TOML text, or "" when not found."""
    if not toml_text or not key:
        return ""
    section, _, name = key.rpartition(".")
    current = ""
    for n, line in enumerate(toml_text.splitlines(), 1):
        stripped = line.strip()
        if stripped.startswith("["):
            current = stripped.split("]")[0].lstrip("[").strip()
            if current == key:  # an unknown section
                return f", line {n}"
            continue
        if "=" not in stripped:
            continue
        lhs = stripped.split("=", 1)[0].strip().strip('"')
        if (current, lhs) == (section, name) or (not current and lhs == key):  # key = v, or a dotted a.b = v
            return f", line {n}"
    return ""


def _check_backend(cfg: Config, source: str, toml_text: str, env: dict[str, str]) -> None:
    """`generator.backend` names a registered backend (pyproject.toml's `dfpipe.backends`: shared/plugins.py)."""
    from shared.plugins import backend_kinds

    kinds = backend_kinds()
    if kinds and cfg.generator.backend not in kinds:
        where = next((f"environment variable {n}" for n, key, _ in _env_overrides(env) if tuple(key) == ("generator", "backend")),
                     f"{source}{_line_of(toml_text, 'generator.backend')}")
        raise ConfigError(f"{where}: config key 'generator.backend': {cfg.generator.backend!r} is not a backend; "
                          f"known: {', '.join(kinds)}")


def load_config(path: str | os.PathLike[str] | None = None, env: dict[str, str] | None = None) -> Config:
    """Load and validate; raise ConfigError naming the key on any unknown key or wrong type."""
    env = dict(os.environ if env is None else env)
    path = path or env.get("DFLASH_CONFIG") or None
    tree: dict[str, Any] = {}
    source = "defaults"
    if path:
        p = Path(path)
        toml_text = ""
        try:
            toml_text = p.read_text()
            tree = tomllib.loads(toml_text)
        except FileNotFoundError:
            raise ConfigError(f"config file {p} does not exist") from None
        except tomllib.TOMLDecodeError as e:  # its message names the line and column
            raise ConfigError(f"config file {p} is not valid TOML: {e}") from None
        except UnicodeDecodeError as e:
            raise ConfigError(f"config file {p} is not UTF-8 text (byte {e.start})") from None
        source = str(p)
        try:
            msgspec.convert(tree, Config)
        except msgspec.ValidationError as e:
            raise ConfigError(_describe(e, source, toml_text)) from None
    for name, key_path, value in _env_overrides(env):
        _set(tree, key_path, value)
        try:
            msgspec.convert(tree, Config)
        except msgspec.ValidationError as e:
            raise ConfigError(_describe(e, f"environment variable {name}")) from None
    cfg = msgspec.convert(tree, Config)
    _check_backend(cfg, source, toml_text if path else "", env)
    from shared.topology import check_name

    try:
        check_name("run", cfg.run)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return cfg


def config_to_dict(cfg: Config) -> dict[str, Any]:
    """The config as plain data: what a run's record holds (shared/runconfig.py)."""
    return msgspec.to_builtins(cfg)


def fingerprint(obj: Any, length: int = 12) -> str:
    """A short stable hash of any msgspec-encodable value (config sections, sampling settings)."""
    import hashlib

    return hashlib.sha256(msgspec.json.encode(msgspec.to_builtins(obj), order="sorted")).hexdigest()[:length]


def default_data_dir() -> Path:
    base = os.environ.get("XDG_DATA_HOME", os.path.expanduser("~/.local/share"))
    return Path(base) / "dflash"


def data_dir(cfg: Config) -> Path:
    return Path(cfg.stack.data_dir).expanduser() if cfg.stack.data_dir else default_data_dir()
