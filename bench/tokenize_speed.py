"""Tokenizing throughput: the tokenizer service's step (`SampleBuilder.build`, shard by shard) vs a baseline of
`datasets.Dataset.map(batched=True, num_proc=2)` rendering the same completions with the same tokenizer
(SmolLM2's) and the same chat template.

The baseline is the usual recipe done well: per batch, render the generation prompt and the full
conversation with `apply_chat_template`, tokenize both lists in one batched call each, and set the
mask from the end of the prompt's tokens through the last end-of-turn token. The service does
more per sample: the template layout checks, the per-sample checks (minimum supervised tokens,
repetition), and on token-exact records the drift check (it re-tokenizes the answer to compare
with the engine's ids).

Data: 20,000 synthetic but realistic completions (single-turn, with a system prompt, multi-turn;
answers of about 40-450 tokens from varied sentences, numbers, code and non-ASCII text), measured
in one run, alternating service and baseline twice so machine noise hits both; the best of the
two is reported. The service runs on the same records twice: as generators write them (with the
engine's `output_ids`: token-exact path) and text only. Outputs are compared sample by sample.
Target: service tokens/s / baseline tokens/s >= 1.0 with identical outputs.
Writes bench/results/tokenize.json.
"""

from __future__ import annotations

import os
import sys

# Run as `python bench/tokenize.py`, this file's folder comes first on sys.path and the file would shadow the
# standard library's `tokenize` (imported by inspect/linecache): look in this folder last.
_HERE = os.path.dirname(os.path.realpath(__file__))
sys.path[:] = [p for p in sys.path if os.path.realpath(p or ".") != _HERE] + [_HERE]

import gc  # noqa: E402
import random  # noqa: E402
import time  # noqa: E402
from array import array  # noqa: E402
from typing import Any  # noqa: E402

from common import table, write_result  # noqa: E402

N = int(os.environ.get("BENCH_TOKENIZE_N", "20000"))
SHARD = 256  # generator.shard_records default: the service builds one shard per call
ROUNDS = 2

SYSTEMS = ["You are a helpful assistant.", "You are a concise expert. Answer in plain language.",
           "Tu es un assistant utile qui répond en français quand on lui parle français."]
SUBJECTS = ["photosynthesis", "binary search", "the French Revolution", "sourdough bread", "TCP handshakes",
            "black holes", "compound interest", "the Krebs cycle", "Rust lifetimes", "plate tectonics",
            "jazz harmony", "vaccines", "the Fourier transform", "Git rebasing", "coral reefs"]
SENTENCES = [
    "{s} is easier to understand once you see the problem it solves.",
    "In short, {s} works in three steps, and each step depends on the one before it.",
    "A common mistake is to think that {s} happens all at once; in practice it is gradual.",
    "For example, with n = {n} items the cost grows roughly like n log n, about {m} operations.",
    "Historians and scientists still debate some details of {s}, but the main idea is settled.",
    "Here is a small sketch:\n\n```python\ndef step(x):\n    return (x * {n}) % 97\n```\n",
    "Note: values such as {n}.5% or ${m} are only illustrative, not measured.",
    "En résumé, {s} reste un sujet passionnant — même après {n} ans d'études.",
    "The key terms are: input, state, and output (see the table below).\n\n| term | meaning |\n|---|---|\n"
    "| input | what goes in |\n| output | what comes out |",
    "Finally, remember that {s} is a model: useful, but simplified.",
]


def completions(n: int) -> list[dict[str, Any]]:
    rng = random.Random(0)
    out = []
    for i in range(n):
        subject = SUBJECTS[i % len(SUBJECTS)]
        messages: list[dict[str, str]] = []
        shape = i % 3
        if shape == 1:
            messages.append({"role": "system", "content": SYSTEMS[i % len(SYSTEMS)]})
        messages.append({"role": "user", "content": f"Can you explain {subject}? (request {i})"})
        if shape == 2:
            messages.append({"role": "assistant", "content": f"Sure. {subject.capitalize()} is a big topic."})
            messages.append({"role": "user", "content": "Go on, with an example please."})
        picks = rng.sample(SENTENCES, rng.choice([3, 4, 5, 6, 8, 10]))  # no sentence twice in a row (a loop)
        if i % 4 == 0:  # a longer answer: a second paragraph
            picks += ["\n\nMore detail:", *rng.sample(SENTENCES, rng.randint(4, 10))]
        answer = " ".join(x.format(s=subject, n=rng.randint(2, 5000), m=rng.randint(10, 10**6)) for x in picks)
        out.append({"prompt_id": f"p{i:06d}", "messages": messages, "completion": answer[0].upper() + answer[1:]})
    return out


