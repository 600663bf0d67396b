"""The training application: ``simplefsdp-train`` (:mod:`.cli`) with its configs, data, metrics,
gradient norm, checkpoints, local CPU launcher and ``simplefsdp-compare``.

It uses the library (``simplefsdp``), the models and the FSDP2 baseline; the library never imports it.
"""
