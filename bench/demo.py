"""The first command, end to end, as a newcomer runs it: `dfpipe run --run demo` in a fresh data folder (its own
embedded stack, the bundled prompts and demo.toml), timed per stage from its own output, with the eval's τ.

    python bench/demo.py [--avx2] [--tag NAME]

`--avx2` restricts torch's kernels to AVX2 (ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2
MKL_ENABLE_INSTRUCTIONS=AVX2): a CPU with AVX-512/AMX measured as the ordinary CPU most users have (fp32: the
timed bf16 probe finds bf16 slower there). Run it alone on the machine: its minutes are the machine's. Reports
the expected duration `dfpipe run` printed at its start against the real one. Writes bench/results/demo[-TAG].json.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time

from common import AVX2_ONLY, ROOT, cpu_description, table, write_result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--avx2", action="store_true", help="restrict torch's kernels to AVX2")
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    if args.avx2:  # here too, so that cpu_description() reports the restriction the run had
        os.environ.update(AVX2_ONLY)
    env = dict(os.environ)
    env.pop("DFLASH_CONFIG", None)
    marks: dict[str, float] = {}
    lines: list[tuple[float, str]] = []
    with tempfile.TemporaryDirectory(prefix="dfpipe-demo-") as data:
        env["DFLASH_DATA_DIR"] = data
        t0 = time.monotonic()
        proc = subprocess.Popen([sys.executable, "-m", "shared.cli", "run", "--run", "demo", "--plain"], cwd=ROOT,
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert proc.stdout is not None
        for line in proc.stdout:
            t = time.monotonic() - t0
            lines.append((t, line.rstrip()))
            print(f"{t:7.1f}s {line.rstrip()}", flush=True)
            if "generated 350/350" in line:
                marks.setdefault("generation", t)
            if re.search(r"tokenized (\d+)/\1 ", line) and "generation" in marks:
                marks.setdefault("tokenization", t)
            if "trainer finished" in line:
                marks.setdefault("training", t)
            if line.startswith("eval demo: τ"):
                marks.setdefault("eval", t)
        rc = proc.wait()
        total = time.monotonic() - t0
        stop = subprocess.run([sys.executable, "-m", "shared.cli", "stack", "down"], env=env, cwd=ROOT,
                              capture_output=True, text=True)
    text = "\n".join(line for _, line in lines)
    expected = re.search(r"expected on this machine:.*about (\d+) minutes", text)
    tau = re.search(r"eval demo: τ = ([\d.]+) over \d+ cycles on (\d+) held-out prompts; speedup ([\d.]+)x vs greedy; "
                    r"lossless: (\w+)", text)
    trained = re.search(r"training: (\d+) steps, ended by (.*)", text)
    order = ["generation", "tokenization", "training", "eval"]
    stages, before = {}, 0.0
    for name in order:
        if name in marks:
            stages[name] = round(marks[name] - before, 1)
            before = marks[name]
    result = {
        "status": "complete" if rc == 0 and tau else f"FAILED (exit {rc})",
        "cpu": cpu_description(),
        "load_avg_1_5_15_after": [round(x, 2) for x in os.getloadavg()],
        "exit": rc, "total_s": round(total, 1), "expected_minutes_printed": int(expected.group(1)) if expected else None,
        "stage_ends_s": {k: round(v, 1) for k, v in marks.items()}, "stage_s": stages,
        "tau": float(tau.group(1)) if tau else None, "eval_prompts": int(tau.group(2)) if tau else None,
        "speedup": float(tau.group(3)) if tau else None, "lossless": tau.group(4) == "True" if tau else None,
        "train_steps": int(trained.group(1)) if trained else None, "training_ended_by": trained.group(2) if trained else None,
        "stack_down_exit": stop.returncode,
    }
    rows = [("stage", "ended at (s)", "took (s)")] + [(k, f"{marks[k]:.0f}", f"{stages[k]:.0f}") for k in order if k in marks]
    rows.append(("total", f"{total:.0f}", f"{total / 60:.1f} min (printed at start: {result['expected_minutes_printed']})"))
    print(table(rows))
    print(f"τ {result['tau']} on {result['eval_prompts']} held-out prompts, lossless {result['lossless']}, "
          f"speedup {result['speedup']}x, {result['train_steps']} steps ended by {result['training_ended_by']}")
    path = write_result("demo" + (f"-{args.tag}" if args.tag else ""), result)
    print(f"wrote {path}")
    return 0 if rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
