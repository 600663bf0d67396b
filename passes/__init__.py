"""SimpleFSDP's Inductor passes (installed as ``simplefsdp.passes``).

:class:`SimpleFSDPPasses` runs them in order on each post-grad graph: FSDP bucketing
(:mod:`.fsdp_bucketing`), the all-to-all overlap (:mod:`.a2a_overlap`), FSDP prefetch
(:mod:`.fsdp_prefetch`), the gloo guard (:mod:`.gloo_one_in_flight`, always on: it works around
a gloo crash and changes nothing elsewhere), then the pass the user had set, if any. ``simple_fsdp(...)`` calls
:func:`install`, so a plain ``torch.compile(model)`` runs them; :func:`compile_options`
configures them (or turns them off) for one compile::

    model = torch.compile(simple_fsdp(model, mesh, ep=2))            # defaults
    model = torch.compile(model, options=compile_options(bucketing="all", bucket_cap_mb=64))
    model = torch.compile(model, options=compile_options(bucketing="none", a2a_overlap=False, prefetch=0))

Inductor takes one ``post_grad_custom_post_pass`` (torch 2.11 takes a single callable), so a
pass set before ``simple_fsdp`` is kept and run after ours, not replaced.
"""

from __future__ import annotations

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from simplefsdp.passes.a2a_overlap import AllToAllOverlap
from simplefsdp.passes.fsdp_bucketing import FSDPBucketing
from simplefsdp.passes.fsdp_prefetch import FSDPPrefetch
from simplefsdp.passes.gloo_one_in_flight import GlooOneInFlight

BUCKETING = ("all", "reduce_scatter", "none")
# all-gather buckets are not yet bitwise neutral on CPU (see FSDPBucketing): off by default
DEFAULT_BUCKETING = "reduce_scatter"


class SimpleFSDPPasses(CustomGraphPass):
    """Our post-grad passes in order, then ``user_pass``; caches by all of their uuids."""

    def __init__(
        self,
        bucketing: str = DEFAULT_BUCKETING,
        bucket_cap_mb: float | None = None,
        a2a_overlap: bool = True,
        prefetch: int = 1,
        user_pass=None,
    ):
        if bucketing not in BUCKETING:
            raise ValueError(f"bucketing must be one of {BUCKETING}; got {bucketing!r}")
        if bucket_cap_mb is not None and not bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be positive; got {bucket_cap_mb!r}")
        if not isinstance(a2a_overlap, bool):
            raise ValueError(f"a2a_overlap must be True or False; got {a2a_overlap!r}")
        if not isinstance(prefetch, int) or isinstance(prefetch, bool) or prefetch < 0:
            raise ValueError(f"prefetch must be an int >= 0 (blocks in flight; 0: off); got {prefetch!r}")
        if isinstance(user_pass, SimpleFSDPPasses):
            user_pass = user_pass.user_pass
        self.passes = []
        if bucketing != "none":
            self.passes.append(FSDPBucketing(bucket_cap_mb, all_gathers=bucketing == "all"))
        if a2a_overlap:
            self.passes.append(AllToAllOverlap())
        if prefetch:
            self.passes.append(FSDPPrefetch(prefetch))
        self.passes.append(GlooOneInFlight())
        self.user_pass = user_pass

    def __call__(self, graph: torch.fx.Graph) -> None:
        for graph_pass in self.passes:
            graph_pass(graph)
        if self.user_pass is not None:
            self.user_pass(graph)

    def uuid(self):
        if self.user_pass is None:
            user = b""
        elif isinstance(self.user_pass, CustomGraphPass):
            user = self.user_pass.uuid()
            if user is None:  # the user's pass opts out of caching: so does the chain
                return None
        else:
            return None  # a plain function has no stable identity to cache by
        parts = [p.uuid() for p in self.passes]
        return get_hash_for_files((__file__,), extra=repr((parts, user)))


def _user_pass():
    """The post-grad pass set in Inductor's config that is not ours."""
    current = torch._inductor.config.post_grad_custom_post_pass
    return current.user_pass if isinstance(current, SimpleFSDPPasses) else current


def install() -> None:
    """Make every later ``torch.compile`` run the default passes (keeping a user's pass)."""
    if not isinstance(torch._inductor.config.post_grad_custom_post_pass, SimpleFSDPPasses):
        torch._inductor.config.post_grad_custom_post_pass = SimpleFSDPPasses(user_pass=_user_pass())


def compile_options(
    *,
    bucketing: str = DEFAULT_BUCKETING,
    bucket_cap_mb: float | None = None,
    a2a_overlap: bool = True,
    prefetch: int = 1,
) -> dict:
    """``torch.compile(options=...)`` that runs the passes configured so, then the user's pass.

    ``bucketing``: ``"reduce_scatter"`` (default) merges FSDP reduce-scatters per block and mesh,
    ``"all"`` the all-gathers too, ``"none"`` neither. ``bucket_cap_mb`` caps a bucket's size.
    ``a2a_overlap`` overlaps the expert all-to-alls with shared-expert compute. ``prefetch``:
    blocks whose all-gathers are issued ahead (and whose reduce-scatters drain behind); 0: off.
    """
    chain = SimpleFSDPPasses(bucketing, bucket_cap_mb, a2a_overlap, prefetch, user_pass=_user_pass())
    return {"post_grad_custom_post_pass": chain}


__all__ = ["BUCKETING", "AllToAllOverlap", "FSDPBucketing", "FSDPPrefetch", "GlooOneInFlight", "SimpleFSDPPasses", "compile_options", "install"]
