"""SimpleFSDP: compiler-first fully sharded data parallel built on DTensor.

``simple_fsdp(model, mesh)`` shards every parameter; ``torch.compile(model)`` then traces the
all-gathers and reduce-scatters into the same graph as the compute, and runs our Inductor passes
(``simplefsdp.passes``) on it; ``with simplefsdp.trace(dir):`` records the compile for tlparse.

The passes live in the repository's top-level ``passes/`` folder and are installed as
``simplefsdp.passes``. From a plain checkout (``PYTHONPATH=<checkout>``, nothing installed) the
package binds that folder under the same name, so both ways import the same modules.
"""

import importlib.util
import os
import sys


def _bind_checkout_passes() -> None:
    if importlib.util.find_spec(f"{__name__}.passes") is not None:  # installed (or editable)
        return
    folder = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "passes")
    spec = importlib.util.spec_from_file_location(
        f"{__name__}.passes", os.path.join(folder, "__init__.py"), submodule_search_locations=[folder]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    globals()["passes"] = module


_bind_checkout_passes()

from torch.distributed.fsdp import MixedPrecisionPolicy  # noqa: E402

from simplefsdp.block_regions import compile_blocks_once  # noqa: E402
from simplefsdp.param_access import gathered  # noqa: E402
from simplefsdp.passes import compile_options  # noqa: E402
from simplefsdp.precompile import precompile  # noqa: E402
from simplefsdp.tracing import trace  # noqa: E402
from simplefsdp.wrap import is_simple_fsdp, simple_fsdp  # noqa: E402

__all__ = ["MixedPrecisionPolicy", "compile_blocks_once", "compile_options", "gathered", "is_simple_fsdp", "precompile", "simple_fsdp", "trace"]
