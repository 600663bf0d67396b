"""Module subclasses generated at run time that still pickle (``torch.save(model)``, ``copy``).

Wrapping swaps a module's class for a generated subclass (parameter properties in
:mod:`simplefsdp.param_access`, the expert-parallel forward of a Hugging Face experts module in
:mod:`simplefsdp.moe.hf_experts`, the synced ``generate`` of a Hugging Face root in
:mod:`simplefsdp.hf_generate`). Pickle stores a class by its module and name, and a generated
class is found under neither. So each is made by a cached factory, and its metaclass,
:class:`GeneratedClass`, pickles it as the call that makes it: ``factory(*args)``, which returns
the same class in this process and makes it again in another.
"""

from __future__ import annotations

import copyreg
from typing import Callable


class GeneratedClass(type):
    """The metaclass of a generated class; ``_recipe`` is the ``(factory, args)`` that made it."""


def generated_class(recipe: tuple[Callable[..., type], tuple], name: str, base: type, namespace: dict) -> type:
    """A subclass ``name`` of ``base`` with ``namespace``, pickled as ``recipe``'s call."""
    cls = GeneratedClass(name, (base,), namespace)
    cls._recipe = recipe
    return cls


copyreg.pickle(GeneratedClass, lambda cls: cls._recipe)
