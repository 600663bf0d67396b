"""Gradient squares computed in backward (:mod:`simplefsdp.grad_squares`): the same sums the
gradients give, no gradient changed, and a group whose count is off falls back to reading its
gradients."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn as nn

from simplefsdp import simple_fsdp
from simplefsdp.grad_squares import track_grad_squares, tracked_grad_squares
from simplefsdp.models.llama import cross_entropy_loss
from simplefsdp.models.moe import MoEConfig
from simplefsdp.train.data import rank_slice
from simplefsdp.train.grad_norm import _by_mesh, grad_norm
from tests import training as T
from tests.conftest import run_under_triton_interpreter

MOE = MoEConfig(**dataclasses.asdict(T.CFG), num_experts=8, top_k=2, expert_dim=32)


def _read_squares(params) -> dict:
    """Per group key (as str), this rank's sum of squared gradients, read from the gradients."""
    groups = _by_mesh([p.grad for p in params if p.grad is not None])
    return {str(k): torch.stack([t.float().pow(2).sum() for t in v]).sum().item() for k, v in groups.items()}


def _tracked_against_untracked(compiled: bool):
    """FSDP2 x EP2 (dense and expert meshes), resharding after forward: one backward with the
    squares tracked and one without, from the same weights and batch."""
    out = {}
    for track in (False, True):
        model, runner, dp_rank, dp_size = T.wrapped_run(MOE, (2,), ("dp_shard",), 2, compiled=compiled)
        squares = track_grad_squares(model) if track else None
        tokens, labels = rank_slice(T.batches(MOE)[0], dp_rank, dp_size)
        cross_entropy_loss(runner(tokens), labels).backward()
        params = list(model.parameters())
        out[track] = [p.grad.to_local().clone() for p in params]
        if track:
            read = _read_squares(params)
            taken = {str(k): (t.sum.item(), t.counted_right.item()) for k, t in squares.take(params).items()}
            norms = grad_norm(params), grad_norm(params, squares)  # the sinks are empty now: read again
    same = all(torch.equal(a, b) for a, b in zip(out[False], out[True], strict=True))
    return same, read, taken, [n.item() for n in norms]


@pytest.mark.ranks
@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["eager", "compiled"])
def test_squares_from_backward_equal_the_gradients_and_change_none(compiled):
    """On 2 gloo ranks, eager and compiled (the gather in a selective-checkpoint region, the squares
    in Inductor's backward graph; about 50 s): every group's squares come from the backward and
    equal the gradients' own within 1e-6, and the gradients are bitwise those of an untracked run."""
    same, read, taken, norms = T.launch_once(_tracked_against_untracked, 2, compiled)
    assert same
    assert taken.keys() == read.keys() and len(taken) == 2  # dense on dp_shard, experts on [edp, ep]
    for key in read:
        assert taken[key] == (pytest.approx(read[key], rel=1e-6), True), key
    assert norms[0] == norms[1]  # nothing taken twice: the second norm read the gradients


class _Twice(nn.Module):
    """``inner`` is called twice a forward: its weight is gathered for each call."""

    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(8, 8, bias=False)
        self.outer = nn.Linear(8, 8, bias=False)

    def forward(self, x):
        return self.outer(self.inner(self.inner(x)))


@pytest.fixture
def mesh(fake_world):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (8,), mesh_dim_names=("dp_shard",))


def _wrapped(module: nn.Module, mesh) -> nn.Module:
    torch.manual_seed(0)
    return simple_fsdp(module, mesh)


def test_two_backwards_before_a_step_read_the_gradients(mesh):
    """Accumulated gradients: the sink counted two gradients per parameter, so the squares are
    not counted right and the norm is read; after that, one backward counts right again."""
    model = _wrapped(nn.Sequential(nn.Linear(8, 8, bias=False), nn.Linear(8, 8, bias=False)), mesh)
    squares = track_grad_squares(model)
    params, x = list(model.parameters()), torch.randn(4, 8)
    for _ in range(2):
        model(x).sum().backward()
    (twice,) = squares.take(params).values()
    assert not twice.counted_right
    for p in params:
        p.grad = None
    model(x).sum().backward()
    (once,) = squares.take(params).values()
    assert once.counted_right and once.sum.item() == pytest.approx(next(iter(_read_squares(params).values())), rel=1e-6)


def test_a_group_whose_squares_are_known_takes_no_local_gradient(mesh, monkeypatch):
    """On the CPU, where the host reads the count at no cost, the norm from squares counted right
    reads no gradient and takes no local tensor of one either (a ``to_local`` per gradient)."""
    from torch.distributed.tensor import DTensor

    model = _wrapped(nn.Sequential(nn.Linear(8, 8, bias=False), nn.Linear(8, 8, bias=False)), mesh)
    squares = track_grad_squares(model)
    params = list(model.parameters())
    model(torch.randn(4, 8)).sum().backward()
    grads = {id(p.grad) for p in params}
    taken = []
    to_local = DTensor.to_local
    monkeypatch.setattr(DTensor, "to_local", lambda self, *a, **k: (taken.append(id(self) in grads), to_local(self, *a, **k))[1])
    from_squares = grad_norm(params, squares)
    assert taken == []
    assert grad_norm(params) == pytest.approx(from_squares.item(), rel=1e-6)  # the sinks are empty: read
    assert taken == [True, True]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_module_called_twice_reads_its_group(mesh, compiled):
    """``inner``'s weight is gathered once per call, so its gradient arrives in two parts whose
    squares do not add up to its own: the count is off, and the norm is the one read from the
    gradients, exactly."""
    model = _wrapped(_Twice(), mesh)
    squares = track_grad_squares(model)
    torch._dynamo.reset()
    runner = torch.compile(model, fullgraph=True) if compiled else model
    params, x = list(model.parameters()), torch.randn(4, 8)
    runner(x).sum().backward()
    assert grad_norm(params, squares) == grad_norm(params)
    torch._dynamo.reset()


