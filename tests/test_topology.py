"""The topology table is consistent: every subject lands in exactly one stream, every key under its run.

Pure: no server. Subjects and Keys methods are enumerated by inspection, so a new one is checked
without editing this file (a parameter name this file does not know fails the test, by name).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator

import pytest

from shared.config import BusConfig
from shared.topology import ANY, STAGES, Keys, Subjects, check_name, stage_input, streams

SAMPLE = {"run": "r1", "worker": "w0", "prompt_id": "0123abcd", "seq": 3, "fingerprint": "fp9",
          "shard_name": "w0.00000003", "step": 7}
ALL_STAGES = (*STAGES, "run")  # the pipeline's own alerts use stage "run"
SPANS_STREAMS = {"whole_run"}  # a filter over every stream of a run, on purpose


def covers(pattern: str, subject: str) -> bool:
    """NATS matching, extended to filters: every subject `subject` matches is matched by `pattern`."""
    p, s = pattern.split("."), subject.split(".")
    for i, tok in enumerate(p):
        if tok == ">":
            return len(s) > i
        if i >= len(s) or s[i] == ">" or (tok != "*" and tok != s[i]):
            return False
    return len(p) == len(s)


def intersects(a: str, b: str) -> bool:
    """Whether some subject matches both patterns."""
    x, y = a.split("."), b.split(".")
    for i in range(max(len(x), len(y))):
        if (i < len(x) and x[i] == ">") or (i < len(y) and y[i] == ">"):
            return True
        if i >= len(x) or i >= len(y):
            return False
        if x[i] != y[i] and "*" not in (x[i], y[i]):
            return False
    return True


def _methods(cls: type) -> list[str]:
    return [n for n, v in vars(cls).items() if isinstance(v, staticmethod)]


def _calls(cls: type, name: str) -> Iterator[str]:
    """Every value of `cls.name` over the sample arguments (each stage, and ANY for filters' parameters)."""
    fn = getattr(cls, name)
    params = inspect.signature(fn).parameters
    unknown = [p for p in params if p not in SAMPLE and p != "stage"]
    assert not unknown, f"{cls.__name__}.{name}: give tests/test_topology.py a sample for {unknown}"
    for stage in (ALL_STAGES if "stage" in params else (None,)):
        args = {p: (stage if p == "stage" else SAMPLE[p]) for p in params}
        yield fn(**args)


def _subjects() -> list[tuple[str, str]]:
    return [(name, s) for name in _methods(Subjects) if name not in SPANS_STREAMS for s in _calls(Subjects, name)]


STREAMS = streams(BusConfig().progress_max_age_s)


def test_every_subject_is_captured_by_exactly_one_stream() -> None:
    for name, subject in _subjects():
        owners = [st.name for st in STREAMS if any(covers(p, subject) for p in st.subjects)]
        assert len(owners) == 1, f"Subjects.{name} -> {subject!r} is captured by {owners or 'no stream'}"


def test_stream_subjects_do_not_overlap_and_each_is_produced() -> None:
    patterns = [(st.name, p) for st in STREAMS for p in st.subjects]
    for i, (sa, a) in enumerate(patterns):
        for sb, b in patterns[i + 1:]:
            assert not intersects(a, b), f"{sa} {a!r} and {sb} {b!r} overlap"
    produced = [s for _, s in _subjects() if "*" not in s and ">" not in s]
    for st, p in patterns:
        assert any(covers(p, s) for s in produced), f"{st} captures {p!r}, which no Subjects method produces"


def test_whole_run_filter_covers_every_subject_of_the_run_and_no_other_run() -> None:
    for name, subject in _subjects():
        if subject.split(".")[1] == SAMPLE["run"]:
            assert covers(Subjects.whole_run(SAMPLE["run"]), subject), name
    assert not covers(Subjects.whole_run("r1"), Subjects.prompts("r10"))
    assert covers(Subjects.whole_run(ANY), Subjects.prompts("r10"))


def test_each_stage_consumes_from_the_stream_that_captures_its_subject() -> None:
    for stage in ("generate", "tokenize", "train"):
        stream, subject = stage_input(stage, "r1")
        spec = next(st for st in STREAMS if st.name == stream)
        assert any(covers(p, subject) for p in spec.subjects), (stage, stream, subject)


def test_every_key_is_under_its_run() -> None:
    for name in _methods(Keys):
        if name == "completions_seq":
            continue  # parses a key, returns a number
        for key in _calls(Keys, name):
            assert key.startswith("runs/r1/"), f"Keys.{name} -> {key!r}"
            assert "//" not in key and ".." not in key, f"Keys.{name} -> {key!r}"


def test_completions_seq_reads_back_what_completions_writes() -> None:
    prefix = Keys.completions_prefix("r1", "w0")
    assert Keys.completions_seq(prefix, Keys.completions("r1", "w0", 42)) == 42
    assert Keys.completions_seq(prefix, prefix + "notes.txt") is None
    assert Keys.completions_seq(prefix, Keys.completions("r1", "w1", 42)) is None


@pytest.mark.parametrize("bad", ["a.b", "a/b", "*", ">", "", "-x", "x" * 65, "r 1"])
def test_a_name_that_would_change_a_subject_or_key_is_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="invalid run name"):
        check_name("run", bad)
    with pytest.raises(ValueError):
        Keys.manifest(bad)
    if bad != ANY:
        with pytest.raises(ValueError):
            Subjects.prompts(bad)
