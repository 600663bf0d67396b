"""FSDP prefetch: issue a block's all-gathers while the block before it computes; let its
reduce-scatters finish while the next block computes.

As traced, each block's parameters are gathered right before the block uses them and each
gradient's reduce-scatter is waited on right after it starts, so the compute stream stalls on
every collective. This post-grad pass moves, per block (the blocks of :func:`fx_utils.block_of`,
taken in the order the graph first gathers them, so backward's reversed order too):

* each block's all-gathers (with the casts and pads that make their inputs) up to just before
  the first all-gather wait of the block ``in_flight`` blocks earlier; the waits stay where the
  parameters are first used. Forward, ``in_flight=1``, blocks 0, 1, 2::

      ag0 wait0 compute0 ag1 wait1 compute1 ag2 wait2 compute2
      ->  ag0 ag1 wait0 compute0 ag2 wait1 compute1 wait2 compute2

* each block's reduce-scatter waits down to just before the first reduce-scatter of the block
  ``in_flight`` blocks later (the last blocks' to the end), so at most ``in_flight + 1`` blocks'
  gradients are in flight::

      rs2 wait2 compute1 rs1 wait1 compute0 rs0 wait0  ->  rs2 compute1 wait2 rs1 compute0 wait1 rs0 wait0

Only gathers of parameters move (their inputs derive from graph inputs alone; a gather of
activations, such as tensor parallel's after an expert combine, stays). Memory: up to
``in_flight`` extra blocks of gathered parameters, and of unreduced gradients. Only the order
changes, through :func:`fx_utils.reorder`, which keeps every dependency and each process group's
sequence of collectives. The plan (per block, where its gathers were issued and where its
reduce-scatters were waited on) is written to the structured trace as ``simplefsdp_fsdp_prefetch``.

Graphs whose collectives run on gloo are left as they are: there every collective is waited on
before the next starts (:mod:`.gloo_one_in_flight`), so nothing could overlap anyway.
"""

from __future__ import annotations

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from simplefsdp.passes import fx_utils
from simplefsdp.passes.fx_utils import input_closure, node_block, op_name, record_plan, reorder, waits_of

ARTIFACT = "simplefsdp_fsdp_prefetch"


def _blocks(graph: torch.fx.Graph, names: tuple[str, ...], lists: tuple[str, ...]) -> dict[str, list[torch.fx.Node]]:
    """Collectives named ``names`` (parameter gathers only, for all-gathers) per block, in graph order."""
    out: dict[str, list[torch.fx.Node]] = {}
    for node in graph.nodes:
        name = op_name(node)
        if name not in names:
            continue
        if name.startswith("all_gather") and input_closure([node]) is None:
            continue
        out.setdefault(node_block(node, lists), []).append(node)
    return out


class FSDPPrefetch(CustomGraphPass):
    """Gather each block's parameters ``in_flight`` blocks ahead; drain its reduce-scatters behind."""

    GATHERS = ("all_gather_into_tensor", "all_gather_into_tensor_out", "all_gather_into_tensor_coalesced")
    REDUCE_SCATTERS = ("reduce_scatter_tensor", "reduce_scatter_tensor_out", "reduce_scatter_tensor_coalesced")

    def __init__(self, in_flight: int = 1, blocks: tuple[str, ...] = ()):
        if not isinstance(in_flight, int) or in_flight < 1:
            raise ValueError(f"prefetch in_flight must be a positive int; got {in_flight!r}")
        self.in_flight = in_flight
        self.blocks = tuple(blocks)

    def __call__(self, graph: torch.fx.Graph) -> None:
        if fx_utils.runs_on_gloo(graph):
            return
        position = {n: i for i, n in enumerate(graph.nodes)}
        keys, plan = {}, []
        gathers = list(_blocks(graph, self.GATHERS, self.blocks).items())
        for i, (block, starts) in enumerate(gathers[self.in_flight:], start=self.in_flight):
            earlier = [w for start in gathers[i - self.in_flight][1] for w in waits_of(start)]
            if not earlier:
                continue
            first_wait = min(earlier, key=position.__getitem__)
            anchor = position[first_wait]
            inputs = sorted(input_closure(starts), key=position.__getitem__)
            for j, node in enumerate([*inputs, *starts]):
                if position[node] > anchor:
                    keys[node] = (anchor, -1, j)
            plan.append({"block": block, "all_gathers": len(starts), "issued_before": first_wait.name})
        reductions = list(_blocks(graph, self.REDUCE_SCATTERS, self.blocks).items())
        for i, (block, starts) in enumerate(reductions):
            later = reductions[i + self.in_flight][1][0] if i + self.in_flight < len(reductions) else None
            for wait in (w for start in starts for w in waits_of(start)):
                # its users (splits of a bucket, the HSDP all-reduce, output) follow it there
                target = len(position) if later is None else position[later]
                if target > position[wait]:
                    keys[wait] = (target, -1, position[wait])
            plan.append({"block": block, "reduce_scatters": len(starts),
                         "waited_before": "end" if later is None else later.name})
        record_plan(ARTIFACT, plan)
        if keys:
            reorder(graph, keys)

    def uuid(self) -> bytes:
        return get_hash_for_files((__file__, fx_utils.__file__), extra=repr((self.in_flight, self.blocks)))

