"""Per-mesh FSDP bucketing: one all-gather (and one reduce-scatter) per block, process group and dtype.

SimpleFSDP traces one all-gather per parameter in forward (and per re-gathered parameter in
backward) and one reduce-scatter per gradient. This post-grad pass merges them into buckets: by
default one bucket per transformer block, process group and dtype, so an MoE block gets one
bucket on the dense dp mesh and one on the expert (edp) mesh, and collectives of different
process groups are never mixed. Before and after, for one block on 8 ranks::

    all_gather[dp_shard](wq) wait mm ... all_gather[dp_shard](w2) wait mm
    ->  all_gather_coalesced[dp_shard](wq, wk, ..., w2) wait[0] mm ... wait[6] mm

A parameter's block (:func:`fx_utils.block_of`) is the path of its module up to the first list index (``layers.3``);
parameters outside any list (embeddings, final norm, output) share the ``root`` bucket, as
FSDP2's root unit does. ``bucket_cap_mb`` splits a bucket that would exceed it.

Each kind is merged the way that leaves every value unchanged bit for bit:

* reduce-scatters by torch's ``merge_reduce_scatter_bucket``: the gradients are concatenated into
  one buffer, reduced once and split again;
* all-gathers into one coalesced collective (``all_gather_into_tensor_coalesced``, which NCCL
  runs as one group of gathers)::

      ag0 = all_gather(w0); wait(ag0) ... ag1 = all_gather(w1); wait(ag1)
      ->  ags = all_gather_coalesced([w0, w1]); wait(ags[0]) ... wait(ags[1])

  Each parameter keeps its own output buffer, so the kernels that read it are the kernels that
  read it unbucketed. A flat bucket (torch's ``merge_all_gather_bucket``) gathers the same bytes
  but adds a copy out of the bucket, which Inductor fuses into neighbouring kernels; on CPU those
  round differently and losses move in the last bits. Each wait stays where the parameter's
  gather was waited on, that is at its first use.

Each call records its plan (buckets with their parameters, group, dtype and bytes) as the
structured-trace artifact ``simplefsdp_fsdp_buckets``, which tlparse shows.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field, fields

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
from torch._inductor.fx_passes.bucketing import (
    is_all_gather_into_tensor,
    is_reduce_scatter_tensor,
    merge_reduce_scatter_bucket,
)

from simplefsdp.passes import fx_utils
from simplefsdp.passes.fx_utils import BLOCK_META, input_closure, module_path, node_block, record_plan, waits_of

ARTIFACT = "simplefsdp_fsdp_buckets"
# passed to torch's merge helper explicitly: without it, torch 2.13 follows the global
# ``aten_distributed_optimizations.bucket_mode``, which may emit ops this pass does not expect
BUCKET_MODE = "default"
_c10d = torch.ops._c10d_functional


@dataclass
class Bucket:
    kind: str  # "all_gather" or "reduce_scatter"
    block: str
    group: str
    dtype: str
    params: list[str] = field(default_factory=list)
    bytes: int = 0
    nodes: list[torch.fx.Node] = field(default_factory=list, repr=False)

    def record(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "nodes"}


def _bytes(node: torch.fx.Node) -> int:
    val = node.meta["val"]
    return int(val.numel()) * val.element_size()


def plan_buckets(
    graph: torch.fx.Graph,
    bucket_cap_mb: float | None = None,
    kinds: tuple[str, ...] = ("all_gather", "reduce_scatter"),
    blocks: tuple[str, ...] = (),
) -> list[Bucket]:
    """The buckets, in graph order of their first collective; singletons are left out."""
    buckets: dict[tuple, list[Bucket]] = {}
    cap = None if bucket_cap_mb is None else bucket_cap_mb * 2**20
    for node in graph.nodes:
        if is_all_gather_into_tensor(node) and "all_gather" in kinds:
            if input_closure([node]) is None:  # gathers activations (tp after a combine), not a parameter
                continue
            kind, group, extra = "all_gather", node.args[2], ()
        elif is_reduce_scatter_tensor(node) and "reduce_scatter" in kinds:
            kind, group, extra = "reduce_scatter", node.args[3], (node.args[1],)
        else:
            continue
        path = module_path(node)
        block = node_block(node, blocks)
        dtype = str(node.meta["val"].dtype).removeprefix("torch.")
        key = (kind, block, str(group), dtype, *extra)
        chain = buckets.setdefault(key, [])
        size = _bytes(node)
        if not chain or (cap is not None and chain[-1].bytes + size > cap and chain[-1].nodes):
            chain.append(Bucket(kind, block, str(group), dtype))
        bucket = chain[-1]
        bucket.nodes.append(node)
        bucket.params.append(path or node.name)
        bucket.bytes += size
    planned = [b for chain in buckets.values() for b in chain if len(b.nodes) > 1]
    order = {node: i for i, node in enumerate(graph.nodes)}
    return sorted(planned, key=lambda b: order[b.nodes[0]])


def _hoist_inputs(graph: torch.fx.Graph, collectives: list[torch.fx.Node], before: torch.fx.Node) -> None:
    """Move the computation of the collectives' inputs above ``before``, in graph order.

    FSDP gather inputs derive from graph inputs alone (the shards), so the closure of their
    producers can move up; a bucket whose inputs depend on a collective is a planning bug.
    """
    needed = input_closure(collectives)
    if needed is None:
        raise AssertionError(f"an input of the bucket of {collectives[0]} depends on a collective")
    order = {node: i for i, node in enumerate(graph.nodes)}
    for node in sorted(needed, key=order.__getitem__):
        if order[node] > order[before]:
            before.prepend(node)


def merge_all_gathers(graph: torch.fx.Graph, gathers: list[torch.fx.Node]) -> torch.fx.Node:
    """Replace ``gathers`` (one process group) by one coalesced all-gather where the first was.

    Each gather's wait becomes ``wait(coalesced[i])`` in the same place; the inputs of the later
    gathers must already be computed above the first (:func:`_hoist_inputs`).
    """
    first = gathers[0]
    group_size, group_name = first.args[1:3]
    if any(g.args[1:3] != (group_size, group_name) for g in gathers):
        raise AssertionError(f"the all-gathers of one bucket run on different groups: {gathers}")
    with graph.inserting_before(first):
        coalesced = graph.call_function(
            _c10d.all_gather_into_tensor_coalesced.default, ([g.args[0] for g in gathers], group_size, group_name)
        )
    coalesced.meta.update(first.meta, val=[g.meta["val"] for g in gathers])
    for i, gather in enumerate(gathers):
        (wait,) = waits_of(gather)
        with graph.inserting_before(wait):
            item = graph.call_function(operator.getitem, (coalesced, i))
            new_wait = graph.call_function(_c10d.wait_tensor.default, (item,))
        item.meta.update(gather.meta)
        new_wait.meta.update(wait.meta)
        wait.replace_all_uses_with(new_wait)
        graph.erase_node(wait)
        graph.erase_node(gather)
    return coalesced


class FSDPBucketing(CustomGraphPass):
    """Merge FSDP all-gathers and reduce-scatters per (block, process group, dtype).

    ``all_gathers`` / ``reduce_scatters`` turn either half off. Either leaves every bit of
    training unchanged (tested on gloo ranks).
    """

    def __init__(self, bucket_cap_mb: float | None = None, all_gathers: bool = True, reduce_scatters: bool = True,
                 blocks: tuple[str, ...] = ()):
        self.bucket_cap_mb = bucket_cap_mb
        self.kinds = ("all_gather",) * all_gathers + ("reduce_scatter",) * reduce_scatters
        self.blocks = tuple(blocks)

    def __call__(self, graph: torch.fx.Graph) -> None:
        buckets = plan_buckets(graph, self.bucket_cap_mb, self.kinds, self.blocks)
        record_plan(ARTIFACT, [b.record() for b in buckets])
        for bucket in buckets:
            before = set(graph.nodes)
            if bucket.kind == "all_gather":
                # where the first gather of the bucket was, its inputs (casts, pads and views of
                # the shards) hoisted above it: every rank then issues the same collectives in
                # the same order, also when uneven shards give ranks different pad nodes
                _hoist_inputs(graph, bucket.nodes, before=bucket.nodes[0])
                merge_all_gathers(graph, bucket.nodes)
            else:  # after the last reduce-scatter, when every gradient of the bucket is ready
                merge_reduce_scatter_bucket(graph, bucket.nodes, mode=BUCKET_MODE)
            for node in graph.nodes:  # the merged nodes carry no module path: keep their block
                if node not in before:
                    node.meta[BLOCK_META] = bucket.block

    def uuid(self) -> bytes:
        return get_hash_for_files((__file__, fx_utils.__file__), extra=repr((self.bucket_cap_mb, self.kinds, self.blocks)))
