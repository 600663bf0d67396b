"""Overlap the expert all-to-alls with routed-expert compute of other token chunks, and with
the shared experts.

A MoE layer with expert parallelism splits its tokens into chunks
(:mod:`simplefsdp.moe.token_dispatch`). Each chunk's rows travel to the experts by an
all-to-all (*incoming*: the dispatch in forward, the combine's gradient in backward), are
computed, and travel back by another (*outgoing*: the combine, the dispatch's gradient). This
post-grad pass schedules, per layer and with chunks taken in the order their incoming
all-to-alls run::

    forward, 2 chunks (d: dispatch, c: combine, E: routed experts, S: shared experts)
      d0 d1 S(1st half) wait(d0) E0 c0 wait(d1) E1 c1 wait(c0) S(2nd half) wait(c1)
      stream:  [d0][d1 ........][c0 .......][c1 .....]
      compute:  S......   E0.........  E1........  S.....
    backward mirrors it with the chunks reversed: c1' c0' S' E1' d1' E0' d0' S'

* each chunk's routed experts run under the all-to-alls in flight around them: the next
  chunk's incoming one (its start goes before the experts, its wait after them) and the
  previous chunk's outgoing one (started as soon as that chunk's rows are back, waited after);
* the shared experts, which need no all-to-all, fill the two windows that no routed compute
  can: the first chunk's incoming all-to-all and the last chunk's outgoing one. Their matmuls,
  in graph order, are cut into two runs with near-equal matmul counts, the first run taking
  the extra one. A node between two matmuls goes with the later one; nodes after the last
  matmul go with the last run. A node that depends on an all-to-all, or that one depends on,
  never moves. With one chunk this is the whole schedule.

Only the order changes, through :func:`fx_utils.reorder`, so every data dependency holds and
each process group's sequence of collectives stays as it was (the token all-to-alls have a group
of their own, so they move past FSDP's collectives freely). Compute placed under an all-to-all
is then pinned between its start and its wait (:func:`fx_utils.pin_after`): from FX order alone,
Inductor's GPU scheduler moves work out of the window again. The plan (per layer: each
all-to-all and the matmuls placed under it) is written to the structured trace as
``simplefsdp_a2a_overlap``.

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


def _users(node: torch.fx.Node):
    return node.users


def _inputs(node: torch.fx.Node):
    return node.all_input_nodes


def _halves(nodes: list[torch.fx.Node]) -> list[list[torch.fx.Node]]:
    """Cut ``nodes`` (graph order) into two runs with near-equal matmul counts, the first taking
    the extra one; a node goes with the next matmul, trailing nodes with the last run."""
    matmuls = [n for n in nodes if op_name(n) in MATMULS]
    if not matmuls:
        return [nodes, []]
    first = set(matmuls[: (len(matmuls) + 1) // 2])
    end = max(i for i, n in enumerate(nodes) if n in first)
    return [nodes[: end + 1], nodes[end + 1 :]]


class _Chunk:
    """One token chunk of a layer: its incoming and outgoing all-to-alls and the routed-expert
    matmuls between them that depend on no other chunk."""

    def __init__(self, incoming: torch.fx.Node, outgoing: torch.fx.Node | None):
        self.incoming, self.outgoing = incoming, outgoing
        self.matmuls: list[torch.fx.Node] = []


def _chunks(starts: list[torch.fx.Node], layer: str, position: dict[torch.fx.Node, int]) -> list[_Chunk]:
    """Pair a layer's floating all-to-alls (graph order) into chunks, in incoming order.

    An all-to-all is outgoing when an earlier one of the layer is among its inputs' ancestors;
    that one is its chunk's incoming all-to-all. A chunk's matmuls are those of the layer that
    depend on its incoming all-to-all's result, on no other chunk's, and not on its outgoing one,
    in graph order (``position``: each node's index).
    """
    ancestors = {a: _closure(a.all_input_nodes, _inputs) for a in starts}
    chunks: dict[torch.fx.Node, _Chunk] = {}
    for a in starts:
        sources = [b for b in chunks if b in ancestors[a]]
        if not sources:
            chunks[a] = _Chunk(a, None)
        elif len(sources) == 1 and chunks[sources[0]].outgoing is None:
            chunks[sources[0]].outgoing = a
    reached = {a: _closure(waits_of(a), _users) for a in starts}
    for incoming, chunk in chunks.items():
        others = set().union(*(reached[b] for b in chunks if b is not incoming))
        after = reached.get(chunk.outgoing, set())
        chunk.matmuls = sorted((  # not set order: the pins the pass writes are then the same in every run
            n for n in reached[incoming]
            if op_name(n) in MATMULS and n not in others and n not in after and module_path(n).startswith(layer)
        ), key=position.__getitem__)
    return list(chunks.values())


SHARED_EXPERTS = ("shared_experts", "shared_expert", "shared_expert_gate", "shared_mlp")


class AllToAllOverlap(CustomGraphPass):
    """Place routed-expert compute of one chunk under the all-to-alls of its neighbours, and
    shared-expert compute under the first and last all-to-all of each MoE layer.

    ``shared`` names the shared-experts submodules of a MoE layer, whose routed experts are the
    sibling module that issues the all-to-alls: by default this project's and Hugging Face's
    three forms (``shared_experts``; ``shared_expert`` with its sigmoid ``shared_expert_gate``;
    ``shared_mlp``).
    """

    def __init__(self, shared: tuple[str, ...] = SHARED_EXPERTS):
        self.shared = tuple(shared)

    def _layers(self, graph: torch.fx.Graph):
        """Per MoE layer path: its floating all-to-alls and its shared-expert nodes, in order."""
        all_to_alls, shared = defaultdict(list), defaultdict(list)
        for node in graph.nodes:
            parts = module_path(node).split(".")
            if _floating_all_to_all(node):
                all_to_alls[".".join(parts[:-1])].append(node)
            elif node.op == "call_function" and (name := next((p for p in parts if p in self.shared), None)):
                shared[".".join(parts[: parts.index(name)])].append(node)
        return [(layer, all_to_alls[layer], shared[layer]) for layer in all_to_alls]

    def __call__(self, graph: torch.fx.Graph) -> None:
        if fx_utils.runs_on_gloo(graph):
            return
        position = {n: i for i, n in enumerate(graph.nodes)}
        keys, plan, windows = {}, [], []  # windows: (start, wait, matmuls meant to run under it)

        # a node's default key is (position, position): (p, -1) sorts just before position p,
        # (p, p + 0.25) just after it, and (p, p + 0.5) after that
        def start_before(start: torch.fx.Node, anchor: int) -> None:
            """Start ``start`` (and what it needs that comes later) just before position ``anchor``."""
            for node in _closure([start], _inputs):
                if node.op != "placeholder" and position[node] > anchor:
                    keys[node] = (anchor, -2, position[node])

        def start_after(start: torch.fx.Node, anchor: int) -> None:
            """Start ``start`` as soon as it can after position ``anchor``."""
            for node in _closure([start], _inputs):
                if node.op != "placeholder" and position[node] > anchor:
                    keys[node] = (anchor, anchor + 0.25, position[node])

        for layer, starts, shared in self._layers(graph):
            chunks = [c for c in _chunks(starts, layer, position) if c.outgoing is not None and waits_of(c.incoming) and waits_of(c.outgoing)]
            if not chunks:
                continue
            record = {"layer": layer, "chunks": len(chunks)}
            first_wait = waits_of(chunks[0].incoming)[0]
            ends = [max((position[m] for m in c.matmuls), default=position[c.outgoing]) for c in chunks]
            for i, chunk in enumerate(chunks):
                start_after(chunk.outgoing, ends[i])  # as soon as the chunk's rows are back
                if not chunk.matmuls:
                    continue
                first, last = min(position[m] for m in chunk.matmuls), ends[i]
                neighbours = []  # in flight while this chunk's experts run
                if i + 1 < len(chunks):
                    neighbours.append(chunks[i + 1].incoming)
                    # the second chunk's starts before the shared experts fill the first's window
                    start_before(chunks[i + 1].incoming, first if i else min(first, position[first_wait]))
                if i > 0:
                    neighbours.append(chunks[i - 1].outgoing)
                for start in neighbours:
                    wait = waits_of(start)[0]
                    keys[wait] = (last, last + 0.5, position[wait])  # just after the last matmul
                    windows.append((start, wait, chunk.matmuls))
            linked = _closure(starts, _inputs) | _closure(starts, _users)
            movable = [n for n in shared if n not in linked]
            fillers = (chunks[0].incoming, chunks[-1].outgoing)
            for start, run in zip(fillers, _halves(movable)):
                wait = waits_of(start)[0]
                for i, node in enumerate(run):  # just before the wait, in their own order
                    keys[node] = (position[wait], -1, i)
                windows.append((start, wait, [n for n in run if op_name(n) in MATMULS]))
            record["all_to_alls"] = [{"all_to_all": a.name, "wait": waits_of(a)[0].name} for a in starts if waits_of(a)]
            plan.append(record)
        if keys:
            reorder(graph, keys)
        # compute whose inputs are only ready after the wait stays there; pin what made it inside
        position = {n: i for i, n in enumerate(graph.nodes)}
        pins: dict[torch.fx.Node, list[torch.fx.Node]] = defaultdict(list)
        wait_pins: dict[torch.fx.Node, list[torch.fx.Node]] = defaultdict(list)
        under: dict[str, list[str]] = defaultdict(list)
        for start, wait, matmuls in windows:
            inside = [m for m in matmuls if position[start] < position[m] < position[wait]]
            for m in inside:
                pins[m].append(start)
                wait_pins[wait].append(m)
                under[start.name].append(m.name)
        for record in plan:
            for window in record["all_to_alls"]:
                window["overlapped_matmuls"] = under.get(window["all_to_all"], [])
        record_plan(ARTIFACT, plan)
        pin_after(graph, {**pins, **wait_pins})  # matmuls first: the waits then refer to their pinned form

    def uuid(self) -> bytes:
        return get_hash_for_files((__file__, fx_utils.__file__), extra=repr(self.shared))
