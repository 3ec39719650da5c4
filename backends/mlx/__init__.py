"""The mlx backend: mlx + mlx-lm (Apple GPU on a Mac, CPU on Linux with mlx[cpu]).

``runtime`` imports mlx; ``capabilities`` and ``memory`` never do."""
