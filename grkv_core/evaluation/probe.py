"""The reconstruction probe of an evaluation: how far each compressed cache's attention outputs are from the full one.

Three query sets, each normalised the same way (Σ‖Y_full − Y_comp‖² / Σ‖Y_full‖² over all layers and heads):

- **window**: the last ``loss_window`` prompt positions (causal), the queries the merge itself fits;
- **held-out**: the queries of the first ``heldout_tokens`` tokens each cache generates (needs decoding);
- **question**: the question's own queries, teacher-forced on its reference answer under the full cache, so
  they are the same for every press and need no decoding: the queries a compressed cache must serve next.

The probe only observes (forward hooks that keep references); it never changes what the model computes.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from grkv_core.cache.per_head import PerHeadRows, kept_rows
from grkv_core.evaluation.shared_prefill import PER_HEAD_MASKED, PressedCache, attention_modules
from grkv_core.presses.query_policies import surrogate_queries
from grkv_core.solver.attention import full_cache_outputs
from grkv_core.solver.losses import discrepancy_per_head, recover_kept_positions


class ReconstructionProbe:
    """Collects the three query sets of one sample and measures every compressed cache against the full one.

    Parameters
    ----------
    model : PreTrainedModel
    loss_window : int
        Last prompt positions whose queries form the window set.
    heldout_tokens : int
        First generated tokens whose queries form the held-out set of each cache (0 disables it).
    """

    def __init__(self, model, loss_window: int, heldout_tokens: int):
        self.model = model
        self.loss_window = loss_window
        self.heldout_tokens = heldout_tokens
        self.window_inputs: dict[int, tuple] = {}
        self.question_queries: dict[int, list[torch.Tensor]] = {}
        # NOTE: held-out queries are kept per cache (its index in the evaluation) and per layer.
        self.heldout: dict[int, dict[int, list[torch.Tensor]]] = {}
        self._decode_rows: list[int | None] = []
        self._full_outputs: dict[tuple[str, int], torch.Tensor] = {}
        self._window: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    @contextmanager
    def _hooks(self, hook):
        handles = [
            attention.register_forward_hook(hook, with_kwargs=True) for attention in attention_modules(self.model)
        ]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def watching_prefill(self):
        """Context for the prefill: keeps each layer's window inputs (register it before any press)."""
        return self._hooks(self._keep_window_inputs)

    def _keep_window_inputs(self, module, args, kwargs, output):
        hidden = kwargs["hidden_states"]
        if module.layer_idx in self.window_inputs:
            return
        cos, sin = kwargs["position_embeddings"]
        window = slice(-self.loss_window, None)
        self.window_inputs[module.layer_idx] = (
            module,
            hidden[:, window],
            cos[:, window],
            sin[:, window],
            hidden.shape[1],
        )

    def watching_decoding(self):
        """Context for the first question's decoding: keeps the queries of each cache's first generated tokens."""
        return self._hooks(self._keep_heldout_queries)

    def on_decode_step(self, indices: list[int], active: list[bool]) -> None:
        """``answer_batch``'s callback: which cache each batch row is, and whether it is still generating."""
        self._decode_rows = [index if is_active else None for index, is_active in zip(indices, active)]

    def _keep_heldout_queries(self, module, args, kwargs, output):
        hidden = kwargs["hidden_states"]
        if hidden.shape[1] != 1:
            return
        queries = surrogate_queries(module, hidden, kwargs["position_embeddings"], n_queries=1).queries
        for row, index in enumerate(self._decode_rows):
            if index is None:
                continue
            captured = self.heldout.setdefault(index, {}).setdefault(module.layer_idx, [])
            if len(captured) < self.heldout_tokens:
                captured.append(queries[row : row + 1])

    def watching_question(self):
        """Context for the question and its reference answer teacher-forced on the full cache (once per question):
        keeps every position's queries."""
        return self._hooks(self._keep_question_queries)

    def _keep_question_queries(self, module, args, kwargs, output):
        hidden = kwargs["hidden_states"]
        queries = surrogate_queries(module, hidden, kwargs["position_embeddings"], n_queries=hidden.shape[1]).queries
        self.question_queries.setdefault(module.layer_idx, []).append(queries)

    def losses(
        self, index: int, full: list[tuple[torch.Tensor, torch.Tensor]], pressed: PressedCache
    ) -> dict[str, float | None]:
        """``window_loss``, ``heldout_loss`` and ``question_loss`` of cache ``index`` (None where not collected)."""
        views = [self._view(layer, full[layer][0], pressed) for layer in range(len(full))]
        window = question = None
        if self.window_inputs:
            window = self._loss("window", full, views, self._window_queries, causal=True)
        if self.question_queries:
            question = self._loss("question", full, views, lambda layer: torch.cat(self.question_queries[layer], 2))
        heldout = None
        if self.heldout.get(index):
            captured = self.heldout[index]
            heldout = self._loss(None, full, views, lambda layer: torch.cat(captured[layer], 2))
        return {"window_loss": window, "heldout_loss": heldout, "question_loss": question}

    def _window_queries(self, layer: int):
        if layer not in self._window:
            module, hidden, cos, sin, length = self.window_inputs[layer]
            window = surrogate_queries(module, hidden, (cos, sin), n_queries=self.loss_window)
            # surrogate_queries numbered the window from 0; shift to its true place at the prompt's end.
            self._window[layer] = (window.queries, window.positions + (length - hidden.shape[1]))
        return self._window[layer]

    def _loss(self, shared: str | None, full, views, queries_of, causal: bool = False) -> float:
        """Σ error / Σ reference over layers; Y_full of a query set every cache shares is computed once."""
        error = reference = 0.0
        attentions = attention_modules(self.model)
        for layer, view in enumerate(views):
            module = attentions[layer]
            found = queries_of(layer)
            queries, positions = found if causal else (found, None)
            full_keys, full_values = full[layer]
            full_outputs = None
            if shared is not None:
                key = (shared, layer)
                if key not in self._full_outputs:
                    self._full_outputs[key] = full_cache_outputs(
                        queries, full_keys, full_values, query_positions=positions, scale=module.scaling
                    )
                full_outputs = self._full_outputs[key]
            err, ref = discrepancy_per_head(
                queries,
                full_keys,
                full_values,
                view["keys"],
                view["values"],
                query_positions=positions,
                compressed_positions=view["positions"] if causal else None,
                compressed_mask=view["mask"],
                scale=module.scaling,
                full_outputs=full_outputs,
            )
            error, reference = error + float(err.sum()), reference + float(ref.sum())
        return error / max(reference, 1e-30)

    @staticmethod
    def _view(layer: int, full_keys: torch.Tensor, pressed: PressedCache) -> dict:
        """One layer of a compressed cache: keys/values, the positions its rows came from, the masking press's mask."""
        cache_layer = pressed.cache.layers[layer]
        keys, values = cache_layer.keys, cache_layer.values
        state = pressed.module_state[layer]
        mask = None
        if isinstance(keys, PerHeadRows):
            # The same rows as the masked layout it came from (the probe reads dense tensors).
            state = {**state, "masked_key_indices": state.get(PER_HEAD_MASKED)}
            kept = kept_rows(keys, state["masked_key_indices"])
            keys, values = keys.dense(kept), values.dense(kept)
        if state.get("kept_positions") is not None:
            positions = state["kept_positions"]
        elif keys.shape[2] == full_keys.shape[2]:
            positions = torch.arange(keys.shape[2], device=keys.device).expand(keys.shape[:3])
            masked = state.get("masked_key_indices")
            if masked is not None:
                mask = torch.ones(keys.shape[:3], dtype=torch.bool, device=keys.device)
                mask[tuple(index.to(keys.device) for index in masked)] = False
        else:
            positions = recover_kept_positions(keys, full_keys)
        return dict(keys=keys, values=values, positions=positions, mask=mask)
