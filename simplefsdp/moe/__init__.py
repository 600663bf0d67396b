"""Mixture-of-experts operations: token dispatch over the ``ep`` ranks, grouped matmul, row permutation.

These import only torch: the core (:func:`simplefsdp.simple_fsdp`) attaches a
:class:`~simplefsdp.moe.token_dispatch.TokenDispatcher` to each routed-experts module, and the
models call the ops.
"""
