"""SimpleFSDP's Inductor passes (installed as ``simplefsdp.passes``).

:class:`SimpleFSDPPasses` runs them in order on each post-grad graph: FSDP bucketing
(:mod:`.fsdp_bucketing`), the all-to-all overlap (:mod:`.a2a_overlap`), FSDP prefetch
(:mod:`.fsdp_prefetch`), the gloo guard (:mod:`.gloo_one_in_flight`, always on: it works around
a gloo crash and changes nothing elsewhere), then the passes the user had set, if any.
``simple_fsdp(...)`` calls :func:`install`, so a plain ``torch.compile(model)`` runs them on the
wrapped model's graphs (and on no other model's); :func:`compile_options` configures them (or
turns them off) for one compile::

    model = torch.compile(simple_fsdp(model, mesh, ep=2))            # defaults
    model = torch.compile(model, options=compile_options(bucketing="all", bucket_cap_mb=64))
    model = torch.compile(model, options=compile_options(bucketing="none", a2a_overlap=False, prefetch=0))

Inductor takes one ``post_grad_custom_post_pass`` from its global config (torch 2.11 a single
callable; 2.13 also a list, and inference-aware passes), so the user's pass, in any of those
forms, set before or after ``simple_fsdp``, is kept and run after ours, never replaced.
"""

from __future__ import annotations

import torch
import torch._dynamo.callback
from torch._inductor.custom_graph_pass import CustomGraphPass

from simplefsdp.passes.a2a_overlap import AllToAllOverlap
from simplefsdp.passes.block_region_check import check_block_regions
from simplefsdp.passes.chain import InferenceAware, PassChain
from simplefsdp.passes.fsdp_bucketing import FSDPBucketing
from simplefsdp.passes.fsdp_prefetch import FSDPPrefetch
from simplefsdp.passes.fx_utils import collective_sequences
from simplefsdp.passes.gloo_one_in_flight import GlooOneInFlight
from simplefsdp.passes.region_saves import RegionSaves

BUCKETING = ("all", "reduce_scatter", "none")
DEFAULT_BUCKETING = "all"


_GROUPS: set[str] = set()  # process groups of models wrapped by simple_fsdp


class SimpleFSDPPasses(PassChain, InferenceAware or CustomGraphPass):
    """Our post-grad passes in order, then the user's; caches by all of their uuids.

    Ours run only on graphs with a collective on a process group of a model that ``simple_fsdp``
    wrapped (:func:`install` registers them): graphs of other models get the user's passes alone.

    The uuid, part of Inductor's and AOTAutograd's cache keys, also names this rank's registered
    process groups. Ranks in different sub-mesh groups (rank 0 in the ep group "1" = {0, 1}, rank 2
    in "2" = {2, 3}) trace the same graph but compile it against different group names, so with a
    shared cache dir (torchrun, a user's script) a key without them lets one rank load another's
    artifact, which then fails: "Could not resolve the process group registered under the name 1".
    c10d names a group the same way on every rank (a creation counter, or a hash of its ranks).
    """

    def __init__(
        self,
        bucketing: str = DEFAULT_BUCKETING,
        bucket_cap_mb: float | None = None,
        a2a_overlap: bool = True,
        prefetch: int = 1,
        user_pass=None,
        blocks=None,
    ):
        if bucketing not in BUCKETING:
            raise ValueError(f"bucketing must be one of {BUCKETING}; got {bucketing!r}")
        if isinstance(bucket_cap_mb, bool) or not (bucket_cap_mb is None or isinstance(bucket_cap_mb, (int, float))):
            raise ValueError(f"bucket_cap_mb must be a number of MB or None; got {bucket_cap_mb!r}")
        if bucket_cap_mb is not None and not bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be positive; got {bucket_cap_mb!r}")
        if not isinstance(a2a_overlap, bool):
            raise ValueError(f"a2a_overlap must be True or False; got {a2a_overlap!r}")
        if not isinstance(prefetch, int) or isinstance(prefetch, bool) or prefetch < 0:
            raise ValueError(f"prefetch must be an int >= 0 (blocks in flight; 0: off); got {prefetch!r}")
        if blocks is not None and not (isinstance(blocks, (list, tuple)) and blocks
                                       and all(isinstance(b, str) and b for b in blocks)):
            raise ValueError(f"blocks must be a non-empty list of module-list paths (such as ['model.layers']); got {blocks!r}")
        blocks = tuple(blocks or ())
        self.passes = []
        if bucketing != "none":
            self.passes.append(FSDPBucketing(bucket_cap_mb, all_gathers=bucketing == "all", blocks=blocks))
        if a2a_overlap:
            self.passes.append(AllToAllOverlap())
        if prefetch:
            self.passes.append(FSDPPrefetch(prefetch, blocks=blocks))
        self.passes.append(GlooOneInFlight())
        super().__init__(user_pass)

    def __call__(self, graph: torch.fx.Graph, is_inference: bool = False) -> None:
        check_block_regions(graph)
        if _GROUPS.intersection(collective_sequences(graph)):
            for graph_pass in self.passes:
                graph_pass(graph)
        self.run_user_passes(graph, is_inference=is_inference)

    def uuid(self):
        return self.chain_uuid(__file__, ([p.uuid() for p in self.passes], sorted(_GROUPS)))


