"""SimpleFSDP's Inductor passes (installed as ``simplefsdp.passes``).

``compile_options()`` gives the ``torch.compile(options=...)`` that installs them::

    model = torch.compile(simple_fsdp(model, mesh), options=simplefsdp.passes.compile_options())
"""

from __future__ import annotations

from simplefsdp.passes.fsdp_bucketing import FSDPBucketing


BUCKETING = ("all", "reduce_scatter", "none")


def compile_options(*, bucketing: str = "all", bucket_cap_mb: float | None = None) -> dict:
    """Inductor options that run SimpleFSDP's post-grad passes.

    ``bucketing``: ``"all"`` merges FSDP all-gathers and reduce-scatters per block and mesh,
    ``"reduce_scatter"`` only the reduce-scatters (bitwise neutral, see :class:`FSDPBucketing`),
    ``"none"`` nothing. ``bucket_cap_mb`` caps a bucket's size.
    """
    if bucketing not in BUCKETING:
        raise ValueError(f"bucketing must be one of {BUCKETING}; got {bucketing!r}")
    if bucket_cap_mb is not None and not bucket_cap_mb > 0:
        raise ValueError(f"bucket_cap_mb must be positive; got {bucket_cap_mb!r}")
    if bucketing == "none":
        return {}
    bucket_pass = FSDPBucketing(bucket_cap_mb, all_gathers=bucketing == "all")
    return {"post_grad_custom_post_pass": bucket_pass}


__all__ = ["BUCKETING", "FSDPBucketing", "compile_options"]
