"""Baselines that SimpleFSDP is measured and checked against (FSDP2's ``fully_shard``)."""
