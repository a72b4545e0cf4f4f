"""`kimi-mlx cluster serve`, the daemon on every Mac: the stage service (sessions, loading,
forward passes, the stage's prompt cache) and hosting a tensor-parallel rank."""
