"""The one table of the ops that the passes, the benchmarks and the tests look for in FX graphs.

``COLLECTIVES`` maps each functional collective (``_c10d_functional`` op name, in every form
Inductor's graphs carry: functional, ``_out`` after bucketing, in place after re-inplacing,
coalesced) to where its process-group argument sits, what kind of collective it is, and which side
carries the bytes it moves (its ``"out"``put for gathers, its ``"in"``put otherwise). ``MATMULS``
are the compute ops the scheduling passes move and the cost model counts as matmul FLOPs.
"""

from __future__ import annotations

from typing import NamedTuple


class Collective(NamedTuple):
    group_arg: int  # position of the process-group name among the op's arguments
    kind: str  # all_gather, reduce_scatter, all_reduce or all_to_all
    bytes_side: str  # "out": the result's bytes are what moves; "in": the first input's


COLLECTIVES: dict[str, Collective] = {
    "all_gather_into_tensor": Collective(2, "all_gather", "out"),
    "all_gather_into_tensor_out": Collective(2, "all_gather", "out"),
    "all_gather_single": Collective(2, "all_gather", "out"),
    "all_gather_into_tensor_coalesced": Collective(2, "all_gather", "out"),
    "reduce_scatter_tensor": Collective(3, "reduce_scatter", "in"),
    "reduce_scatter_tensor_out": Collective(3, "reduce_scatter", "in"),
    "reduce_scatter_single": Collective(3, "reduce_scatter", "in"),
    "reduce_scatter_tensor_coalesced": Collective(3, "reduce_scatter", "in"),
    "all_reduce": Collective(2, "all_reduce", "in"),
    "all_reduce_": Collective(2, "all_reduce", "in"),
    "all_to_all_single": Collective(3, "all_to_all", "in"),
}

MATMULS = frozenset({"mm", "addmm", "bmm", "baddbmm", "_grouped_mm"})
