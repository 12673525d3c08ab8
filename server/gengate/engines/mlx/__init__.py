"""MLX engine (mlx-lm): continuous batching on one model thread, like the transformers engine.

Importing this package does not import mlx; start() does.
"""

from gengate.engines.mlx.backend import MlxBackend, MlxOptions

__all__ = ["MlxBackend", "MlxOptions"]
