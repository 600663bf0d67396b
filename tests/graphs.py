"""Read the collectives and matmuls out of the graphs that Inductor compiles.

:func:`captured_graphs` installs a post-grad pass that records, for every graph Inductor lowers
(forward first, then backward), the ordered list of communication and matmul nodes, with process
groups shown by mesh dim name instead of the run-dependent group number. Caches are disabled while
it is active, since a cache hit skips the pass. Inductor stops after that pass unless asked to lower
the graphs (:func:`post_grad_only`): graph tests then build no kernels.
"""

from __future__ import annotations

import contextlib
import functools
import unittest.mock

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

from simplefsdp.param_access import WRAPPED_ATTR
from simplefsdp.passes import SimpleFSDPPasses
from simplefsdp.passes.fx_utils import pinned_call, waited_collective
from simplefsdp.passes.ops import COLLECTIVES, MATMULS


def _dtype(node) -> str:
    if isinstance(node, (list, tuple)):  # the inputs of a coalesced collective
        return "|".join(sorted({_dtype(n) for n in node}))
    val = node.meta.get("val")
    return str(val.dtype).removeprefix("torch.") if isinstance(val, torch.Tensor) else "?"


def describe(graph: torch.fx.Graph, group_names: dict[str, str]) -> list[str]:
    """One line per collective, wait and matmul in graph order: ``op[group] dtype``,
    ``wait op[group]`` (what it waits for), ``mm dtype``."""
    lines, started = [], {}
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        call = pinned_call(node)  # the op itself, or for a node a pass pinned in order, the op it wraps
        if not hasattr(call.target, "_opname"):
            continue
        name = call.target._opname
        if name in COLLECTIVES:
            group = call.args[COLLECTIVES[name].group_arg]
            extra = f" {call.args[1]}" if name.startswith(("reduce_scatter", "all_reduce")) else ""
            shown = name.rstrip("_").removesuffix("_out")  # in-place, out= and functional forms read alike
            started[node] = f"{shown}[{group_names.get(group, group)}]"
            lines.append(f"{started[node]}{extra} {_dtype(call.args[0])}")
        elif name == "wait_tensor":
            lines.append(f"wait {started.get(waited_collective(node, call), '?')}")
        elif name in MATMULS:
            lines.append(f"{name} {_dtype(node)}")
    return lines


class _Capture(CustomGraphPass):
    def __init__(self, group_names: dict[str, str], passes):
        self.group_names = group_names
        self.passes = passes
        self.graphs: list[list[str]] = []

    def __call__(self, graph: torch.fx.Graph) -> None:
        for graph_pass in self.passes:
            graph_pass(graph)
        self.graphs.append(describe(graph, self.group_names))

    def uuid(self):
        # no identity to cache by: torch then bypasses its FX-graph and AOTAutograd caches, so
        # the passes run on every compile, while the compiled kernels' caches stay warm (so no
        # force_disable_caches, which would compile every kernel again in a fresh cache dir)
        return None


def group_names(source) -> dict[str, str]:
    """Process-group name -> mesh dim name, for a DeviceMesh or a model wrapped by simple_fsdp
    (whose token all-to-alls' group shows as ``tokens``)."""
    tokens = {}  # the token all-to-alls' own group
    if isinstance(source, torch.nn.Module):
        meshes = []
        for module in source.modules():
            wrapped = getattr(module, WRAPPED_ATTR, None)
            for gather in wrapped.gathers.values() if wrapped is not None else ():
                meshes.extend(mesh for mesh, _ in gather.steps)
            dispatch = getattr(module, "expert_parallel", None)
            if dispatch is not None:
                meshes.extend(m for m in (dispatch.ep_mesh, dispatch.tp_mesh) if m is not None)
                tokens[dispatch.group.group_name] = "tokens"
    else:
        meshes = [source[name] for name in source.mesh_dim_names] if source.mesh_dim_names else [source]
    return {m.get_group().group_name: (m.mesh_dim_names or ("dp",))[0] for m in meshes} | tokens


def _post_grad_graph_only(gm, example_inputs, *, is_inference=False, **kwargs):
    """Inductor's inner compile up to its post-grad passes (the custom one included), no further:
    the compiled function runs the post-grad graph op by op."""
    from torch._functorch.aot_autograd import make_boxed_func
    from torch._inductor.compile_fx import _recursive_post_grad_passes, fake_tensor_prop, view_to_reshape
    from torch._inductor.virtualized import V

    view_to_reshape(gm)  # the steps compile_fx_inner takes before its post-grad passes
    with torch.no_grad():
        fake_mode = fake_tensor_prop(gm, example_inputs)
    with V.set_fake_mode(fake_mode):
        _recursive_post_grad_passes(gm, is_inference=is_inference)
    gm.recompile()
    return make_boxed_func(gm.forward)


@contextlib.contextmanager
def post_grad_only():
    """While active, Inductor compiles graphs only as far as its post-grad passes: no kernel is
    generated or built (most of a small graph test's time on CPU), and the compiled model runs its
    post-grad graphs op by op. Everything before (Dynamo, AOTAutograd, the partitioner, the joint
    and post-grad passes) is Inductor's own, so the graphs a post-grad pass sees are those of a full
    compile (``test_graphs_are_those_of_a_full_compile``); what the run computes is not checked."""
    from torch._inductor import compile_fx

    graph_only = functools.partial(compile_fx.compile_fx, inner_compile=_post_grad_graph_only)
    with unittest.mock.patch.object(compile_fx, "compile_fx", graph_only):  # looked up by the "inductor" backend
        yield


@contextlib.contextmanager
def captured_graphs(source, passes=(), lower=False):
    """Yield a list that fills with one description per compiled graph (forward, then backward).

    ``source`` (a DeviceMesh, or a wrapped model) names the process groups; ``passes`` run on
    each graph before it is described. Unless ``lower``, Inductor stops there
    (:func:`post_grad_only`).
    """
    capture = _Capture(group_names(source), passes)
    chain = SimpleFSDPPasses(user_pass=capture)
    chain.passes = []  # only the passes given to the capture run, in its own order
    with torch._inductor.config.patch(post_grad_custom_post_pass=chain), (
            contextlib.nullcontext() if lower else post_grad_only()):
        yield capture.graphs


MATMUL_PREFIXES = ("mm ", "addmm ", "bmm ", "_grouped_mm ")


def collectives(lines: list[str]) -> str:
    """The collectives of a described graph in order, one per line (no waits, no matmuls): each
    process group's sequence, the order every rank must issue."""
    return "\n".join(line for line in lines if "[" in line and not line.startswith("wait"))


def positions(lines: list[str], prefixes) -> list[int]:
    """Indices of the lines that start with any of ``prefixes``."""
    return [i for i, line in enumerate(lines) if line.startswith(prefixes)]


def assert_each_weight_gathered_before_use(forward: list[str]) -> None:
    """Every matmul in a forward of gathered weights follows the wait of one more all-gather."""
    waits = positions(forward, "wait all_gather")
    for n, mm in enumerate(positions(forward, MATMUL_PREFIXES)):
        assert sum(w < mm for w in waits) > n, f"matmul {n} (line {mm}) runs before its weight's all-gather"


def spread_routing(model: torch.nn.Module, ep: int) -> None:
    """A router bias on one expert per ep rank, so tokens go to every ep rank: under the fake
    group every router score ties (an all-gather repeats the local shard) and would send every
    token to the first experts."""
    from simplefsdp.models.moe import MoE

    for module in model.modules():
        if isinstance(module, MoE):
            module.router.expert_bias[:: module.router.num_experts // ep] = 1.0
