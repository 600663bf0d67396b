"""Checkpoints with ``torch.distributed.checkpoint`` (DCP): sharded save, resharding load.

A checkpoint folder holds ``model.json`` (the model config it belongs to) and one directory per
saved step, ``step-00000012``, with the model and optimizer state dicts, keyed by parameter name
(``torch.distributed.checkpoint.state_dict``). Each rank writes its shards; DCP's metadata holds
every tensor's global shape, so a checkpoint loads into any parallel layout of the same model
(saved at FSDP4, loaded at FSDP2 x EP2): each rank reads the pieces its new shards overlap.

A step is written to ``step-N.tmp`` and renamed by rank 0 once every rank has finished, so a run
killed while saving leaves no half-written checkpoint behind to resume from. A folder holding a
checkpoint of a different model config is never written to.
"""

from __future__ import annotations

import os
import re
import shutil

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

# optimizer state and hyperparameters keyed by parameter name, not by param-group index: the
# optimizer has one group per (mesh, placements), so the groups differ between layouts
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)

_STEP_DIR = re.compile(r"step-(\d{8})$")
_MODEL_FILE = "model.json"


class CheckpointError(ValueError):
    """A checkpoint folder that this run must not use as asked."""


def saved_steps(folder: str) -> list[int]:
    if not os.path.isdir(folder):
        return []
    return sorted(int(m.group(1)) for name in os.listdir(folder) if (m := _STEP_DIR.match(name)))


def check_folder(folder: str, fingerprint: str, resume: bool) -> int:
    """The step to resume from (0: start fresh), or :class:`CheckpointError`. No collectives."""
    path = os.path.join(folder, _MODEL_FILE)
    steps = saved_steps(folder)
    if os.path.exists(path):
        with open(path) as f:
            saved = f.read()
        if saved != fingerprint:
            raise CheckpointError(
                f"checkpoint.folder: {folder} holds checkpoints of a different model config ({saved}); "
                "choose another folder or delete it"
            )
    if resume and not steps:
        raise CheckpointError(f"checkpoint.folder: --resume, but {folder} holds no checkpoint to resume from")
    if steps and not resume:
        raise CheckpointError(
            f"checkpoint.folder: {folder} already holds checkpoints (last: step {steps[-1]}); "
            "pass --resume to continue from it, or choose another folder"
        )
    return steps[-1] if resume else 0


class Checkpointer:
    """Saves and loads ``model`` and ``optimizer``. ``adapt(model, state)`` (optional) maps a
    flat state dict to the one DCP writes and reads, sharing its tensors' storage (the FSDP2
    baseline's routed experts: :func:`simplefsdp.baselines.fsdp2.global_expert_state`)."""

    def __init__(self, folder: str, fingerprint: str, model, optimizer, adapt=None):
        self.folder, self.fingerprint = folder, fingerprint
        self.model, self.optimizer = model, optimizer
        self.adapt = adapt or (lambda model, state: state)

    def _state(self) -> tuple[dict, dict]:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=_OPTIONS)
        return (model_sd, optim_sd), {"model": self.adapt(self.model, model_sd), "optim": self.adapt(self.model, optim_sd)}

    def _dir(self, step: int) -> str:
        return os.path.join(self.folder, f"step-{step:08d}")

    def save(self, step: int) -> None:
        _, state = self._state()
        final, tmp = self._dir(step), self._dir(step) + ".tmp"
        rank0 = dist.get_rank() == 0
        if rank0:
            os.makedirs(self.folder, exist_ok=True)
            with open(os.path.join(self.folder, _MODEL_FILE), "w") as f:
                f.write(self.fingerprint)
            shutil.rmtree(tmp, ignore_errors=True)
        dist.barrier()
        dcp.save(state, checkpoint_id=tmp)
        dist.barrier()  # every rank's shards are on disk
        if rank0:
            shutil.rmtree(final, ignore_errors=True)
            os.rename(tmp, final)
        dist.barrier()

    def load(self, step: int) -> None:
        (model_sd, optim_sd), state = self._state()
        dcp.load(state, checkpoint_id=self._dir(step))  # in place, into the storage model_sd and optim_sd share
        set_state_dict(self.model, self.optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd, options=_OPTIONS)