def _attach() -> None:
    """Put the default chain in Inductor's config, keeping whatever pass is there (run after ours)."""
    current = torch._inductor.config.post_grad_custom_post_pass
    if not isinstance(current, SimpleFSDPPasses):
        torch._inductor.config.post_grad_custom_post_pass = SimpleFSDPPasses(user_pass=current)


def _attach_at_compile_start(_args) -> None:
    if _GROUPS:
        _attach()


def install(group_names) -> None:
    """Run the default passes on compiled graphs that use these process groups.

    Called by ``simple_fsdp``. Inductor takes its post-grad pass from global config, so the chain
    is put there; it runs the pass that was set before it, and it leaves graphs of models that
    ``simple_fsdp`` did not wrap to that pass alone. A pass set later is taken into the chain at
    the start of the next compile (a Dynamo start callback), not dropped in place of ours.
    """
    callbacks = getattr(torch._dynamo.callback, "callback_handler", None)  # torch._dynamo.reset() clears it
    if callbacks is not None and _attach_at_compile_start not in callbacks.start_callbacks:
        callbacks.register_start_callback(_attach_at_compile_start)
    _GROUPS.update(group_names)
    _attach()


def compile_options(
    *,
    bucketing: str = DEFAULT_BUCKETING,
    bucket_cap_mb: float | None = None,
    a2a_overlap: bool = True,
    prefetch: int = 1,
    blocks=None,
    blocks_once: bool = False,
) -> dict:
    """``torch.compile(options=...)`` that runs the passes configured so, then the user's pass.

    ``bucketing``: ``"all"`` (default) merges FSDP all-gathers and reduce-scatters per block, mesh
    and dtype, ``"reduce_scatter"`` only the reduce-scatters, ``"none"`` neither. ``bucket_cap_mb`` caps a bucket's size.
    ``a2a_overlap`` overlaps the expert all-to-alls with shared-expert compute. ``prefetch``:
    blocks whose all-gathers are issued ahead (and whose reduce-scatters drain behind); 0: off.
    ``blocks``: the model's block lists by dotted path from the compiled module (``["model.layers"]``,
    or ``["stages.0.blocks", "stages.1.blocks"]``), where a parameter's block would otherwise be
    its path up to the first list index; parameters outside them belong to the root.
    ``blocks_once``: the model's blocks compile once (``simplefsdp.compile_blocks_once``); turns
    off Inductor's buffer reuse, which corrupts the region bodies' inputs (see
    :mod:`.block_region_check`), and lets each region's backward read its parameters from the
    model's graph, where ``reshard_after_forward`` re-gathers them (:mod:`.region_saves`).
    """
    if not isinstance(blocks_once, bool):
        raise ValueError(f"blocks_once must be True or False; got {blocks_once!r}")
    chain = SimpleFSDPPasses(
        bucketing, bucket_cap_mb, a2a_overlap, prefetch, user_pass=torch._inductor.config.post_grad_custom_post_pass,
        blocks=blocks,
    )
    options = {"post_grad_custom_post_pass": chain}
    if blocks_once:
        options["allow_buffer_reuse"] = False
        options["joint_custom_pre_pass"] = RegionSaves(user_pass=torch._inductor.config.joint_custom_pre_pass)
    return options


__all__ = ["BUCKETING", "AllToAllOverlap", "FSDPBucketing", "FSDPPrefetch", "GlooOneInFlight", "SimpleFSDPPasses", "compile_options", "install"]
