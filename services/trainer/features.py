"""The frozen target: its hidden states at the chosen layers, computed online (never stored).

The training forward stops after the deepest chosen layer: the layers above it and the LM head
would only be thrown away (on SmolLM2 with the paper's layers that is 2 of 30 layers and a
576×49,152 head per token). It runs the decoder stack of any HF causal LM and catches each chosen
layer's output with a forward hook, so it needs no model-specific code. For soft labels (`trainer.soft_labels`) it runs to the top instead
and also returns the final (normed) hidden state, whose product with the LM head is the target's
next-token distribution.
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
        return self._features(input_ids[None], final=False)[0][0]

    @torch.no_grad()
    def features_many(self, sequences: list[torch.Tensor]) -> list[torch.Tensor]:
        """Several sequences in one forward (bigger matmuls): right-padded, and since attention is causal
        a sequence's positions never see the padding after it, so no attention mask is needed."""
        return [f for f, _ in self._many(sequences, final=False)]

    @torch.no_grad()
    def features_and_final_many(self, sequences: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """As features_many, each with the final normed hidden state [S, D] (the LM head's input)."""
        return self._many(sequences, final=True)

    def _many(self, sequences: list[torch.Tensor], final: bool) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        width = max(len(s) for s in sequences)
        batch = torch.zeros(len(sequences), width, dtype=torch.long, device=sequences[0].device)
        for i, s in enumerate(sequences):
            batch[i, : len(s)] = s
        feats, top = self._features(batch, final)
        return [(feats[i, : len(s)], None if top is None else top[i, : len(s)]) for i, s in enumerate(sequences)]

    def pick(self, hidden_states: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """HF's hidden_states tuple → the chosen layers' outputs, concatenated: [..., S, k·D]."""
        return torch.cat([hidden_states[layer + 1] for layer in self.layer_ids], -1)

    def _features(self, input_ids: torch.Tensor, final: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[N, S] → [N, S, k·D], and the final normed hidden state [N, S, D] if `final`."""
        if self.layers is None:
            hs = self.model(input_ids=input_ids, output_hidden_states=True, use_cache=False).hidden_states
            return self.pick(hs), hs[-1] if final else None
        caught: dict[int, torch.Tensor] = {}
        last = max(self.layer_ids)

        def hook(index: int):
            def grab(_module, _args, output):
                caught[index] = output[0] if isinstance(output, tuple) else output
                if index == last and not final:
                    raise _Enough
            return grab

        handles = [self.layers[i].register_forward_hook(hook(i)) for i in sorted(set(self.layer_ids))]
        top = None
        try:
            with contextlib.suppress(_Enough):
                top = self.decoder(input_ids=input_ids, use_cache=False).last_hidden_state
        finally:
            for h in handles:
                h.remove()
        return torch.cat([caught[layer] for layer in self.layer_ids], -1), top
