"""Checks shared by the press test modules."""

import torch

from grkv_core.generation import prefill


def assert_batch_elements_compressed_independently(model, ids, press, tolerance=2e-4):
    """Every batch element's compressed cache equals the one its own single-element prefill produces."""
    batched = prefill(model, ids, press)
    for b in range(ids.shape[0]):
        single = prefill(model, ids[b : b + 1], press)
        for layer_batched, layer_single in zip(batched.layers, single.layers):
            torch.testing.assert_close(layer_batched.keys[b], layer_single.keys[0], rtol=tolerance, atol=tolerance)
            torch.testing.assert_close(layer_batched.values[b], layer_single.values[0], rtol=tolerance,
                                       atol=tolerance)
