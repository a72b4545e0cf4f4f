"""Installed on PYTHONPATH by tests only (`kimi_mlx.testing.fake_metal.env`): a fake Metal
device for the product process this interpreter runs, when KIMI_MLX_FAKE_METAL is set."""
import os

if os.environ.get("KIMI_MLX_FAKE_METAL"):
    from kimi_mlx.testing.fake_metal import install_from_env

    install_from_env()
