"""Mixture of experts with expert parallelism: parity on CPU ranks, graph structure, errors.

On 4 gloo ranks, FSDP x EP (``dp_shard=4`` split into ``edp=2 x ep=2``), HSDP x EP, FSDP x TP x EP
and HSDP x TP x EP train like one process on the same global batch, eager and compiled with
``fullgraph=True`` (no graph break: the all-to-all split sizes are traced as unbacked sizes),
with and without activation checkpointing; without TP they also match FSDP2 bitwise.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from simplefsdp import simple_fsdp
from simplefsdp.baselines.fsdp2 import ShardPlacementResult, fsdp2
from simplefsdp.models.llama import cross_entropy_loss
from simplefsdp.models.moe import MoEConfig, SharedExperts, grouped_swiglu
from simplefsdp.train.launch import run_ranks
from tests import training as T
from tests.graphs import captured_graphs

# 8 experts over edp=2 x ep=2: FSDP shards the expert dim (Shard(0) on edp)
MOE = MoEConfig(**dataclasses.asdict(T.CFG), num_experts=8, top_k=2, expert_dim=32)
# 2 experts over edp=2 x ep=2: too few experts to split again, FSDP shards dim 1; softmax router
MOE_FEW = dataclasses.replace(MOE, num_experts=2, top_k=1, score_func="softmax")
CONFIGS = {"moe": MOE, "moe_few_experts": MOE_FEW}

LOSS_ATOL = 1e-5
# AdamW moves near-zero-gradient elements by up to lr per step, which turns rounding differences
# (dense layer 0's MLP sees the largest) into parameter differences far above the loss's
PARAM_ATOL = 2e-3

RUNS = {  # name -> (config, mesh shape, dim names, compiled, activation checkpointing)
    "fsdp4xep2/eager": ("moe", (4,), ("dp_shard",), False, None),
    "fsdp4xep2/few_experts/eager": ("moe_few_experts", (4,), ("dp_shard",), False, None),
    "hsdp2x2xep2/eager": ("moe", (2, 2), ("dp_replicate", "dp_shard"), False, None),
    "fsdp4xep2/ac_full/eager": ("moe", (4,), ("dp_shard",), False, "full"),
    "fsdp4xep2/ac_selective/eager": ("moe", (4,), ("dp_shard",), False, "selective"),
    "fsdp2xtp2xep2/eager": ("moe", (2, 2), ("dp_shard", "tp"), False, None),
    "hsdp2x1xtp2xep2/eager": ("moe", (2, 1, 2), ("dp_replicate", "dp_shard", "tp"), False, None),
    "fsdp4xep2/compiled": ("moe", (4,), ("dp_shard",), True, None),
    "fsdp2xtp2xep2/compiled": ("moe", (2, 2), ("dp_shard", "tp"), True, None),
    "fsdp4xep2/ac_full/compiled": ("moe", (4,), ("dp_shard",), True, "full"),
    "fsdp2xtp2xep2/ac_selective/compiled": ("moe", (2, 2), ("dp_shard", "tp"), True, "selective"),
    "hsdp2x2xep2/compiled": ("moe", (2, 2), ("dp_replicate", "dp_shard"), True, None),
    "hsdp2x1xtp2xep2/ac_full/compiled": ("moe", (2, 1, 2), ("dp_replicate", "dp_shard", "tp"), True, "full"),
}
# each group is one launch of 4 ranks (one timeout each); compiled groups run with -m slow
# (a few minutes each on 2 cores; the compiled MoE graphs are in the default suite)
GROUPS = {
    "eager": [r for r in RUNS if r.endswith("/eager")],
    "compiled": ["fsdp2xtp2xep2/compiled", "fsdp4xep2/ac_full/compiled"],
    "compiled_more": ["fsdp4xep2/compiled", "hsdp2x2xep2/compiled"],
    "compiled_tp_ac": ["fsdp2xtp2xep2/ac_selective/compiled", "hsdp2x1xtp2xep2/ac_full/compiled"],
}
GROUP_OF = {run: group for group, runs in GROUPS.items() for run in runs}
assert GROUP_OF.keys() == RUNS.keys()


def _run_param(run: str, *more):
    """A test parameter for ``run`` (and ``more`` values), slow unless the run is in the eager launch."""
    return pytest.param(run, *more, marks=() if GROUP_OF[run] == "eager" else pytest.mark.slow)


@pytest.fixture(scope="module")
def references():
    out = {}
    for name, cfg in CONFIGS.items():
        model = T.build_model(cfg)
        out[name] = T.train(model, T.batches(cfg)), T.full_state(model)
    return out


@pytest.mark.ranks
@pytest.mark.parametrize("run", [_run_param(r) for r in RUNS])
def test_expert_parallel_matches_single_process(run, references):
    losses, state = T.launch_once(_body, 4, GROUP_OF[run])[run]
    ref_losses, ref_state = references[RUNS[run][0]]
    loss_diff, param_diff = T.report(run, losses, ref_losses, state, ref_state)
    assert loss_diff < LOSS_ATOL and param_diff < PARAM_ATOL
    assert losses[-1] < 0.7 * losses[0]


# the FSDP2 baseline's two forms (see simplefsdp/baselines/fsdp2.py): experts sharded inside their
# block's unit where torch has ShardPlacementResult (2.13), and as units of their own (2.11)
FSDP2_FORMS = {"blocks": True, "separate": False} if ShardPlacementResult is not None else {"separate": False}


def _fsdp2_key(run: str, form: str) -> str:
    cfg, shape, names, _, _ = RUNS[run]
    return f"fsdp2/{form}/{cfg}/{'x'.join(map(str, shape))}/{'.'.join(names)}"


# FSDP2's baseline has no tensor parallelism for experts: compare runs without a tp dim; eager
# runs with each form, compiled runs with the default one
FSDP2_RUNS = [
    (r, form) for r in RUNS if "tp" not in RUNS[r][2] for form in (FSDP2_FORMS if r.endswith("/eager") else list(FSDP2_FORMS)[:1])
]


@pytest.mark.ranks
@pytest.mark.parametrize("run,form", [_run_param(*rf) for rf in FSDP2_RUNS])
def test_expert_parallel_matches_fsdp2(run, form):
    """Eager runs (with or without checkpointing) are bitwise equal to FSDP2; compiled runs close."""
    losses, state = T.launch_once(_body, 4, GROUP_OF[run])[run]
    fsdp2_losses, fsdp2_state = T.launch_once(_body, 4, "eager")[_fsdp2_key(run, form)]
    # FSDP2's experts hold rank 0's ep slice: compare those rows of ours
    ours = {k: v[: fsdp2_state[k].shape[0]] for k, v in state.items()}
    loss_diff, param_diff = T.report(f"{run} vs fsdp2", losses, fsdp2_losses, ours, fsdp2_state)
    if RUNS[run][3]:  # Inductor fuses and reorders floating-point work differently from eager
        assert loss_diff < LOSS_ATOL and param_diff < PARAM_ATOL
    else:
        assert losses == fsdp2_losses
        assert all(torch.equal(ours[k], fsdp2_state[k]) for k in ours)


def _moe_layer_graphs():
    """Forward and backward graph lines of one compiled MoE layer under FSDP4 x EP2.

    Runs on real gloo ranks with the tokens' own routing; on fake ranks the counts exchange returns
    made-up counts, which ``test_moe_graphs`` works around with a router bias.
    """
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp_shard",))
    torch._dynamo.reset()
    cfg = dataclasses.replace(MOE, n_layers=1, n_dense_layers=0)
    model = simple_fsdp(T.build_model(cfg).layers[0].feed_forward, mesh, ep=2)
    compiled = torch.compile(model, fullgraph=True)
    x = torch.randn(2, 8, cfg.dim, requires_grad=True)
    with captured_graphs(model) as graphs:
        compiled(x).sum().backward()
    return graphs


def _fsdp2_run(cfg, mesh, experts_in_blocks: bool):
    """FSDP2 with EP: losses, and its ep rank's experts / dense parameters as full tensors."""
    import torch.distributed as dist

    model = fsdp2(T.build_model(CONFIGS[cfg]), mesh, ep=2, experts_in_blocks=experts_in_blocks)
    losses = T.train(model, T.batches(CONFIGS[cfg]), dp_rank=dist.get_rank(), dp_size=dist.get_world_size())
    return losses, T.full_state(model)


