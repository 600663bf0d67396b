"""Which transformers experts classes ``simple_fsdp(..., ep=E)`` can shard, walked from the installed
transformers: every class decorated with ``@use_experts_implementation`` (the contract
:mod:`simplefsdp.moe.hf_experts` builds on), and every other ``*Experts`` class, which it cannot.

Run with ``-s`` to see the table.
"""

from __future__ import annotations

import importlib
import inspect
import pathlib

import pytest

transformers = pytest.importorskip("transformers")

from tests.moe.hf_families import FAMILIES

ROUTING_ARGUMENTS = {("hidden_states", "top_k_index", "top_k_weights"), ("hidden_states", "router_indices", "routing_weights")}


def _experts_classes():
    """(model_type, class, decorated) for the experts classes of every transformers model."""
    root = pathlib.Path(transformers.__file__).parent / "models"
    for path in sorted(root.glob("*/modeling_*.py")):
        source = path.read_text()
        if "Experts" not in source:
            continue
        module = importlib.import_module(f"transformers.models.{path.parent.name}.{path.stem}")
        for name, cls in sorted(vars(module).items()):
            if not inspect.isclass(cls) or cls.__module__ != module.__name__ or not hasattr(cls, "forward"):
                continue
            decorated = "use_experts_implementation" in cls.forward.__code__.co_qualname
            if decorated or name.endswith("Experts"):
                yield path.parent.name, cls, decorated


def test_every_decorated_experts_class_takes_the_routing_arguments():
    rows = list(_experts_classes())
    supported = {model_type for model_type, _, decorated in rows if decorated}
    print(f"\n{'model_type':24} {'experts class':34} supported with ep > 1")
    for model_type, cls, decorated in rows:
        print(f"{model_type:24} {cls.__name__:34} {'yes' if decorated else 'no: not @use_experts_implementation'}")
    print(f"{len(supported)} model types supported, {sum(not d for *_, d in rows)} experts classes not")
    assert set(FAMILIES) <= supported
    for _, cls, decorated in rows:
        if decorated:
            assert tuple(inspect.signature(cls.forward).parameters)[1:4] in ROUTING_ARGUMENTS, cls
