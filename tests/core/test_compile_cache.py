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

from simplefsdp import simple_fsdp
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
