"""Refuse to lower blocks compiled once while Inductor's buffer reuse is on.

:func:`simplefsdp.compile_blocks_once` puts each block's math in a ``nested_compile_region``;
the graph then calls ``invoke_subgraph`` once per block on one shared body. With Inductor's
buffer reuse on (its default), torch 2.13 generates code whose backward gives wrong gradients:
on a 2-block model at world 1, the second block's norm weights' gradients were off by half
their size, while ``backend="aot_eager"`` and ``allow_buffer_reuse=False`` gave the eager
gradients. (One mechanism is visible in the generated code: a region body's ``SubgraphLowering``
takes the *outer* backward's donated-buffer indices and overwrites inputs at those positions; with
donation off the gradients were still wrong.) Until torch fixes it, a graph holding our regions is
refused unless ``allow_buffer_reuse`` is off, as ``compile_options(blocks_once=True)`` sets it.
"""

from __future__ import annotations

import torch

_REGION_CALL = "_region_forward"  # the frame in simplefsdp/block_regions.py that calls the region


def check_block_regions(graph: torch.fx.Graph) -> None:
    if not torch._inductor.config.allow_buffer_reuse:
        return
    for node in graph.find_nodes(op="call_function", target=torch.ops.higher_order.invoke_subgraph):
        if _REGION_CALL in (node.meta.get("stack_trace") or ""):
            raise ValueError(
                "blocks compiled once (simplefsdp.compile_blocks_once) need Inductor's buffer reuse "
                "off, or their gradients are wrong (a torch bug): compile with "
                "torch.compile(model, options=simplefsdp.compile_options(blocks_once=True))"
            )
