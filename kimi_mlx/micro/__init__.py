"""The shipped micro Kimi K3.1 checkpoint: its corpus (`corpus`) and training script (`train`).

`python -m kimi_mlx.micro.train` (`make micro`) rebuilds `kimi_mlx/assets/micro`, the
default model of `kimi-mlx generate` / `kimi-mlx eval` (see its MODEL_CARD.md).
"""
