"""``simplefsdp.precompile``: the compiled model saved by one process and loaded by the next,
without tracing, with the numerics of ``torch.compile``.

The single-process tests run a one-rank gloo world (the mechanism: files, guards, source checks,
torch's settings afterwards); those that compile the model (against torch.compile, bitwise) are in
the slow suite with the launch test, which runs FSDP2×EP2 on 2 gloo ranks twice, the second launch
loading what the first saved on every rank. The default suite keeps what compiles little.
"""

from __future__ import annotations

import copyreg
import dataclasses
import importlib
import os
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist
from torch._dynamo.utils import counters
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from simplefsdp import compile_blocks_once, compile_options, simple_fsdp
from simplefsdp.compile_cache import on_each_compile
from simplefsdp.models.llama import cross_entropy_loss
from simplefsdp.models.moe import MoEConfig
from simplefsdp.precompile import precompile
from simplefsdp.train.data import rank_slice
from simplefsdp.train.launch import run_ranks
from tests import training as T

SMALL = dataclasses.replace(T.CFG, n_layers=1)


@pytest.fixture
def one_rank(tmp_path):
    """A one-rank gloo world, on one thread (the compiled embedding gradient's scatter-add sums
    in another order from run to run on several), as launched ranks run."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,), mesh_dim_names=("dp_shard",))
    dist.destroy_process_group()
    torch.set_num_threads(threads)


def _step_grads(runner, model, batch):
    tokens, labels = batch
    cross_entropy_loss(runner(tokens), labels).backward()
    grads = {n: p.grad.full_tensor().clone() for n, p in model.named_parameters()}
    model.zero_grad()
    return grads


def _wrapped(mesh):
    torch._dynamo.reset()
    return simple_fsdp(T.build_model(SMALL), mesh)


def _frames_traced() -> int:
    return counters["frames"]["total"]


@pytest.mark.slow  # compiles the model three times: 35-50 s cold on CI's 2 cores
def test_a_precompiled_model_loads_without_tracing_and_computes_like_torch_compile(one_rank, tmp_path):
    batch = T.batches(SMALL)[0]
    aot_compile_before = torch._dynamo.config.enable_aot_compile
    model = _wrapped(one_rank)
    expected = _step_grads(torch.compile(model, fullgraph=True, options=compile_options()), model, batch)
    brackets = []  # Dynamo's compile callbacks (SimpleFSDP's compile settings) run around the AOT compile
    on_each_compile(lambda _: brackets.append("start"), lambda _: brackets.append("end"))

    first = precompile(model, str(tmp_path / "compiled"), options=compile_options())
    grads = _step_grads(first, model, batch)
    assert first.origin == "compiled" and brackets == ["start", "end"]
    for name, grad in grads.items():
        assert torch.equal(grad, expected[name]), name
    assert len(list((tmp_path / "compiled").iterdir())) == 1

    # the same model (a new one here would hold other forward-hook ids, which the saved guards
    # check: a new process registers the same ids; the slow launch test loads there)
    traced = _frames_traced()
    second = precompile(model, str(tmp_path / "compiled"), options=compile_options())
    grads = _step_grads(second, model, batch)
    assert second.origin == "loaded" and _frames_traced() == traced  # Dynamo traced nothing
    for name, grad in grads.items():
        assert torch.equal(grad, expected[name]), name
    # what precompile sets while torch compiles is put back
    assert torch._dynamo.config.enable_aot_compile == aot_compile_before
    assert DeviceMesh not in copyreg.dispatch_table
    assert not torch._functorch.config.autograd_cache_allow_custom_autograd_functions

    # a call the saved guards refuse runs through torch.compile
    model.norm.eps = 0.5  # read while tracing: guarded, not in the file's name
    with pytest.warns(UserWarning, match="guards do not hold"):
        grads = _step_grads(second, model, batch)
    assert second.origin == "torch.compile"
    expected = _step_grads(torch.compile(model, fullgraph=True, options=compile_options()), model, batch)
    for name, grad in grads.items():
        assert torch.equal(grad, expected[name]), name
    torch._dynamo.reset()


@pytest.mark.slow  # compiles the model three times: 35-50 s cold on CI's 2 cores
def test_a_model_torch_cannot_save_runs_through_torch_compile(one_rank, tmp_path):
    """Blocks compiled once: torch 2.13 cannot serialise a guard of their regions (DICT_VERSION)."""
    batch = T.batches(SMALL)[0]
    model = compile_blocks_once(_wrapped(one_rank))
    runner = precompile(model, str(tmp_path / "compiled"), options=compile_options(blocks_once=True))
    with pytest.warns(UserWarning, match="torch cannot save this compiled function"):
        grads = _step_grads(runner, model, batch)
    assert runner.origin == "torch.compile" and not (tmp_path / "compiled").exists()
    expected = _step_grads(torch.compile(model, fullgraph=True, options=compile_options(blocks_once=True)), model, batch)
    for name, grad in grads.items():
        assert torch.equal(grad, expected[name]), name
    torch._dynamo.reset()


def test_other_options_or_inputs_get_a_file_of_their_own(one_rank, tmp_path):
    model = _wrapped(one_rank)
    tokens = T.batches(SMALL)[0][0]
    runs = [precompile(model, str(tmp_path), options=compile_options()),
            precompile(model, str(tmp_path), options=compile_options(bucketing="none")),
            precompile(model, str(tmp_path), options=compile_options(), key="another job")]
    paths = {run.path(tokens) for run in runs} | {runs[0].path(tokens[:, :8])}
    assert len(paths) == 4
    model.eval()
    assert runs[0].path(tokens) not in paths  # the training mode is in the name too


def test_a_precompiled_function_loads_and_computes_alike(tmp_path):
    logits = torch.randn(2, 8, 16, requires_grad=True)
    labels = torch.randint(0, 16, (2, 8))
    outputs = []
    for _ in range(2):
        loss_fn = precompile(cross_entropy_loss, str(tmp_path))
        loss = loss_fn(logits, labels)
        (grad,) = torch.autograd.grad(loss, logits)
        outputs.append((loss_fn.origin, loss, grad))
    assert [origin for origin, _, _ in outputs] == ["compiled", "loaded"]
    assert torch.equal(outputs[0][1], outputs[1][1]) and torch.equal(outputs[0][2], outputs[1][2])


def test_a_precompiled_function_loads_the_kernels_its_options_compiled(tmp_path):
    """Loading applies the compile's options, so it finds the C++ kernels they built instead of
    building others. CPU jobs compile with ``cpp.simdlen`` 1 (scalar kernels); a process that
    probes the vector ISAs (the warm-start benchmark's did) loaded them under vector kernels' keys
    and built those: a warm first step of the debug MoE took 15.7 s instead of 3.5 s. Here an
    option that changes gcc's flags as that one does, but needs no ISA probe."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir, temporary_cache_dir

    def kernels() -> set:
        return {os.path.join(d, f) for d, _, files in os.walk(cache_dir()) for f in files if f.endswith(".so")}

    options = {"cpp.enable_unsafe_math_opt_flag": True}
    logits = torch.randn(2, 8, 16, requires_grad=True)
    labels = torch.randint(0, 16, (2, 8))
    with temporary_cache_dir(str(tmp_path / "cache")):  # no kernel from an earlier run, in memory or on disk
        first = precompile(cross_entropy_loss, str(tmp_path), options=options)
        expected = first(logits, labels)
        built = kernels()
        torch._inductor.utils.clear_caches()  # the kernels loaded in memory, as a new process starts
        second = precompile(cross_entropy_loss, str(tmp_path), options=options)
        loss = second(logits, labels)
        assert kernels() == built
    assert (first.origin, second.origin) == ("compiled", "loaded")
    assert torch.equal(loss, expected)
    assert torch._inductor.config.cpp.enable_unsafe_math_opt_flag is False  # set for the load only


_USER_MODULE = '''
import torch


class Scale(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(4))

    def forward(self, x):
        return x * self.weight * {factor}
'''


def test_a_saved_model_whose_traced_source_changed_is_compiled_again(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    source = tmp_path / "user_model_for_precompile.py"
    x = torch.ones(4)
    outputs = []
    for factor in ("2.0", "3.0"):
        source.write_text(textwrap.dedent(_USER_MODULE.format(factor=factor)))
        sys.modules.pop(source.stem, None)
        importlib.invalidate_caches()
        torch._dynamo.reset()
        runner = precompile(importlib.import_module(source.stem).Scale(), str(tmp_path / "compiled"))
        outputs.append((runner(x), runner.origin))
    assert outputs[1][1] == "compiled"  # the saved file is stale: compiled again and replaced
    assert torch.equal(outputs[0][0], 2 * x) and torch.equal(outputs[1][0], 3 * x)
    assert len(list((tmp_path / "compiled").iterdir())) == 1


def test_precompile_refuses_disabled_caches(tmp_path, monkeypatch):
    monkeypatch.setattr(torch._inductor.config, "force_disable_caches", True)
    with pytest.raises(ValueError, match="TORCHINDUCTOR_FORCE_DISABLE_CACHES"):
        precompile(torch.nn.Linear(2, 2), str(tmp_path))
    assert not any(tmp_path.iterdir())


MOE = MoEConfig(**dataclasses.asdict(T.CFG), num_experts=4, top_k=2, expert_dim=32)  # block 1 is MoE


def _precompiled_ep_step(directory: str):
    """This rank's first-step gradients (its shards), where its compiled model came from, and the
    frames Dynamo traced, FSDP2×EP2 on 2 ranks."""
    model, _, dp_rank, dp_size = T.wrapped_run(MOE, (2,), ("dp_shard",), ep=2)
    runner = precompile(model, directory, options=compile_options())
    traced = _frames_traced()
    tokens, labels = rank_slice(T.batches(MOE)[0], dp_rank, dp_size)
    cross_entropy_loss(runner(tokens), labels).backward()
    grads = {n: p.grad.to_local().clone() for n, p in model.named_parameters()}
    return grads, runner.origin, _frames_traced() - traced


@pytest.mark.ranks
@pytest.mark.slow
def test_a_second_launch_loads_every_ranks_compiled_model(tmp_path, monkeypatch):
    """Ranks of two expert groups save their own files; the next launch loads them, traces
    nothing and gets the same gradients, bit for bit."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    directory = str(tmp_path / "compiled")
    first = run_ranks(_precompiled_ep_step, 2, directory)
    second = run_ranks(_precompiled_ep_step, 2, directory)
    assert [origin for _, origin, _ in first] == ["compiled", "compiled"]
    assert [(origin, traced) for _, origin, traced in second] == [("loaded", 0), ("loaded", 0)]
    for (grads, _, _), (again, _, _) in zip(first, second):
        for name, grad in grads.items():
            assert torch.equal(grad, again[name]), name
