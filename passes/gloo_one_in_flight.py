"""Gloo guard: on gloo process groups, at most one functional collective in flight at a time.

On torch 2.13 (CPU, gloo), two or more ``_c10d_functional`` collectives in flight at once corrupt
the heap now and then (a malloc abort, a segfault, or a peer's "Connection reset by peer"); one in
flight never does, nor do the same gathers through the c10d async API.
``benchmarks/gloo_inflight_repro.py`` reproduces it without a compiler, and its results file
holds the crash counts.

So this pass runs last, on every graph, and only touches collectives on gloo groups (the fake
group of the graph tests, and NCCL, are left alone). Walking the graph in order, each gloo
collective is preceded by the wait of the one before it: that wait moves up to just before it
(it only reads its own collective's result, so it can), and Inductor is told to keep the pair in
that order (``control_deps``). Compute placed between a collective and its wait stays there.
Before, after::

    ag0 = all_gather(w0); ag1 = all_gather(w1); mm(x, ...); wait(ag0); wait(ag1)
    ag0 = all_gather(w0); wait(ag0); ag1 = all_gather(w1); mm(x, ...); wait(ag1)

Only waits move, never a collective, so the result is the same to the bit. With one collective
in flight, prefetching gains nothing on gloo, so :mod:`.fsdp_prefetch` and :mod:`.a2a_overlap`
leave gloo graphs alone. The crash is torch's; this only keeps CPU runs clear of it.
"""

from __future__ import annotations

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from simplefsdp.passes.fx_utils import collective_group, is_gloo, pin_after, record_plan, waits_of


class GlooOneInFlight(CustomGraphPass):
    def __call__(self, graph: torch.fx.Graph) -> None:
        previous_waits: list[torch.fx.Node] = []
        after: dict[torch.fx.Node, list[torch.fx.Node]] = {}
        moved = []
        position = {node: i for i, node in enumerate(graph.nodes)}
        for node in list(graph.nodes):
            group = collective_group(node)
            if group is None or not is_gloo(group):
                continue
            for wait in previous_waits:
                if position[wait] > position[node]:
                    node.prepend(wait)
                    moved.append(wait.name)
            if previous_waits:
                after[node] = previous_waits
            previous_waits = waits_of(node)
        pin_after(graph, after)
        if after:
            record_plan("simplefsdp_gloo_one_in_flight", {"ordered_after_previous_wait": [n.name for n in after], "waits_moved_up": moved})

    def uuid(self) -> str:
        return get_hash_for_files((__file__,))