def _body(group: str):
    out = {}
    for name in GROUPS[group]:
        cfg, shape, names, compiled, ac = RUNS[name]
        model, runner, dp_rank, dp_size = T.wrapped_run(CONFIGS[cfg], shape, names, 2, ac=ac, compiled=compiled)
        losses = T.train(runner, T.batches(CONFIGS[cfg]), dp_rank=dp_rank, dp_size=dp_size)
        out[name] = losses, T.full_state(model)
        for form, in_blocks in FSDP2_FORMS.items() if group == "eager" and "tp" not in names else ():
            if _fsdp2_key(name, form) not in out:
                out[_fsdp2_key(name, form)] = _fsdp2_run(cfg, init_device_mesh("cpu", shape, mesh_dim_names=names), in_blocks)
    return out


def test_shared_experts_compute_the_one_group_grouped_swiglu():
    """The shared experts' dense matmuls compute the SwiGLU of a one-group grouped matmul (their
    previous form): the same output and gradients in fp32."""
    torch.manual_seed(0)
    shared = SharedExperts(16, 24)
    x = torch.randn(2, 10, 16, requires_grad=True)
    out = shared(x.view(-1, 16))
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, (x, shared.w1, shared.w3, shared.w2), grad_out)
    ref_x, w1, w3, w2 = (t.detach().requires_grad_() for t in (x, shared.w1, shared.w3, shared.w2))
    ref = grouped_swiglu(ref_x.view(-1, 16), w1[None], w2[None], w3[None], torch.tensor([20], dtype=torch.int32))
    ref_grads = torch.autograd.grad(ref, (ref_x, w1, w3, w2), grad_out)
    # values up to about 16; the two sum their products in other orders (fp32 rounding: about 2e-6)
    for ours, theirs in zip((out, *grads), (ref, *ref_grads), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)


