"""Training speed: tokens/s of a full training step (target forward + drafter forward/backward +
optimizer) vs tokens/s of the target forward alone, on the same sequences, alternated in one run.

Real SmolLM2-135M-Instruct target, real tokenized samples (SmolLM2 chat template), CPU. Both sides
run the target as the trainer does (one batched forward per micro-batch, fp32, stopped after the
deepest feature layer); the training side adds the drafter with the trainer's autocast setting
("auto": bf16 where the CPU has bf16 matmul units). Drafter shapes: the production default
(B=16, 5 layers, 512 anchors), the CPU demo (B=8, 1 layer, 64 anchors) and bench/quality.toml's
(B=8, 2 layers, 64 anchors), each with the whole vocabulary and with an 8192-id draft vocabulary
(`trainer.draft_vocab`; which ids does not change the cost). Target: ratio ≥ 0.5.
Writes bench/results/train_speed.json.
"""

from __future__ import annotations

import os
import sys
import time

import torch
from common import ROOT, table, write_result

ROUNDS = int(os.environ.get("BENCH_TRAIN_ROUNDS", "3"))
SEQUENCES = int(os.environ.get("BENCH_TRAIN_SEQUENCES", "8"))
SHAPES = {"default (B=16, 5 layers, 512 anchors)": (16, 5, 512, 0),
          "default, draft vocab 8192": (16, 5, 512, 8192),
          "demo (B=8, 1 layer, 64 anchors)": (8, 1, 64, 0),
          "demo, draft vocab 8192": (8, 1, 64, 8192),
          "quality.toml (B=8, 2 layers, 64 anchors, draft vocab 8192)": (8, 2, 64, 8192)}
ANSWER = ("Here is a careful answer. First, consider what the question asks and which facts matter. "
          "Then work through the steps one at a time, checking each against what is known. ") * 4


def samples(tok, cfg) -> list:
    import json

    from services.tokenizer.samples import SampleBuilder
    from shared.records import ChatMessage, CompletionRecord

    lines = (ROOT / "services/pipeline/data/prompts.jsonl").read_text().splitlines()[:SEQUENCES]
    prompts = [r["messages"][-1]["content"] if "messages" in r else r["prompt"] for r in map(json.loads, lines)]
    recs = [CompletionRecord(run="bench", prompt_id=f"p{i}", messages=[ChatMessage(role="user", content=p)],
                             completion=ANSWER) for i, p in enumerate(prompts)]
    return SampleBuilder(tok, cfg).build(recs).samples


def main() -> int:
    import msgspec

    from services.trainer.build import autocast_dtype, draft_vocab_ids
    from services.trainer.features import Target
    from services.trainer.model import DFlashDrafter, feature_layer_ids, resolve_mask_token_id
    from services.trainer.step import sequence_blocks, sequence_loss
    from shared.config import load_config
    from shared.model import load_causal_lm, load_tokenizer

    torch.manual_seed(0)
    cfg = load_config(env={})
    tok, lm = load_tokenizer(cfg.model.target), load_causal_lm(cfg.model.target, device="cpu")
    ids = feature_layer_ids(lm.config.num_hidden_layers, 5)
    target = Target(lm, ids)
    seqs = samples(tok, msgspec.structs.replace(cfg, trainer=msgspec.structs.replace(cfg.trainer, block_size=8)))
    tokens = sum(s.num_tokens for s in seqs)
    amp = autocast_dtype(cfg.trainer.autocast, torch.device("cpu"))
    rows, results = [("drafter", "target tok/s", "train tok/s", "ratio")], {}
    for name, (B, layers, anchors, draft_vocab) in SHAPES.items():
        drafter = DFlashDrafter.for_target(lm.config, num_layers=layers, block_size=B, layer_ids=ids,
                                           mask_token_id=resolve_mask_token_id(tok, lm.config.vocab_size))
        if draft_vocab:
            drafter.set_draft_vocab(draft_vocab_ids(seqs, draft_vocab, lm.config.vocab_size))
        opt = torch.optim.AdamW(drafter.parameters(), lr=6e-4, weight_decay=0.0)
        t_target = t_train = 0.0
        for r in range(ROUNDS + 1):  # round 0 warms up
            t0 = time.perf_counter()
            target.features_many([torch.tensor(s.input_ids) for s in seqs])
            dt_target = time.perf_counter() - t0
            stats = {"loss_sum": 0.0, "tokens": 0, "target_s": 0.0, "hits": torch.zeros(B), "counts": torch.zeros(B)}
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            feats = target.features_many([torch.tensor(s.input_ids) for s in seqs])
            for i, (s, f) in enumerate(zip(seqs, feats, strict=True)):
                b = sequence_blocks(s, anchors, 0, r, i, 4096, B, drafter.config.mask_token_id)
                sequence_loss(target, drafter, b, 2048, 1e-3, stats, amp, f)
            torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
            opt.step()
            dt_train = time.perf_counter() - t0
            if r:
                t_target += dt_target
                t_train += dt_train
        target_tps, train_tps = ROUNDS * tokens / t_target, ROUNDS * tokens / t_train
        results[name] = {"block_size": B, "layers": layers, "anchors": anchors, "draft_vocab": draft_vocab,
                         "target_tokens_per_s": round(target_tps, 1),
                         "train_tokens_per_s": round(train_tps, 1), "ratio": round(train_tps / target_tps, 3),
                         "met": train_tps / target_tps >= 0.5}
        rows.append((name, f"{target_tps:.0f}", f"{train_tps:.0f}", f"{train_tps / target_tps:.2f}"))
    path = write_result("train_speed", {"sequences": len(seqs), "tokens_per_round": tokens, "rounds": ROUNDS,
                                        "target_dtype": "float32", "drafter_autocast": str(amp),
                                        "target_ratio": 0.5, "shapes": results})
    print(table(rows))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
