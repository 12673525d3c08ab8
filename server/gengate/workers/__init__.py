"""Local engines in their own worker processes, and the GPU placement that pins them."""
