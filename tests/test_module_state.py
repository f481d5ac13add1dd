"""No module of grkv_core keeps state that a prefill changes: every module-level container (dicts, lists, sets, the
attributes of grkv_core's own objects, ``functools.lru_cache`` tables) is the same after prefills under GRKV with its
defaults and with each query policy as before them."""

import functools
import importlib
import pkgutil
import warnings

import torch
from conftest import tiny_model
from kvpress import SnapKVPress

import grkv_core
from grkv_core.catalog import QUERY_POLICIES
from grkv_core.evaluation.generation import prefill
from grkv_core.presses import GRKVPress

# How deep the fingerprint reads into nested containers and objects (the registries: registry, its dict, an entry).
DEPTH = 4


def fingerprint(value, depth=0):
    """A comparable picture of ``value``'s contents: containers and grkv_core's own objects read item by item (down
    to ``DEPTH``), anything else by identity, so a replaced value shows as well as an added key."""
    if depth > DEPTH:
        return ("id", id(value))
    if isinstance(value, dict):
        return ("dict", tuple((repr(key), fingerprint(item, depth + 1)) for key, item in value.items()))
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(fingerprint(item, depth + 1) for item in value))
    if isinstance(value, (set, frozenset)):
        return ("set", tuple(sorted(map(repr, value))))
    if isinstance(value, functools._lru_cache_wrapper):
        return ("lru_cache", value.cache_info().currsize)
    if type(value).__module__.startswith("grkv_core.") and hasattr(value, "__dict__") and not isinstance(value, type):
        return (type(value).__name__, fingerprint(vars(value), depth + 1))
    return ("id", id(value))


def module_state():
    """{(module, name): fingerprint} of every module-level value of every grkv_core module, and of the mutable class
    attributes of the classes they define."""
    # NOTE: every module imported first: importing a submodule adds it to its package's names.
    modules = [importlib.import_module(info.name) for info in pkgutil.walk_packages(grkv_core.__path__, "grkv_core.")]
    state = {}
    for module in modules:
        for name, value in vars(module).items():
            if isinstance(value, type) and value.__module__ == module.__name__:
                for attribute, held in vars(value).items():
                    if isinstance(held, (dict, list, set)) and not attribute.startswith("__"):
                        state[module.__name__, f"{name}.{attribute}"] = fingerprint(held)
            elif not name.startswith("__"):
                state[module.__name__, name] = fingerprint(value)
    return state


def test_a_prefill_changes_no_module_level_state():
    model = tiny_model("tiny-llama").model
    ids = torch.randint(0, model.config.vocab_size, (2, 70), generator=torch.Generator().manual_seed(0))
    before = module_state()
    assert before["grkv_core.datasets.ruler.corpora", "_read_essay_json"][0] == "lru_cache", "caches are read too"
    assert before["grkv_core.catalog", "QUERY_POLICIES"][0] == "Registry", "the registries' entries are read too"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for policy in (None, *QUERY_POLICIES):
            options = {} if policy is None else {"query_policy": policy}
            prefill(model, ids, GRKVPress(press=SnapKVPress(compression_ratio=0.5), **options))
    after = module_state()
    assert after.keys() == before.keys()
    assert [key for key in before if after[key] != before[key]] == []


def test_the_fingerprint_sees_a_module_level_cache_grow():
    cache = {"a": [1]}
    before = fingerprint(cache)
    cache["a"].append(2)
    assert fingerprint(cache) != before
    cache["b"] = []
    assert fingerprint({"a": [1]}) != fingerprint(cache)
