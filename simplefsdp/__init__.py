"""SimpleFSDP: compiler-first fully sharded data parallel built on DTensor.

``simple_fsdp(model, mesh)`` shards every parameter; ``torch.compile(model)`` then traces the
all-gathers and reduce-scatters into the same graph as the compute, and runs our Inductor passes
(``simplefsdp.passes``) on it; ``with simplefsdp.trace(dir):`` records the compile for tlparse.
"""

from torch.distributed.fsdp import MixedPrecisionPolicy

from simplefsdp.frontend import is_simple_fsdp, simple_fsdp
from simplefsdp.passes import compile_options
from simplefsdp.tracing import trace

__all__ = ["MixedPrecisionPolicy", "compile_options", "is_simple_fsdp", "simple_fsdp", "trace"]
