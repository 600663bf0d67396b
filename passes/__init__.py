"""Inductor graph passes of SimpleFSDP (installed as ``simplefsdp.passes``)."""
