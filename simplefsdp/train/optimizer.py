"""AdamW for a model whose parameters live on several meshes, at the memory-bandwidth floor.

A multi-tensor AdamW (``foreach`` or ``fused``) runs one kernel over a list of tensors; DTensor
runs such a kernel only when every tensor in the list shares one mesh and placements. A SimpleFSDP
MoE model has at least two (dense parameters on the dp mesh, routed experts on ``[edp, ep]``),
and tensor parallelism adds more, so the parameters are split into one param group per
(mesh, placements) and every group gets the fused kernel: a few kernels per step instead of a
dozen per parameter (``foreach=False``). Plain tensors form one group of their own.

The fused and the per-parameter implementations compute the same update; they may differ in the
last bit (different operation order inside the kernel). Every comparison in this project uses
this one optimizer on both sides.

Gradient clipping rides on the fused step (:func:`clipped_step`): fused AdamW divides each
gradient by a ``grad_scale`` tensor as it reads it (the hook ``torch.amp.GradScaler`` uses), so
clipping costs one read of the gradients for the norm, not another read and write to scale them.
Dividing by ``(norm + 1e-6) / max_norm`` instead of multiplying by its reciprocal can move the
last bit of a gradient.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from simplefsdp.train.grad_norm import clip_divisor, clip_grads_, grad_norm, group_by_mesh


def param_groups(params) -> list[list[nn.Parameter]]:
    """``params`` split by (mesh, placements), in first-seen order; plain tensors in one group."""
    return list(group_by_mesh(params).values())


def make_optimizer(model: nn.Module, lr: float) -> torch.optim.Optimizer:
    """Fused AdamW over ``model``'s trainable parameters, one param group per (mesh, placements)."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW([{"params": g} for g in param_groups(trainable)], lr=lr, fused=True)


def clipped_step(optimizer: torch.optim.Optimizer, params, max_norm: float, mark=lambda phase: None) -> torch.Tensor:
    """Clip the gradients of ``params`` to ``max_norm`` (0: no clipping) and step ``optimizer``;
    returns the gradient norm before clipping. An optimizer whose every param group is fused
    applies the clipping inside its step (module docstring); another (a group may set
    ``fused=False`` over a fused default) gets its gradients scaled first. ``mark("clip")`` is
    called once the norm (and any scaling) is done."""
    if max_norm <= 0 or not all(group.get("fused") for group in optimizer.param_groups):
        norm = clip_grads_(params, max_norm)
        mark("clip")
        optimizer.step()
        return norm
    norm = grad_norm(params)
    mark("clip")
    optimizer.grad_scale = clip_divisor(norm, max_norm)
    try:
        optimizer.step()
    finally:
        del optimizer.grad_scale
    return norm
