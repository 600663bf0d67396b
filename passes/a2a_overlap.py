"""Overlap the expert all-to-alls with the shared experts' compute.

In a MoE layer the routed experts' tokens travel by all-to-all (dispatch, then combine), while
the shared experts run on the local tokens and depend on neither. As traced, the shared experts
come after the combine in forward and before both all-to-alls' gradients in backward, so every
all-to-all is waited on at once. This post-grad pass splits the shared experts' work between
the layer's all-to-alls and places each part between an all-to-all's start and its wait.
Forward, on 8 ranks at FSDP4 x EP2 (grouped_mm on GPU, bmm on CPU)::

    a2a(dispatch) wait  mm mm mm(routed)  a2a(combine) wait  ag ag ag  mm mm mm(shared)
    ->  a2a(dispatch) ag ag ag mm mm(shared) wait  mm mm mm(routed)  a2a(combine) mm(shared) wait

Backward mirrors it: the combine's gradient all-to-all overlaps the first half of the shared
experts' backward, the dispatch's gradient all-to-all the rest (with their reduce-scatters).

The split: the shared experts' matmuls, in graph order, are cut into one contiguous chunk per
floating-point all-to-all of the layer, earlier chunks taking the extra one (forward: gate and
up projections with the dispatch, the down projection with the combine). A node between two
matmuls goes with the later one; nodes after the last matmul go with the last chunk. A node that
depends on an all-to-all, or that one depends on, never moves. Only the order changes, through
:func:`fx_utils.reorder`, so every data dependency holds, and each process group's sequence
of collectives stays as it was. The matmuls are then pinned between the all-to-all's
start and its wait (:func:`fx_utils.pin_after`): from FX order alone, Inductor's GPU scheduler
moved them out of the window again in backward. The plan (per layer: each all-to-all and the
matmuls placed under it) is written to the structured trace as ``simplefsdp_a2a_overlap``.

Graphs whose collectives run on gloo are left as they are, like :mod:`.fsdp_prefetch` does:
there every collective is waited on before the next starts (:mod:`.gloo_one_in_flight`).
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from simplefsdp.passes import fx_utils
from simplefsdp.passes.fx_utils import module_path, op_name, pin_after, record_plan, reorder, waits_of
from simplefsdp.passes.ops import MATMULS

ARTIFACT = "simplefsdp_a2a_overlap"


def _floating_all_to_all(node: torch.fx.Node) -> bool:
    return op_name(node) == "all_to_all_single" and node.meta["val"].dtype.is_floating_point


def _closure(nodes, step) -> set[torch.fx.Node]:
    """``nodes`` and everything reachable from them by ``step`` (inputs or users)."""
    seen, stack = set(), list(nodes)
    while stack:
        node = stack.pop()
        if node not in seen:
            seen.add(node)
            stack.extend(step(node))
    return seen


def _chunks(nodes: list[torch.fx.Node], parts: int) -> list[list[torch.fx.Node]]:
    """Cut ``nodes`` (graph order) into ``parts`` runs with near-equal matmul counts."""
    matmuls = [n for n in nodes if op_name(n) in MATMULS]
    if not matmuls:
        return [nodes] + [[] for _ in range(parts - 1)]
    sizes = [len(matmuls) // parts + (i < len(matmuls) % parts) for i in range(parts)]
    ends, total = [], 0  # the last matmul of each chunk
    for size in sizes:
        total += size
        ends.append(matmuls[total - 1] if size else None)
    out, chunk = [[] for _ in range(parts)], 0
    for node in nodes:
        out[chunk].append(node)
        while chunk < parts - 1 and node is ends[chunk]:
            chunk += 1
        while chunk < parts - 1 and ends[chunk] is None:  # an empty chunk: skip it
            chunk += 1
    return out


class AllToAllOverlap(CustomGraphPass):
    """Place shared-expert compute between each expert all-to-all's start and its wait.

    ``shared`` names the shared-experts submodule of a MoE layer, whose routed experts are the
    sibling module that issues the all-to-alls.
    """

    def __init__(self, shared: str = "shared_experts"):
        self.shared = shared

    def _layers(self, graph: torch.fx.Graph):
        """Per MoE layer path: its floating all-to-alls and its shared-expert nodes, in order."""
        all_to_alls, shared = defaultdict(list), defaultdict(list)
        for node in graph.nodes:
            parts = module_path(node).split(".")
            if _floating_all_to_all(node):
                all_to_alls[".".join(parts[:-1])].append(node)
            elif self.shared in parts and node.op == "call_function":
                shared[".".join(parts[: parts.index(self.shared)])].append(node)
        return [(layer, all_to_alls[layer], shared[layer]) for layer in all_to_alls if shared[layer]]

    def __call__(self, graph: torch.fx.Graph) -> None:
        if fx_utils.runs_on_gloo(graph):
            return
        position = {n: i for i, n in enumerate(graph.nodes)}
        keys, plan, windows = {}, [], []
        for layer, starts, shared in self._layers(graph):
            linked = _closure(starts, lambda n: n.all_input_nodes) | _closure(starts, lambda n: n.users)
            movable = [n for n in shared if n not in linked]
            record = {"layer": layer, "all_to_alls": []}
            for start, chunk in zip(starts, _chunks(movable, len(starts))):
                waits = waits_of(start)
                if not waits:
                    continue
                wait = waits[0]
                for i, node in enumerate(chunk):  # just before the wait, in their own order
                    keys[node] = (position[wait], -1, i)
                matmuls = [n for n in chunk if op_name(n) in MATMULS]
                windows.append((start, wait, matmuls))
                record["all_to_alls"].append({"all_to_all": start.name, "wait": wait.name, "matmuls": matmuls})
            plan.append(record)
        if keys:
            reorder(graph, keys)
        # a matmul whose inputs are only ready after the wait stays there; pin those that made it
        position = {n: i for i, n in enumerate(graph.nodes)}
        pins, wait_pins = {}, {}
        for start, wait, matmuls in windows:
            inside = [m for m in matmuls if position[start] < position[m] < position[wait]]
            pins.update({m: [start] for m in inside})
            if inside:
                wait_pins[wait] = inside
        for record in plan:
            for window in record["all_to_alls"]:
                window["overlapped_matmuls"] = [m.name for m in window.pop("matmuls") if m in pins]
        record_plan(ARTIFACT, plan)
        pin_after(graph, {**pins, **wait_pins})  # matmuls first: the waits then refer to their pinned form

    def uuid(self) -> bytes:
        return get_hash_for_files((__file__, fx_utils.__file__), extra=repr(self.shared))
