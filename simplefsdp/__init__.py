"""SimpleFSDP: compiler-first fully sharded data parallel built on DTensor.

``simple_fsdp(model, mesh)`` shards every parameter; ``torch.compile(model)`` then traces the
all-gathers and reduce-scatters into the same graph as the compute.
"""

from torch.distributed.fsdp import MixedPrecisionPolicy

from simplefsdp.frontend import is_simple_fsdp, simple_fsdp

__all__ = ["MixedPrecisionPolicy", "is_simple_fsdp", "simple_fsdp"]
