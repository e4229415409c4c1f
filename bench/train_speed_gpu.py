"""GPU training speed at the default shape: the trainer's own step on a real-size target with random weights.

For a GPU machine with no model hub and little room for files: the target is built from Qwen3-8B's
config (36 layers, hidden 4096, vocabulary 151,936) with random bf16 weights directly on the GPU, the
sequences are random token ids (2,048 tokens, the last 1,792 supervised; random weights make the
values meaningless but the cost the same), and each drafter of the default shape (B=16, 5 layers, 512
anchors, `token_budget` 16,384) takes `DrafterStep` steps, the trainer's step, with the trainer's GPU
settings (bf16 target, bf16 drafter autocast). Measured per architecture (DFlash, DFlash 2), alternated
with the target forward alone on the same sequences: tokens/s of each, their ratio, and peak GPU memory.
`--tiny` runs the same code on a small 8-layer target (a CPU check that the script works). Writes
bench/results/train_speed_gpu.json (or train_speed_gpu-tiny.json) with the device named.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from common import table, write_result

QWEN3_8B = {"hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151_936, "max_position_embeddings": 40_960,
            "rope_theta": 1_000_000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False}
TINY = {**QWEN3_8B, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 8, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 4096}


def random_samples(n: int, length: int, prompt: int, vocab: int, seed: int) -> list:
    from shared.records import TokenizedSample

    g = torch.Generator().manual_seed(seed)
    return [TokenizedSample(prompt_id=f"s{i}", input_ids=torch.randint(0, vocab - 1, (length,), generator=g).tolist(),
                            loss_mask=[0] * prompt + [1] * (length - prompt), num_tokens=length,
                            num_supervised=length - prompt) for i in range(n)]


def main() -> int:
    import msgspec
    from transformers import AutoModelForCausalLM, Qwen3Config

    from services.trainer.dist import Dist
    from services.trainer.drafters import new_drafter
    from services.trainer.features import Target
    from services.trainer.model import feature_layer_ids
    from services.trainer.step import DrafterStep
    from shared.config import TrainerConfig

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="a small 8-layer target on whatever device there is (a check)")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per architecture (after 2 warm-up steps)")
    ap.add_argument("--length", type=int, default=2048, help="tokens per sequence")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not args.tiny:
        print("no GPU here: run with --tiny for a CPU check of the script", file=sys.stderr)
        return 2
    spec = TINY if args.tiny else QWEN3_8B
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(0)
    t0 = time.perf_counter()
    with torch.device(device):  # built where it runs: 16 GB of bf16 weights never touch the host
        lm = AutoModelForCausalLM.from_config(Qwen3Config(**spec), dtype=dtype).eval()
    build_s = time.perf_counter() - t0
    for p in lm.parameters():
        p.requires_grad_(False)
    layers = spec["num_hidden_layers"]
    ids = feature_layer_ids(layers, 5)
    target = Target(lm, ids)
    base = TrainerConfig()  # the defaults: B=16, 5 layers, 512 anchors, token_budget 16384
    per_micro = 2 if args.tiny else max(1, base.token_budget // args.length)  # tiny: a check, not a measure
    samples = random_samples(per_micro, args.length, args.length // 8, spec["vocab_size"], 0)
    micro = [[(i, s) for i, s in enumerate(samples)]]
    tokens = per_micro * args.length
    amp = torch.bfloat16 if device == "cuda" else None
    rows, results = [("arch", "target tok/s", "train tok/s", "ratio", "peak GiB")], {}
    for arch in ("dflash", "dflash2"):
        t = msgspec.structs.replace(base, arch=arch)
        drafter = new_drafter(t, lm.config, num_layers=t.num_layers, block_size=t.block_size, layer_ids=ids,
                              mask_token_id=spec["vocab_size"] - 1).to(device)
        opt = torch.optim.AdamW(drafter.parameters(), lr=t.lr)
        step = DrafterStep(t, target, drafter, opt, device, Dist(), amp, None)
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t_target = t_train = 0.0
        for i in range(args.steps + 2):  # 2 warm-up steps
            seqs = [torch.tensor(s.input_ids, device=device) for s in samples]
            t1 = time.perf_counter()
            target.features_many(seqs)
            if device == "cuda":
                torch.cuda.synchronize()
            t2 = time.perf_counter()
            step(micro, i)
            if device == "cuda":
                torch.cuda.synchronize()
            t3 = time.perf_counter()
            if i >= 2:
                t_target, t_train = t_target + t2 - t1, t_train + t3 - t2
        target_tps, train_tps = args.steps * tokens / t_target, args.steps * tokens / t_train
        peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None
        results[arch] = {"target_tokens_per_s": round(target_tps, 1), "train_tokens_per_s": round(train_tps, 1),
                         "ratio": round(train_tps / target_tps, 3), "peak_gpu_gib": round(peak, 2) if peak else None,
                         "drafter_params_m": round(sum(p.numel() for p in drafter.parameters()) / 1e6, 1)}
        rows.append((arch, f"{target_tps:.0f}", f"{train_tps:.0f}", f"{train_tps / target_tps:.2f}",
                     f"{peak:.1f}" if peak else "-"))
        del drafter, opt, step
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    out = write_result("train_speed_gpu" + ("-tiny" if args.tiny else ""), {
        "device": name, "target": "Qwen3-8B config, random weights" if not args.tiny else "tiny Qwen3, random weights",
        "target_dtype": str(dtype), "target_build_s": round(build_s, 1), "sequence_tokens": args.length,
        "sequences_per_step": per_micro, "steps": args.steps,
        "shape": {"block_size": base.block_size, "layers": base.num_layers, "anchors": base.anchors_per_sequence},
        "archs": results})
    print(f"{name}\n{table(rows)}\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
