"""`dfpipe plan`: what a run will cost before it starts, from a few numbers (or a live generation's rate).

- generation: samples × (avg prompt+completion is irrelevant; completion tokens matter) / (tokens/s per
  GPU × GPUs) → days.
- offline hidden states: samples × avg tokens × k layers × D × bytes (bf16 = 2) → the storage an
  offline pipeline would need; online extraction stores none.
- online training: one extra target forward per sample per epoch, ~2·P FLOPs per token for a
  P-parameter target, plus the drafter's ~6·p per token.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class RunCost:
    samples: int
    avg_tokens: float
    avg_completion_tokens: float
    target_layers: int
    hidden: int
    feature_layers: int
    gpus: int
    tokens_per_s_per_gpu: float
    target_params_b: float = 0.0
    epochs: int = 6
    bytes_per_value: int = 2
    per: str = "GPU"  # what `gpus` counts: "engine" when the rate is a calibrated engine's (a TP group's)

    def generation_seconds(self) -> float:
        return self.samples * self.avg_completion_tokens / (self.tokens_per_s_per_gpu * self.gpus)

    def offline_bytes(self) -> float:
        return self.samples * self.avg_tokens * self.feature_layers * self.hidden * self.bytes_per_value

    def offline_bytes_per_token(self) -> int:
        return self.feature_layers * self.hidden * self.bytes_per_value

    def online_target_flops(self) -> float:
        return 2 * self.target_params_b * 1e9 * self.samples * self.avg_tokens * self.epochs

    def report(self) -> dict:
        d = asdict(self)
        d.update(generation_days=self.generation_seconds() / 86400, offline_tb=self.offline_bytes() / 1e12,
                 offline_bytes_per_token=self.offline_bytes_per_token(),
                 online_extra_target_pflops=self.online_target_flops() / 1e15, online_storage_bytes=0)
        return d


def format_cost(p: RunCost) -> str:
    r = p.report()
    lines = [
        f"samples {p.samples:,} × ~{p.avg_tokens:,.0f} tokens (~{p.avg_completion_tokens:,.0f} generated)",
        f"generation: {p.gpus} {p.per}(s) × {p.tokens_per_s_per_gpu:,.0f} tok/s → {r['generation_days']:.1f} days",
        f"offline hidden states: {p.feature_layers} layers × {p.hidden} × {p.bytes_per_value} B = "
        f"{r['offline_bytes_per_token']:,} B/token → {r['offline_tb']:.1f} TB",
        "online extraction: 0 B stored; one extra target forward per sample per epoch"
        + (f" (~{r['online_extra_target_pflops']:,.0f} PFLOP over {p.epochs} epochs)" if p.target_params_b else ""),
    ]
    return "\n".join(lines)
