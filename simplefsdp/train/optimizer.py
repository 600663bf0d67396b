"""AdamW for a model whose parameters live on several meshes, at the memory-bandwidth floor.

A multi-tensor AdamW runs one kernel over a list of tensors; DTensor runs such a kernel only when
every tensor in the list shares one mesh and placements. A SimpleFSDP MoE model has at least two
(dense parameters on the dp mesh, routed experts on ``[edp, ep]``), and tensor parallelism adds
more, so the parameters are split into one param group per (mesh, placements) and every group
steps as one multi-tensor kernel over its local shards (:class:`simplefsdp.train.adamw.AdamW`):
a few kernels per step instead of a dozen per parameter. Plain tensors form one group of their
own.

Gradient clipping rides on that step (:func:`clipped_step`): the kernel divides each gradient by
the clip divisor as it reads it, so clipping costs one read of the gradients for the norm, not
another read and write to scale them. Dividing by ``(norm + 1e-6) / max_norm`` instead of
multiplying by its reciprocal can move the last bit of a gradient's contribution. Every comparison
in this project uses this one optimizer on both sides.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from simplefsdp.grad_squares import GradSquares
from simplefsdp.train.adamw import AdamW
from simplefsdp.train.grad_norm import clip_divisor, clip_grads_, grad_norm, group_by_mesh


def param_groups(params) -> list[list[nn.Parameter]]:
    """``params`` split by (mesh, placements), in first-seen order; plain tensors in one group."""
    return list(group_by_mesh(params).values())


def make_optimizer(model: nn.Module, lr: float) -> AdamW:
    """AdamW over ``model``'s trainable parameters, one param group per (mesh, placements)."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    return AdamW([{"params": g} for g in param_groups(trainable)], lr=lr)


def clipped_step(optimizer: torch.optim.Optimizer, params, max_norm: float, mark=lambda phase: None,
                 squares: GradSquares | None = None) -> torch.Tensor:
    """Clip the gradients of ``params`` to ``max_norm`` (0: no clipping) and step ``optimizer``;
    returns the gradient norm before clipping. This project's :class:`AdamW` applies the clipping
    inside its step and leaves the gradients as they were (module docstring); any other optimizer
    gets its gradients scaled first, as ``clip_grad_norm_`` does. ``mark("clip")`` is called once
    the norm (and any scaling) is done. ``squares``: the model's gradient squares computed in
    backward (:func:`simplefsdp.grad_squares.track_grad_squares`), so the norm reads no gradient.

    With this project's AdamW the norm is taken inside its step, after the step has prepared every
    group's update on the host. Where the norm waits for the backward's last kernels (the squares'
    count read on the host, on a GPU without Triton), the preparation then runs while they do
    instead of after, when the GPU would have nothing to run (with the wait first, gpu_moe's
    optimizer phase on an H200 took 14.1 ms around an 11.8 ms kernel); with Triton the norm does
    not wait at all (:mod:`simplefsdp.train.square_sum`). ``mark("clip")``'s phase holds that
    preparation too."""
    if max_norm <= 0 or not isinstance(optimizer, AdamW):
        norm = clip_grads_(params, max_norm, squares)
        mark("clip")
        optimizer.step()
        return norm
    norms = []

    def divisor() -> torch.Tensor:  # called by the step once it has prepared every group's update
        norms.append(grad_norm(params, squares))
        mark("clip")
        return clip_divisor(norms[0], max_norm)

    optimizer.step(grad_divisor=divisor)
    return norms[0]
