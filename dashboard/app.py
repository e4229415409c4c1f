"""The progress page: `streamlit run dashboard/app.py -- [--run R] [--config C]` (or `dfpipe dashboard`).

It answers at a glance how far along a run is, how fast, when done, and whether anything is
wrong. All data comes from one cached `Listener` (a background thread following the bus); the
page body is a fragment that re-reads the listener's snapshot every `REFRESH_S` seconds, so a
stack outage shows as a message and the page recovers by itself when the stack returns.
"""

from __future__ import annotations

import argparse
import hmac
import os
import sys
import time
from datetime import UTC, datetime
from typing import Any

import msgspec
import pandas as pd
import streamlit as st

from dashboard import state as sv
from dashboard.cli import PASSWORD_ENV
from dashboard.listener import Listener, Snapshot
from shared.config import Config, ConfigError, load_config
from shared.ledger import DurableCounts
from shared.stack import connect_config
from shared.view import RunView, rate_text

REFRESH_S = 2.0


def _args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--run", default=None)
    parser.add_argument("--config", default=None)
    args, _ = parser.parse_known_args(sys.argv[1:])
    return args


@st.cache_resource(on_release=lambda listener: listener.close(), show_spinner=False)
def get_listener(cfg_json: str, run: str | None) -> Listener:
    """One listener per server process and (config, run filter); released with the cache."""
    return Listener(msgspec.json.decode(cfg_json, type=Config), run)


def password_ok() -> bool:
    """With DFLASH_DASHBOARD_PASSWORD set, every session must enter it once."""
    expected = os.environ.get(PASSWORD_ENV, "")
    if not expected or st.session_state.get("authenticated"):
        return True
    given = st.text_input("Dashboard password", type="password", key="password")
    if given and hmac.compare_digest(given.encode(), expected.encode()):
        st.session_state["authenticated"] = True
        return True
    if given:
        st.error("Wrong password.")
    return False


