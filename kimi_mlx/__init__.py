"""kimi-mlx: Moonshot's Kimi K3.1 Pro on Apple Silicon with MLX."""

from kimi_mlx.text.hf_register import register_with_transformers as _register_with_transformers

# Lets transformers.AutoTokenizer (and so mlx_lm.load) open Kimi checkpoints with our
# TikTokenTokenizer instead of the checkpoint's tokenization_kimi.py. Deferred until
# transformers' tokenizer module is imported, so `import kimi_mlx` stays cheap.
_register_with_transformers()
