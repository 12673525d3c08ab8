"""Hugging Face transformers engine: continuous batching on one model thread.

Importing this package does not import torch or transformers; start() does.
"""

from gengate.engines.transformers.backend import TransformersBackend, TransformersOptions

__all__ = ["TransformersBackend", "TransformersOptions"]
