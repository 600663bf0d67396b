"""Models used by the tests, the training entry point and the benchmarks."""

from simplefsdp.models.llama import Transformer, TransformerConfig

__all__ = ["Transformer", "TransformerConfig"]