def baseline_map(batch: dict[str, list], tokenizer: Any = None) -> dict[str, list]:
    """Render prompt and prompt+answer with the template; mask = past the prompt's tokens, through end of turn."""
    prompts, fulls = [], []
    for msgs, answer in zip(batch["messages"], batch["completion"], strict=True):
        prompts.append(tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True))
        fulls.append(tokenizer.apply_chat_template([*msgs, {"role": "assistant", "content": answer}], tokenize=False))
    p_ids = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    f_ids = tokenizer(fulls, add_special_tokens=False)["input_ids"]
    eos = tokenizer.eos_token_id
    masks = []
    for p, f in zip(p_ids, f_ids, strict=True):
        end = len(f) - f[::-1].index(eos)  # through the last end-of-turn token
        masks.append([0] * len(p) + [1] * (end - len(p)) + [0] * (len(f) - end))
    return {"prompt_id": batch["prompt_id"], "input_ids": f_ids, "loss_mask": masks}


def main() -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    import datasets

    from services.tokenizer.fingerprint import template_fingerprint
    from services.tokenizer.pool import BuildPool, default_processes
    from services.tokenizer.samples import SampleBuilder
    from shared.config import load_config
    from shared.messages import ChatMessage
    from shared.model import load_tokenizer
    from shared.records import CompletionRecord

    cfg = load_config(env={})  # the default policy: min_supervised_tokens 32, max_length 4096
    tok = load_tokenizer(cfg.model.target)
    data = completions(N)
    text_only = [CompletionRecord(run="bench", prompt_id=d["prompt_id"], completion=d["completion"],
                                  messages=[ChatMessage(**m) for m in d["messages"]]) for d in data]
    answer_ids = tok([d["completion"] for d in data], add_special_tokens=False)["input_ids"]
    exact = [CompletionRecord(run="bench", prompt_id=r.prompt_id, completion=r.completion, messages=r.messages,
                              output_ids=[*ids, tok.eos_token_id]) for r, ids in zip(text_only, answer_ids, strict=True)]
    ds = datasets.Dataset.from_list(data)
    datasets.disable_progress_bars()

    processes = cfg.tokenizer.processes or default_processes()  # as the service runs: one builder per CPU
    pool = BuildPool(tok, cfg, processes, template_fingerprint(tok, cfg)) if processes > 1 else None
    builder = SampleBuilder(tok, cfg)
    if pool is not None:
        builder.build(text_only[:256], pool=pool)  # the service starts its workers once, on its first shard

    def service(records: list[CompletionRecord]) -> tuple[float, dict, dict[str, int], int]:
        """Only `build` is timed. Outputs are kept compactly outside the timed part: the service writes each
        shard and lets it go, and 20,000 samples as Python lists would slow the collector for everyone."""
        seen: dict[str, int] = {}
        samples, dropped, drift, seconds = {}, {}, 0, 0.0
        gc.collect()
        for i in range(0, len(records), SHARD):
            t0 = time.perf_counter()
            built = builder.build(records[i:i + SHARD], seen=seen, pool=pool)
            seconds += time.perf_counter() - t0
            seen.update((s.prompt_id, s.generation) for s in built.samples)
            for s in built.samples:
                samples[s.prompt_id] = (array("i", s.input_ids), bytes(s.loss_mask))
            drift += built.drift
            for k, v in built.dropped().items():
                dropped[k] = dropped.get(k, 0) + v
        return seconds, samples, dropped, drift

    def baseline() -> tuple[float, datasets.Dataset]:
        gc.collect()
        parallelism = os.environ["TOKENIZERS_PARALLELISM"]  # "false" once the service's pool runs
        t0 = time.perf_counter()
        mapped = ds.map(baseline_map, batched=True, num_proc=2, fn_kwargs={"tokenizer": tok},
                        remove_columns=ds.column_names, load_from_cache_file=False, keep_in_memory=True)
        seconds = time.perf_counter() - t0
        # map(num_proc>1) leaves TOKENIZERS_PARALLELISM=false in this process's real environment (it restores
        # only the Python mapping): set it back, or a later in-process service round tokenizes on one thread.
        os.environ["TOKENIZERS_PARALLELISM"] = parallelism
        return seconds, mapped

    times: dict[str, list[float]] = {"service_exact": [], "service_text": [], "baseline": []}
    results: dict[str, Any] = {}
    for _ in range(ROUNDS):
        s, results["service_exact"], dropped_exact, drift = service(exact)
        times["service_exact"].append(s)
        s, results["service_text"], dropped_text, _ = service(text_only)
        times["service_text"].append(s)
        s, results["baseline"] = baseline()
        times["baseline"].append(s)

    base = results["baseline"]
    base_ids, base_masks, base_pids = base["input_ids"], base["loss_mask"], base["prompt_id"]
    tokens = sum(len(x) for x in base_ids)

    def compare(by_pid: dict) -> dict[str, Any]:
        missing = [p for p in base_pids if p not in by_pid]
        differ = [p for p, ids, m in zip(base_pids, base_ids, base_masks, strict=True)
                  if p in by_pid and (by_pid[p][0] != array("i", ids) or by_pid[p][1] != bytes(m))]
        samples = by_pid
        return {"samples": len(samples), "missing_vs_baseline": len(missing), "differing_samples": len(differ),
                "identical": not missing and not differ and len(samples) == len(base_pids),
                "examples": (missing + differ)[:5]}

    cmp_exact, cmp_text = compare(results["service_exact"]), compare(results["service_text"])
    best = {k: min(v) for k, v in times.items()}
    rate = {k: tokens / v for k, v in best.items()}
    ratio_exact = rate["service_exact"] / rate["baseline"]
    ratio_text = rate["service_text"] / rate["baseline"]
    ok = ratio_exact >= 1.0 and ratio_text >= 1.0 and cmp_exact["identical"] and cmp_text["identical"]
    rows = [("step", "best s", "all runs s", "tokens/s", "vs baseline", "identical outputs"),
            ("service, token-exact records", f"{best['service_exact']:.2f}",
             " ".join(f"{t:.2f}" for t in times["service_exact"]), f"{rate['service_exact']:,.0f}",
             f"{ratio_exact:.2f}x", str(cmp_exact["identical"])),
            ("service, text-only records", f"{best['service_text']:.2f}",
             " ".join(f"{t:.2f}" for t in times["service_text"]), f"{rate['service_text']:,.0f}",
             f"{ratio_text:.2f}x", str(cmp_text["identical"])),
            ("datasets.map(batched, num_proc=2)", f"{best['baseline']:.2f}",
             " ".join(f"{t:.2f}" for t in times["baseline"]), f"{rate['baseline']:,.0f}", "1.00x", "-")]
    print(f"{N} completions, {tokens:,} tokens, shards of {SHARD}, service on {processes} processes; load average {os.getloadavg()[0]:.2f}")
    print(table(rows))
    print(f"target >= 1.0x with identical outputs: {'met' if ok else 'NOT MET'}"
          f" (drops: exact {dropped_exact or 'none'}, text {dropped_text or 'none'}; drift {drift})")
    path = write_result("tokenize", {
        "completions": N, "tokens": tokens, "shard_records": SHARD, "rounds": ROUNDS, "service_processes": processes,
        "load_average_1m_at_end": round(os.getloadavg()[0], 2),
        "seconds": {k: [round(t, 3) for t in v] for k, v in times.items()},
        "tokens_per_s": {k: round(v) for k, v in rate.items()},
        "ratio_token_exact": round(ratio_exact, 3), "ratio_text_only": round(ratio_text, 3),
        "outputs_token_exact": cmp_exact, "outputs_text_only": cmp_text,
        "dropped_token_exact": dropped_exact, "dropped_text_only": dropped_text, "retokenization_drift": drift,
        "target_ratio": 1.0, "met": ok,
    })
    print(f"-> {path}")
    if pool is not None:
        pool.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
