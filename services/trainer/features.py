"""The frozen target: its hidden states at the chosen layers, computed online (never stored)."""

from __future__ import annotations

from typing import Any

import torch


class Target:
    def __init__(self, model: Any, layer_ids: list[int]) -> None:
        self.model = model.eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.layer_ids = layer_ids
        self.embed = model.get_input_embeddings()
        self.lm_head = model.get_output_embeddings()
        n = model.config.num_hidden_layers
        if max(layer_ids) >= n or min(layer_ids) < 0:
            raise ValueError(f"feature layers {layer_ids} outside the target's {n} layers")

    @torch.no_grad()
    def features(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[S] ids → [S, k·D]: the *output* of each chosen layer l, i.e. HF hidden_states[l + 1]. No shift."""
        out = self.model(input_ids=input_ids[None], output_hidden_states=True, use_cache=False)
        return torch.cat([out.hidden_states[layer + 1][0] for layer in self.layer_ids], -1)