@pytest.mark.ranks
@pytest.mark.slow  # 4 ranks compiling; the default suite checks the same collectives on fake ranks (test_fsdp4_ep2)
def test_moe_layer_graph_uses_each_mesh():
    forward, backward = T.launch_once(_moe_layer_graphs, 4)
    collectives = [line for line in forward if "[" in line and not line.startswith("wait")]
    assert collectives == [
        "all_gather_into_tensor[dp_shard] float32",  # router gate
        "all_gather_into_tensor[edp] float32",  # routed experts w1, w2, w3, once for both chunks
        "all_gather_into_tensor[edp] float32",
        "all_gather_into_tensor[edp] float32",
        "all_to_all_single[tokens] int32",  # tokens per expert, of both chunks
        "all_to_all_single[tokens] float32",  # dispatch of chunk 0
        "all_to_all_single[tokens] float32",  # dispatch of chunk 1
        "all_to_all_single[tokens] float32",  # combine of chunk 0
        "all_to_all_single[tokens] float32",  # combine of chunk 1
        "all_gather_into_tensor[dp_shard] float32",  # shared experts w1, w3, w2
        "all_gather_into_tensor[dp_shard] float32",
        "all_gather_into_tensor[dp_shard] float32",
    ]
    reductions = sorted(line for line in backward if "avg" in line)
    assert reductions == ["reduce_scatter_tensor[dp_shard] avg float32"] * 4
    sums = [line for line in backward if " sum " in line]
    assert sums == ["reduce_scatter_tensor[edp] sum float32"] * 3
    # the counts exchange runs once, in forward; backward only moves gradients of token rows
    assert [line for line in backward if line.startswith("all_to_all")] == ["all_to_all_single[tokens] float32"] * 4


def _chunking_body(compiled: bool):
    """One step of FSDP4 x EP2 in 1 and in 2 token chunks: the loss and every full gradient."""
    from simplefsdp.train.data import rank_slice

    out = {}
    for chunks in (1, 2):
        model, runner, dp_rank, dp_size = T.wrapped_run(MOE, (4,), ("dp_shard",), 2, ep_chunks=chunks, compiled=compiled)
        tokens, labels = rank_slice(T.batches(MOE)[0], dp_rank, dp_size)
        loss = cross_entropy_loss(runner(tokens), labels)
        loss.backward()
        grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
        out[chunks] = loss.item(), grads
    return out


@pytest.mark.ranks
@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["eager", "compiled"])
def test_token_chunks_change_only_the_expert_weight_gradient_sums(compiled):
    """Each token's result does not depend on the chunking: the loss and every gradient but the
    routed experts' are bitwise equal with 1 and 2 chunks. The experts' weight gradients sum
    per chunk, then over chunks, so they agree to rounding only."""
    out = T.launch_once(_chunking_body, 4, compiled)
    (loss1, grads1), (loss2, grads2) = out[1], out[2]
    assert loss1 == loss2
    experts = {n for n in grads1 if ".experts." in n and ".shared_experts." not in n}
    assert experts and all(torch.equal(grads1[n], grads2[n]) for n in grads1 if n not in experts)
    for n in experts:
        torch.testing.assert_close(grads2[n], grads1[n], rtol=1e-5, atol=1e-7)
    assert any(not torch.equal(grads1[n], grads2[n]) for n in experts)  # the test sees the summation order


def _compiled_ep_losses():
    """Losses of 3 compiled steps, and this process's compile-cache counters."""
    from torch._dynamo.utils import counters

    model, runner, dp_rank, dp_size = T.wrapped_run(MOE, (4,), ("dp_shard",), 2, compiled=True)
    losses = T.train(runner, T.batches(MOE)[:3], dp_rank=dp_rank, dp_size=dp_size)
    seen = {**counters["aot_autograd"], **counters["inductor"]}
    return losses, {k: v for k, v in seen.items() if k.startswith(("autograd_cache_", "fxgraph_cache_"))}


