"""A pass of ours that keeps the pass the user had set in Inductor's config and runs it after ours.

Inductor takes each custom pass (``post_grad_custom_post_pass``, ``joint_custom_pre_pass``) from
its global config: torch 2.11 a single callable, 2.13 also a list, and inference-aware passes. A
:class:`PassChain` takes the user's pass in any of those forms, set before ours, and its uuid
(part of Inductor's and AOTAutograd's cache keys) covers the user's passes too.
"""

from __future__ import annotations

import torch
from torch._inductor import custom_graph_pass
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

# torch 2.13 lets a pass ask whether the graph is an inference graph; torch 2.11 does not
InferenceAware = getattr(custom_graph_pass, "CustomInferenceAwareGraphPass", None)


def user_passes(user_pass) -> tuple:
    """A user's pass in any form torch accepts, as a tuple of passes (a chain of ours: its user's)."""
    if user_pass is None:
        return ()
    if isinstance(user_pass, PassChain):
        return user_pass.user_passes
    if isinstance(user_pass, (list, tuple)):
        return tuple(p for item in user_pass for p in user_passes(item))
    return (user_pass,)


class PassChain(CustomGraphPass):
    def __init__(self, user_pass=None):
        self.user_passes = user_passes(user_pass)

    def run_user_passes(self, graph: torch.fx.Graph, **inference) -> None:
        for user_pass in self.user_passes:
            if inference and InferenceAware is not None and isinstance(user_pass, InferenceAware):
                user_pass(graph, **inference)
            else:
                user_pass(graph)

    def chain_uuid(self, file: str, parts) -> str | None:
        """A hash of ``file``, ``parts`` (ours) and the user's uuids; None if one cannot be cached."""
        users = []
        for user_pass in self.user_passes:
            if not isinstance(user_pass, CustomGraphPass):
                return None  # a plain function has no stable identity to cache by
            users.append(user_pass.uuid())
            if users[-1] is None:  # the user's pass opts out of caching: so does the chain
                return None
        return get_hash_for_files((file,), extra=repr((parts, users)))