def _ts(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _num(n: float) -> str:
    return f"{n:,.0f}" if float(n).is_integer() else f"{n:,.1f}"


# --- panels --------------------------------------------------------------------------------------


def stack_messages(snap: Snapshot, cfg: Config) -> None:
    h = snap.health
    if not h.checked_at:
        st.info(f"Connecting to NATS at {cfg.bus.url} …")
    elif not h.nats_ok:
        st.error(f"NATS is unreachable at {cfg.bus.url}: {h.nats_error}. "
                 "The page keeps retrying and recovers by itself when NATS is back.")
    elif h.stream_missing:
        st.info("No run yet: the PROGRESS stream does not exist (no dflash-pipeline service has started).")
    if h.checked_at and not h.s3_ok and h.s3_error != "connecting…":
        st.warning(f"S3 is unreachable at {cfg.store.endpoint}: {h.s3_error}. "
                   "Run manifests are unavailable until it is back.")
    if h.replaying and h.replay_pending:
        st.info(f"Replaying progress history: {h.replay_pending:,} events to go …")


def run_overview(rs: sv.RunState, view: RunView, now: float) -> None:
    st.header("Run overview")
    gen = view.stage("generate")
    cols = st.columns(4)
    cols[0].metric("elapsed", sv.fmt_duration(sv.elapsed_s(rs, now)))
    cols[1].metric("generation ETA", sv.fmt_duration(gen.eta_s))
    cols[2].metric("completions/s", f"{gen.rate_per_s:.2f}")
    cols[3].metric("last event", f"{max(0.0, now - rs.last_ts):.0f}s ago")
    cols = st.columns(4)
    for col, t in zip(cols, view.stages, strict=True):
        of = f" / {t.total:,}" if t.total is not None else ""
        col.metric(t.label, f"{t.done:,}{of}", help=t.source or None)
        fraction = max(0.0, min(1.0, t.done / t.total)) if t.total else 0.0
        pct = f"{100 * fraction:.1f}%" if t.total else "total unknown"
        col.progress(fraction, text=f"{pct} · {rate_text(t.rate_per_s, t.unit)} · ETA {sv.fmt_duration(t.eta_s)}")
    st.caption(f"rates over the last {view.rate_window_s:.0f}s ([view] rate_window_s)")
    if view.silent:
        ages = {f"{w.stage}/{w.worker}": w.age_s for w in view.workers}
        names = ", ".join(f"{name} ({ages[name]:.0f}s)" for name in view.silent)
        st.error(f"Silent workers (no heartbeat for over {view.silent_after_s:.0f}s): {names}")
    for a in [a for a in view.alerts if a.kind != "quality_gate"][-5:]:
        text = f"{a.stage} {a.kind}{' / ' + a.worker if a.worker else ''}: {a.message} ({_ts(a.ts)})"
        (st.error if a.severity == "critical" else st.warning)(text)


def generators_panel(rs: sv.RunState, view: RunView) -> None:
    st.header("Generators")
    rows = sv.generator_rows(view)
    if not rows:
        st.caption("No generator has reported yet.")
        return
    df = pd.DataFrame(rows)
    df.insert(0, "health", ["SILENT" if s else "ok" for s in df.pop("silent")])
    if df["spec accept"].isna().all():
        df = df.drop(columns=["spec accept"])
    red = "background-color: #f8d0d0"
    formats = {"prompt tok/s": "{:,.1f}", "completion tok/s": "{:,.1f}", "spec accept": "{:.2f}"}
    styled = df.style.apply(lambda r: [red if r["health"] == "SILENT" else "" for _ in r], axis=1).format(
        {k: v for k, v in formats.items() if k in df.columns}, na_rep="—")
    st.dataframe(styled, hide_index=True, width="stretch")
    engines = sv.engine_rows(view)
    if engines:
        st.caption("engines (fill = running ÷ the engine's batch limit)")
        st.dataframe(pd.DataFrame(engines), hide_index=True, width="stretch")
    series = pd.DataFrame(sv.generator_series(rs))
    if len(series) > 1:
        series["time"] = pd.to_datetime(series["time"], unit="s")
        c1, c2 = st.columns(2)
        c1.caption("completion tokens/s per worker")
        c1.line_chart(series, x="time", y="completion tok/s", color="worker", height=220)
        c2.caption("prompt tokens/s per worker")
        c2.line_chart(series, x="time", y="prompt tok/s", color="worker", height=220)
    reasons, truncated_pct = sv.finish_reasons(rs)
    c1, c2 = st.columns([1, 3])
    c1.metric("truncated (finish_reason=length)", f"{truncated_pct:.1f}%")
    if reasons:
        c2.dataframe(pd.DataFrame({"finish reason": list(reasons), "completions": list(reasons.values())}),
                     hide_index=True)


def quality_panel(rs: sv.RunState, durable: DurableCounts | None) -> None:
    st.header("Data quality")
    q = sv.quality_view(rs, durable)
    for alert in q.gate_alerts[-3:]:
        st.error(f"Quality gate tripped: {alert.message}")
        if alert.examples:
            with st.expander(f"{len(alert.examples)} example samples", expanded=True):
                for ex in alert.examples[:10]:
                    st.code(ex, language=None)
    if q.gate_tripped and not q.gate_alerts:
        st.error("Quality gate tripped (reported by the tokenizer; no alert text yet).")
    if not sv.workers_of(rs, "tokenize") and not (durable and durable.tokenized_shards):
        st.caption("No tokenizer has reported yet.")
        return
    cols = st.columns(4)
    cols[0].metric("samples in", f"{q.samples_in:,}")
    cols[1].metric("samples kept", f"{q.samples_kept:,}")
    cols[2].metric("supervised tokens", f"{q.supervised_tokens:,}")
    cols[3].metric("retokenization drift", f"{q.drift:,}")
    c1, c2 = st.columns(2)
    if q.histogram:
        c1.caption("supervised tokens per sample")
        hist = pd.DataFrame({"supervised tokens ≥": [str(b) for b, _ in q.histogram],
                             "samples": [n for _, n in q.histogram]})
        c1.bar_chart(hist, x="supervised tokens ≥", y="samples", height=220, sort=False)
    if q.dropped:
        c2.caption("dropped samples by reason")
        c2.dataframe(pd.DataFrame({"reason": list(q.dropped), "dropped": list(q.dropped.values())}),
                     hide_index=True)


def trainer_panel(rs: sv.RunState, view: RunView) -> None:
    st.header("Trainer")
    t = view.training
    series = pd.DataFrame(sv.trainer_series(rs))
    if t is None and not rs.evals:
        st.caption("No trainer has reported yet.")
        return
    if t is not None and t.loss is None:
        st.caption(f"Trainer {t.worker}: {t.state}.")
    elif t is not None:
        cols = st.columns(6)
        cols[0].metric("step", f"{t.step:,}", help=f"of {t.total_steps:,} planned" if t.total_steps else None)
        cols[1].metric("loss", f"{t.loss:.4f}")
        cols[2].metric("estimated τ", f"{t.estimated_tau:.2f}")
        cols[3].metric("steps/s", f"{t.steps_per_s:.2f}")
        cols[4].metric("training ETA", sv.fmt_duration(t.eta_s))
        cols[5].metric("tokens/s", _num(round(t.tokens_per_s, 1)))
    if not series.empty:
        c1, c2 = st.columns(2)
        c1.caption("loss by step")
        c1.line_chart(series, x="step", y="loss", color="worker", height=220)
        c2.caption("estimated τ by step")
        c2.line_chart(series, x="step", y="estimated τ", color="worker", height=220)
    ckpts = sv.checkpoint_rows(rs)
    if ckpts:
        st.caption("checkpoints")
        st.dataframe(pd.DataFrame(ckpts), hide_index=True, width="stretch")
    evals = sv.eval_rows(rs)
    if evals:
        st.caption("eval results")
        st.dataframe(pd.DataFrame(evals), hide_index=True, width="stretch")


def failures_panel(snap: Snapshot, run: str, listener: Listener) -> None:
    st.header("Failures")
    letters = [(seq, dl) for seq, dl in snap.dead_letters if dl.run == run]
    if not letters:
        st.caption("No dead letters.")
        return
    st.error(f"{len(letters)} dead letters")
    st.dataframe(pd.DataFrame([{
        "seq": seq, "stage": dl.stage, "subject": dl.subject, "deliveries": dl.num_delivered,
        "reason": (dl.error.strip().splitlines() or [""])[-1][:200], "time": _ts(dl.ts),
    } for seq, dl in letters[-200:]]), hide_index=True, width="stretch")
    if st.session_state.get("confirm_replay") != run:
        st.button(f"Replay {len(letters)} dead letters", key="replay",
                  on_click=lambda: st.session_state.update(confirm_replay=run))
        return
    st.warning(f"Put {len(letters)} dead letters of run {run} back on their subjects (as `dfpipe replay` does)?")
    c1, c2 = st.columns(2)
    c1.button("Confirm replay", key="replay_confirm", type="primary", on_click=_replay, args=(listener, run))
    c2.button("Cancel", key="replay_cancel", on_click=lambda: st.session_state.pop("confirm_replay", None))


def _replay(listener: Listener, run: str) -> None:
    """Button callback: runs before the rerun, so the page shows the outcome at once."""
    st.session_state.pop("confirm_replay", None)
    try:
        n = listener.replay_dead_letters(run)
    except Exception as e:  # shown, not raised: the page must stay up
        st.session_state["replay_result"] = f"Replay failed: {e}"
    else:
        st.session_state["replay_result"] = f"Replayed {n} dead letters."


def stack_health_panel(snap: Snapshot, cfg: Config, manifest: dict[str, Any] | None) -> None:
    st.header("Stack health")
    h = snap.health
    c1, c2 = st.columns(2)
    c1.metric("NATS", "reachable" if h.nats_ok else "unreachable")
    down = f" (for {time.time() - h.nats_down_since:.0f}s)" if h.nats_down_since else ""
    c1.caption(cfg.bus.url + (f" — {h.nats_error}{down}" if h.nats_error else ""))
    c2.metric("S3", "reachable" if h.s3_ok else "unreachable")
    c2.caption(f"{cfg.store.endpoint} / {cfg.store.bucket}" + (f" — {h.s3_error}" if not h.s3_ok else ""))
    if snap.lag:
        st.caption("stream lag per consumer")
        st.dataframe(pd.DataFrame([{"stream": c.stream, "consumer": c.consumer, "pending": c.pending,
                                    "ack pending": c.ack_pending, "redelivered": c.redelivered}
                                   for c in snap.lag]), hide_index=True, width="stretch")
    if manifest:
        with st.expander("run manifest (S3)"):
            st.json(manifest)


# --- page ----------------------------------------------------------------------------------------


def pick_run(snap: Snapshot, default: str | None) -> str | None:
    runs = sorted(snap.runs, key=lambda r: -snap.runs[r].last_ts)
    if default and default not in runs:
        runs.insert(0, default)
    if not runs:
        return None
    preferred = st.query_params.get("run") or default
    index = runs.index(preferred) if preferred in runs else 0
    return st.selectbox("Run", runs, index=index, key="run")


def main() -> None:
    st.set_page_config(page_title="dflash pipeline", page_icon="⚡", layout="wide")
    st.title("dflash pipeline")
    if not password_ok():
        st.stop()
    args = _args()
    try:
        cfg = connect_config(load_config(args.config))
    except ConfigError as e:
        st.error(f"Configuration error: {e}")
        st.stop()
    listener = get_listener(msgspec.json.encode(cfg).decode(), args.run)

    @st.fragment(run_every=REFRESH_S)
    def body() -> None:
        snap = listener.snapshot()
        stack_messages(snap, cfg)
        run = pick_run(snap, args.run)
        if run is None or run not in snap.runs:
            if snap.health.nats_ok and not snap.health.replaying:
                st.info("No run yet: no progress events on the bus" + (f" for run {run}." if run else "."))
            stack_health_panel(snap, cfg, None)
            return
        rs, now = snap.runs[run], time.time()
        manifest = snap.manifests.get(run)
        if "replay_result" in st.session_state:
            st.success(st.session_state.pop("replay_result"))
        view = sv.run_view(rs, snap.facts.get(run), now, cfg.view)
        run_overview(rs, view, now)
        generators_panel(rs, view)
        quality_panel(rs, snap.durable.get(run))
        trainer_panel(rs, view)
        failures_panel(snap, run, listener)
        stack_health_panel(snap, cfg, manifest)

    body()


main()
