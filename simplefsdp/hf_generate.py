"""``generate()`` of a wrapped Hugging Face model keeps every rank stepping until all have finished.

Each forward of a wrapped model gathers parameters on every rank, so a rank whose sequences have
ended must keep running forwards while any other rank still generates. transformers does that
(``synced_gpus``: an all-reduce of "finished" each step, then dummy forwards) when the caller
passes ``synced_gpus=True``, or by default for models it sees as FSDP-managed. Its mark for those,
the attribute ``_is_fsdp_managed_module``, is also what Dynamo reads to treat a module as FSDP1's
(it then refuses to compile it: "Dynamo only supports FSDP with use_orig_params=True"). So instead
the root's class is swapped for a subclass whose ``generate`` defaults ``synced_gpus`` to True
when more than one rank runs; an explicit ``synced_gpus`` is passed on as given. The subclass
keeps the class's name, which transformers writes into a saved config's ``architectures``.
"""

from __future__ import annotations

import torch.distributed as dist
import torch.nn as nn

from simplefsdp.generated_classes import generated_class

_SYNCED_CLASSES: dict[type, type] = {}


def synced_generate_class(cls: type) -> type:
    """The subclass of ``cls`` whose ``generate`` defaults to ``synced_gpus`` across ranks (one per class)."""
    if cls not in _SYNCED_CLASSES:

        def generate(self, *args, synced_gpus: bool | None = None, **kwargs):
            if synced_gpus is None:
                synced_gpus = dist.is_initialized() and dist.get_world_size() > 1
            return cls.generate(self, *args, synced_gpus=synced_gpus, **kwargs)

        # the same name: transformers reads it (save_pretrained's config.architectures, messages)
        _SYNCED_CLASSES[cls] = generated_class((synced_generate_class, (cls,)), cls.__name__, cls, {"generate": generate})
    return _SYNCED_CLASSES[cls]


def sync_generate(model: nn.Module) -> None:
    """Make ``model.generate()`` keep ranks in step (class swap; nothing else changes)."""
    model.__class__ = synced_generate_class(type(model))
