"""The frozen target: its hidden states at the chosen layers, computed online (never stored).

The training forward stops after the deepest chosen layer: the layers above it and the LM head
would only be thrown away (on SmolLM2 with the paper's layers that is 2 of 30 layers and a
576×49,152 head per token). It runs the decoder stack of any HF causal LM and catches each chosen
layer's output with a forward hook, so it needs no model-specific code.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch


class _Enough(Exception):
    """Raised by the hook on the deepest chosen layer: nothing above it is needed."""


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
        self.decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
        layers = getattr(self.decoder, "layers", None)
        # HF's hidden_states[n] (after the last layer) has the final norm applied: a hook on the last
        # layer would see it without, so that case (and any model without a `layers` list) runs whole.
        self.layers = layers if layers is not None and len(layers) == n and max(layer_ids) < n - 1 else None
        self._head: dict[torch.dtype, torch.Tensor] = {}

    def head_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The frozen LM head's weight in `dtype`, converted once (autocast would re-cast 49k×D per call)."""
        w = self.lm_head.weight
        if w.dtype == dtype:
            return w
        if dtype not in self._head:
            self._head[dtype] = w.detach().to(dtype)
        return self._head[dtype]

    @torch.no_grad()
    def features(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[S] ids → [S, k·D]: the *output* of each chosen layer l, i.e. HF hidden_states[l + 1]. No shift."""
        return self._features(input_ids[None])[0]

    @torch.no_grad()
    def features_many(self, sequences: list[torch.Tensor]) -> list[torch.Tensor]:
        """Several sequences in one forward (bigger matmuls): right-padded, and since attention is causal
        a sequence's positions never see the padding after it, so no attention mask is needed."""
        if len(sequences) == 1:
            return [self.features(sequences[0])]
        width = max(len(s) for s in sequences)
        batch = torch.zeros(len(sequences), width, dtype=torch.long, device=sequences[0].device)
        for i, s in enumerate(sequences):
            batch[i, : len(s)] = s
        feats = self._features(batch)
        return [feats[i, : len(s)] for i, s in enumerate(sequences)]

    def pick(self, hidden_states: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """HF's hidden_states tuple → the chosen layers' outputs, concatenated: [..., S, k·D]."""
        return torch.cat([hidden_states[layer + 1] for layer in self.layer_ids], -1)

    def _features(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[N, S] → [N, S, k·D]."""
        if self.layers is None:
            return self.pick(self.model(input_ids=input_ids, output_hidden_states=True, use_cache=False).hidden_states)
        caught: dict[int, torch.Tensor] = {}
        last = max(self.layer_ids)

        def hook(index: int):
            def grab(_module, _args, output):
                caught[index] = output[0] if isinstance(output, tuple) else output
                if index == last:
                    raise _Enough
            return grab

        handles = [self.layers[i].register_forward_hook(hook(i)) for i in sorted(set(self.layer_ids))]
        try:
            with contextlib.suppress(_Enough):
                self.decoder(input_ids=input_ids, use_cache=False)
        finally:
            for h in handles:
                h.remove()
        return torch.cat([caught[layer] for layer in self.layer_ids], -1)