@pytest.mark.ranks
@pytest.mark.slow
def test_ep_layout_runs_twice_from_one_shared_cache_dir(tmp_path, monkeypatch):
    """Ranks of different ep groups (ranks 0 and 2: groups {0, 1} and {2, 3}) share one cache dir.

    The second launch reads what the first wrote: every rank's AOTAutograd and Inductor graphs hit
    the cache, and nothing misses or bypasses (the meshes pickle into the keys alike in every
    process, and the expert gradients' ``autograd.Function`` may be cached while torch compiles:
    ``simplefsdp.compile_cache``). No rank may load another group's artifacts ("Could not resolve
    the process group registered under the name N" on torch 2.13).
    """
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    first = run_ranks(_compiled_ep_losses, 4)
    assert any(tmp_path.iterdir())  # the ranks compiled into the shared dir
    second = run_ranks(_compiled_ep_losses, 4)
    losses = [out[0] for out in first + second]
    assert all(loss == losses[0] for loss in losses)
    for rank, (_, seen) in enumerate(second):
        misses = {k: v for k, v in seen.items() if k.endswith(("_miss", "_bypass"))}
        assert seen.get("fxgraph_cache_hit") and seen.get("autograd_cache_hit") and not misses, (rank, seen)


def _expect_error(match, mesh_shape=(8,), names=("dp_shard",), ep=2, cfg=MOE, model=None):
    """The error, with the model untouched and no process group created (``tests.core.test_errors``)."""
    from tests.core.test_errors import expect_error

    model = model if model is not None else T.build_model(cfg)
    expect_error(match, model, init_device_mesh("cpu", mesh_shape, mesh_dim_names=names), ep=ep)


def test_num_experts_not_divisible_by_ep(fake_world):
    _expect_error(r"layers.1.feed_forward.experts: num_experts=2 is not divisible by ep=4", ep=4, cfg=MOE_FEW)


def test_a_router_parameter_inside_the_experts_is_refused_by_name(fake_world):
    model = T.build_model(MOE)
    experts = model.layers[1].feed_forward.experts
    experts.gate_weight = torch.nn.Parameter(torch.randn(MOE.num_experts, MOE.dim))  # [E, dim]: stacks like an expert
    _expect_error(r"layers\.1\.feed_forward\.experts\.gate_weight: a router parameter inside the routed-experts module", model=model)


def test_ep_must_divide_dp_shard(fake_world):
    _expect_error(r"ep=3 does not divide the dp_shard degree 8", ep=3)


def test_mesh_without_room_for_ep(fake_world):
    _expect_error(r"no room for ep=16: the dp_shard degree is 8", ep=16)
    _expect_error(r"ep=2 needs a 'dp_shard' mesh dim", names=("dp_replicate",))


def test_ep_without_experts(fake_world):
    _expect_error(r"ep=2 but the model has no routed experts", cfg=T.CFG)


def test_ep_must_divide_dp_shard_times_tp(fake_world):
    _expect_error(r"ep=3 does not divide the dp_shard x tp degree 8", ep=3, mesh_shape=(4, 2), names=("dp_shard", "tp"))


def test_split_sizes_read_under_compile_leave_the_graph_cacheable():
    """``host_ints`` under torch.compile gives ``tolist``'s values through nodes AOTAutograd's cache
    accepts; ``tolist`` itself makes it bypass the cache (torch 2.13), which is what this checks
    against, on the Dynamo graph each one traces."""
    from torch._functorch._aot_autograd.autograd_cache import BypassAOTAutogradCache, check_cacheable

    from simplefsdp.moe.token_dispatch import host_ints

    verdicts = {}

    def backend_for(name):
        def backend(gm, example_inputs):
            try:
                check_cacheable(gm)
                verdicts[name] = "cacheable"
            except BypassAOTAutogradCache as e:
                verdicts[name] = f"bypass: {e}"
            return gm
        return backend

    counts = torch.tensor([[3, 0, 5], [1, 2, 4]])
    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        for name, read in (("host_ints", host_ints), ("tolist", lambda t: t.tolist())):
            torch._dynamo.reset()
            got = torch.compile(lambda t: read(t * 1), backend=backend_for(name), fullgraph=True)(counts)
            assert got == [[3, 0, 5], [1, 2, 4]], name
    torch._dynamo.reset()
    assert verdicts["host_ints"] == "cacheable"
    assert verdicts["tolist"].startswith("bypass: Unsupported call_method target")
