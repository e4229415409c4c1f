"""Tokenizing throughput: this service's SampleBuilder vs `datasets.Dataset.map(batched=True, num_proc=2)`
doing the usual prefix-render masking with the same tokenizer and chat template, on the same
completions in one run. Outputs are compared sample by sample. Target: ratio ≥ 1.0.
Writes bench/results/tokenize_speed.json.
"""

from __future__ import annotations

import os
import sys
import time

from common import table, write_result

N = int(os.environ.get("BENCH_TOKENIZE_N", "20000"))
TEXT = ("the model answers each question with care and checks every step of its reasoning before it "
        "writes a final short summary for the reader")
WORDS = TEXT.split(" ")


def completions(n: int) -> list[dict]:
    out = []
    for i in range(n):
        k = 20 + (i * 7) % 60
        answer = " ".join(WORDS[(i + j) % len(WORDS)] for j in range(k)).capitalize() + "."
        out.append({"prompt_id": f"p{i:06d}", "question": f"Question {i}: explain topic {i % 97} briefly.",
                    "answer": answer})
    return out


def baseline_map(batch: dict, tokenizer=None) -> dict:
    """The common recipe: render prompt and prompt+answer with the template, mask = tokens past the prefix."""
    ids, masks = [], []
    for q, a in zip(batch["question"], batch["answer"], strict=True):
        msgs = [{"role": "user", "content": q}]
        prefix = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        full = tokenizer.apply_chat_template([*msgs, {"role": "assistant", "content": a}], tokenize=False)
        turn = full[: full.rindex("<|im_end|>") + len("<|im_end|>")]  # supervised up to end-of-turn
        p = tokenizer(prefix, add_special_tokens=False).input_ids
        t = tokenizer(turn, add_special_tokens=False).input_ids
        f = tokenizer(full, add_special_tokens=False).input_ids
        ids.append(f)
        masks.append([0] * len(p) + [1] * (len(t) - len(p)) + [0] * (len(f) - len(t)))
    return {"input_ids": ids, "loss_mask": masks}


def main() -> int:
    import datasets

    from services.tokenizer.samples import SampleBuilder
    from shared.config import load_config
    from shared.model import load_tokenizer
    from shared.records import ChatMessage, CompletionRecord

    cfg = load_config(env={"DFLASH_TOKENIZER__MIN_SUPERVISED_TOKENS": "1"})
    tok = load_tokenizer(cfg.model.target)
    data = completions(N)
    recs = [CompletionRecord(run="bench", prompt_id=d["prompt_id"], completion=d["answer"],
                             messages=[ChatMessage(role="user", content=d["question"])]) for d in data]
    builder = SampleBuilder(tok, cfg)
    ds = datasets.Dataset.from_list(data)
    datasets.disable_progress_bars()

    t0 = time.perf_counter()
    ours = []
    for i in range(0, N, 256):  # shard-sized calls, as the service makes them
        ours += builder.build(recs[i:i + 256]).samples
    t_ours = time.perf_counter() - t0
    t0 = time.perf_counter()
    mapped = ds.map(baseline_map, batched=True, num_proc=2, fn_kwargs={"tokenizer": tok},
                    remove_columns=ds.column_names, load_from_cache_file=False)
    base_ids, base_masks = mapped["input_ids"], mapped["loss_mask"]
    t_base = time.perf_counter() - t0

    tokens = sum(s.num_tokens for s in ours)
    same = len(ours) == N and all(s.input_ids == base_ids[i] and s.loss_mask == base_masks[i]
                                  for i, s in enumerate(ours))
    ratio = t_base / t_ours
    result = {"completions": N, "tokens": tokens, "ours_s": round(t_ours, 2), "baseline_s": round(t_base, 2),
              "ours_tokens_per_s": round(tokens / t_ours), "baseline_tokens_per_s": round(tokens / t_base),
              "ratio": round(ratio, 3), "identical_outputs": same, "target_ratio": 1.0, "met": ratio >= 1.0 and same}
    path = write_result("tokenize_speed", result)
    print(table([("", "seconds", "tokens/s"), ("SampleBuilder", f"{t_ours:.1f}", f"{tokens / t_ours:.0f}"),
                 ("datasets.map num_proc=2", f"{t_base:.1f}", f"{tokens / t_base:.0f}")]))
    print(f"ratio {ratio:.2f} (target 1.0), identical outputs: {same}; wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