_ON_A_KERNEL_DEVICE = """
import math
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from simplefsdp import simple_fsdp
from simplefsdp.grad_squares import track_grad_squares
from simplefsdp.train import square_sum
from simplefsdp.train.grad_norm import grad_norm
from tests.conftest import fake_world_at
from tests.core.test_grad_squares import _Twice

square_sum.BLOCK, square_sum.CHUNK_BLOCKS = 64, 2  # chunks of 128 elements: tensors span several, end mid-chunk
gen = torch.Generator().manual_seed(0)

# the kernel: fp32 and bf16 launches, and a transposed tensor the kernel does not take (torch reads it)
tensors = [torch.randn(s, generator=gen) for s in ((300,), (7, 50), (5,))]
tensors += [torch.randn(200, generator=gen).bfloat16(), torch.randn(6, 40, generator=gen).t()]
expected = sum(t.double().pow(2).sum() for t in tensors).item()
summed = square_sum.square_sum_unless(tensors, torch.tensor(False))
assert summed.dtype == torch.float32 and abs(summed.item() - expected) <= 1e-6 * expected, (summed, expected)
poisoned = [torch.full_like(t, math.nan) for t in tensors]
assert square_sum.square_sum_unless(poisoned, torch.tensor(True)).item() == 0.0  # nothing read

# the norm: the flag decides, and nothing is read back to the host (Tensor.cpu and .numpy are the
# interpreter's own way to run a kernel on the CPU, so they are left alone)
world = fake_world_at(0)
next(world)
mesh = init_device_mesh("cpu", (8,), mesh_dim_names=("dp_shard",))

def no_read(*args, **kwargs):
    raise AssertionError("the norm read a value back to the host")

def case(module, backwards):
    torch.manual_seed(0)
    model = simple_fsdp(module, mesh)
    squares = track_grad_squares(model)
    params, x = list(model.parameters()), torch.randn(4, 8, generator=gen)
    for _ in range(backwards):
        model(x).sum().backward()
    read = grad_norm(params).item()  # no squares given: the gradients are read
    from_sinks = math.sqrt(sum(sink.grad[0].item() for sink in squares.sinks.values()))
    if backwards == 1 and not isinstance(module, _Twice):  # counted right: poisoned gradients are not read
        for p in params:
            p.grad.to_local().fill_(math.nan)
    saved = {name: getattr(torch.Tensor, name) for name in ("item", "tolist", "__bool__", "__float__")}
    for name in saved:
        setattr(torch.Tensor, name, no_read)
    try:
        decided = grad_norm(params, squares)
    finally:
        for name, method in saved.items():
            setattr(torch.Tensor, name, method)
    return decided.item(), read, from_sinks

linears = lambda: nn.Sequential(nn.Linear(8, 8, bias=False), nn.Linear(8, 8, bias=False))
decided, read, from_sinks = case(linears(), 1)
assert abs(decided - read) <= 1e-6 * read and abs(from_sinks - read) <= 1e-6 * read, (decided, read, from_sinks)
for name, module, backwards in (("called twice", _Twice(), 1), ("two backwards", linears(), 2)):
    decided, read, from_sinks = case(module, backwards)
    assert abs(from_sinks - read) > 1e-3 * read, (name, from_sinks, read)  # the squares are not the norm's
    assert abs(decided - read) <= 1e-6 * read, (name, decided, read)
print("decided on the device")
"""


def test_on_a_kernel_device_the_norm_decides_without_the_host():
    """Where Triton runs (here its interpreter on the CPU, small chunks), the norm never reads the
    squares' count back to the host: a group counted right gives the backward's squares and reads
    no gradient (poisoned with NaN, the norm stays finite); a module called twice and two backwards
    before a step read their gradients, within 1e-6 of the norm read without squares. The kernel
    alone: fp32, bf16 and a tensor it does not take, within 1e-6 of the sum in float64; skipped, it
    gives 0 for tensors of NaN."""
    assert "decided on the device" in run_under_triton_interpreter(_ON_A_KERNEL_DEVICE)


def test_stop_ends_tracking(mesh):
    model = _wrapped(_Twice(), mesh)
    squares = track_grad_squares(model)
    assert tracked_grad_squares(model) is squares
    squares.stop()
    assert tracked_grad_squares(model) is None
    model(torch.randn(4, 8)).sum().backward()
    assert all(sink.grad is None for sink in squares.sinks.values())
    assert track_grad_squares(model) is not squares  # it may start again


def test_refusals_change_nothing(mesh):
    with pytest.raises(ValueError, match="wrapped by simple_fsdp"):
        track_grad_squares(nn.Linear(4, 4))
    model = _wrapped(_Twice(), mesh)
    squares = track_grad_squares(model)
    with pytest.raises(ValueError, match="tracked already"):
        track_grad_squares(model)
    assert tracked_grad_squares(model) is squares
