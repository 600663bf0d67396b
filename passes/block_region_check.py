"""Refuse to lower blocks compiled once unless compiled with ``compile_options(blocks_once=True)``.

:func:`simplefsdp.compile_blocks_once` puts each block's math in a ``nested_compile_region``;
the graph then calls ``invoke_subgraph`` once per block on one shared body. With Inductor's
buffer reuse on (its default), torch 2.13 generates code whose backward gives wrong gradients:
on a 2-block model at world 1, the second block's norm weights' gradients were off by half
their size, while ``backend="aot_eager"`` and ``allow_buffer_reuse=False`` gave the eager
gradients. (One mechanism is visible in the generated code: a region body's ``SubgraphLowering``
takes the *outer* backward's donated-buffer indices and overwrites inputs at those positions; with
donation off the gradients were still wrong.) Until torch fixes it, a graph holding our regions is
refused unless ``allow_buffer_reuse`` is off, as ``compile_options(blocks_once=True)`` sets it.

The same options set the joint-graph pass :mod:`.region_saves`, without which a region's
backward reads the gathered parameters saved from forward, so ``reshard_after_forward`` would
be silently dropped: a graph holding our regions is refused without it too.
"""

from __future__ import annotations

import torch

from simplefsdp.passes.region_saves import RegionSaves, is_block_region


def _missing() -> list[str]:
    missing = []
    if torch._inductor.config.allow_buffer_reuse:
        missing.append("Inductor's buffer reuse off, or their gradients are wrong (a torch bug)")
    if not isinstance(torch._inductor.config.joint_custom_pre_pass, RegionSaves):
        missing.append("the joint-graph pass that re-gathers their parameters in backward")
    return missing


def check_block_regions(graph: torch.fx.Graph) -> None:
    missing = _missing()
    if missing and any(is_block_region(node) for node in graph.nodes):
        raise ValueError(
            f"blocks compiled once (simplefsdp.compile_blocks_once) need {' and '.join(missing)}: "
            "compile with torch.compile(model, options=simplefsdp.compile_options(blocks_once=True))"
        )
