"""Continuous batching for the local engines that run the model themselves (transformers, MLX):
the engine-neutral scheduler loop, a request's run across its generations, and the backend base
class. Importing it imports neither torch nor MLX."""
