"""While torch compiles, cache keys name a DeviceMesh alike in every process, and AOTAutograd may
cache graphs holding an autograd.Function (``simplefsdp.compile_cache``); after it, neither.

Another process hashes the mesh's dim names differently (``PYTHONHASHSEED``), so it pickles
another ``_hash``; here another ``_hash`` stands in for another process. The end-to-end check,
a second 4-rank launch hitting every cache, is ``test_ep_layout_runs_twice_from_one_shared_cache_dir``
(slow).
"""

from __future__ import annotations

import copyreg

import torch
from torch._inductor.codecache import FxGraphCachePickler
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate

from simplefsdp import compile_cache, simple_fsdp
from simplefsdp.models.llama import FeedForward
from tests import training as T


def _key_bytes(mesh: DeviceMesh, fake_hash: int) -> bytes:
    mesh._hash = fake_hash
    return FxGraphCachePickler(torch.fx.GraphModule(torch.nn.Module(), torch.fx.Graph())).dumps(mesh)


def test_a_mesh_pickles_into_cache_keys_without_its_process_hash(fake_world):
    torch._dynamo.reset()  # clears Dynamo's callbacks: simple_fsdp registers ours again
    mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp_replicate", "dp_shard"))
    simple_fsdp(T.build_model(), mesh)
    sub = mesh["dp_shard"]
    seen = {}

    def backend(gm, example_inputs):  # runs while torch compiles, as the cache keys are computed
        seen["keys"] = {_key_bytes(sub, h) for h in (1, 2)}
        seen["root_keys"] = {_key_bytes(mesh, h) for h in (1, 2)}
        seen["allow"] = torch._functorch.config.autograd_cache_allow_custom_autograd_functions
        return gm

    assert not torch._functorch.config.autograd_cache_allow_custom_autograd_functions  # torch's default
    torch.compile(lambda x: x + 1, backend=backend)(torch.ones(2))
    assert len(seen["keys"]) == 1 and len(seen["root_keys"]) == 1 and seen["allow"] is True
    # only while torch compiles
    assert DeviceMesh not in copyreg.dispatch_table
    assert not torch._functorch.config.autograd_cache_allow_custom_autograd_functions
    assert len({_key_bytes(sub, h) for h in (1, 2)}) == 2  # what pickling outside a compile does
    torch._dynamo.reset()


def _dynamo_style_to_local(grad_placements, extra=None):
    """A closure shaped as torch 2.11's Dynamo makes for ``DTensor.to_local`` (same qualified
    name, same captured variable names); ``extra``, when given, is captured too."""
    args_as_value, kwargs_as_value = [], {"grad_placements": grad_placements}

    def to_local_fn_with_prim_types(x):
        assert extra is None or extra
        return x.to_local(*args_as_value, **kwargs_as_value)

    to_local_fn_with_prim_types.__qualname__ = "TensorVariable.method_to_local.<locals>.to_local_fn_with_prim_types"
    to_local_fn_with_prim_types.__module__ = "torch._dynamo.variables.tensor"
    return to_local_fn_with_prim_types


def _graph_calling(closure) -> torch.fx.GraphModule:
    graph = torch.fx.Graph()
    graph.output(graph.call_function(closure, (graph.placeholder("x"),)))
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def _cacheable(gm: torch.fx.GraphModule) -> bool:
    from torch._functorch._aot_autograd.autograd_cache import BypassAOTAutogradCache, check_cacheable

    try:
        check_cacheable(gm)
        return True
    except BypassAOTAutogradCache:
        return False


def test_dynamo_dtensor_closures_become_keyed_calls_while_torch_compiles(fake_world, monkeypatch):
    """torch 2.11's Dynamo puts ``to_local`` (and ``from_local``, ``redistribute``) into the graph
    as closures, which AOTAutograd cannot key, so it bypassed its cache for every graph with a
    gather. While torch compiles, the pre-grad pass rewrites them into ``dtensor_call`` with a key
    naming what they captured; the graph is then cacheable, and two closures that differ only in a
    captured placement get different keys. Here a closure shaped as Dynamo's stands in (torch
    2.13's Dynamo makes none)."""
    from torch._inductor import config as inductor

    monkeypatch.setattr(compile_cache, "_dynamo_makes_dtensor_closures", lambda: True)
    graphs = {op: _graph_calling(_dynamo_style_to_local((Partial(op),))) for op in ("avg", "sum")}
    odd = _graph_calling(_dynamo_style_to_local((Partial("avg"),), extra=object()))  # the key can't name it
    assert not any(map(_cacheable, graphs.values()))
    user_pass_seen = []
    monkeypatch.setattr(inductor, "pre_grad_custom_pass", user_pass_seen.append)
    marked_before = inductor.unsafe_marked_cacheable_functions
    compile_cache._on_compile_start(None)
    try:
        for gm in (*graphs.values(), odd):
            inductor.pre_grad_custom_pass(gm.graph)
            gm.recompile()
        assert all(map(_cacheable, graphs.values())) and not _cacheable(odd)
    finally:
        compile_cache._on_compile_end(None)
    assert len(user_pass_seen) == 3  # a pass already set still runs, after ours
    # after the compile, torch's settings are as they were
    assert inductor.pre_grad_custom_pass == user_pass_seen.append
    assert inductor.unsafe_marked_cacheable_functions == marked_before
    (avg_call,), (sum_call,) = ([n for n in gm.graph.nodes if n.op == "call_function"] for gm in graphs.values())
    assert avg_call.target is sum_call.target is compile_cache.dtensor_call
    assert "Partial(avg)" in avg_call.args[0] and "Partial(sum)" in sum_call.args[0]
    assert avg_call.args[0] != sum_call.args[0]
    assert "dtensor_call" not in odd.code
    # the call runs the closure: the local tensor, its gradient declared Partial
    mesh = init_device_mesh("cpu", (8,), mesh_dim_names=("dp_shard",))
    param = DTensor.from_local(torch.ones(2, requires_grad=True), mesh, (Replicate(),), run_check=False)
    local = graphs["sum"](param)
    assert type(local) is torch.Tensor and local.tolist() == [1.0, 1.0]


def test_compiled_gathers_leave_the_graph_cacheable(fake_world):
    """The Dynamo graph of a compiled gather, after the pre-grad pass Inductor would run, passes
    AOTAutograd's cache check (on torch 2.11 only because of the rewrite above)."""
    from torch._inductor import config as inductor

    verdicts = []

    def backend(gm, example_inputs):  # what compile_fx does before AOTAutograd keys the graph
        for module in gm.modules():
            if isinstance(module, torch.fx.GraphModule) and inductor.pre_grad_custom_pass is not None:
                inductor.pre_grad_custom_pass(module.graph)
                module.recompile()
        verdicts.extend(_cacheable(module) for module in gm.modules() if isinstance(module, torch.fx.GraphModule))
        return gm

    torch._dynamo.reset()
    model = simple_fsdp(FeedForward(16, 32), init_device_mesh("cpu", (8,), mesh_dim_names=("dp_shard",)))
    torch.compile(model, backend=backend, fullgraph=True)(torch.randn(4, 16))
    torch._dynamo.reset()
    assert verdicts and all(verdicts), verdicts
