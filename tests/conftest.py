"""Shared fixtures: small checkpoints in the official layout, built once per session."""

import shutil

import pytest

from kimi_mlx.testing.checkpoints import build_checkpoint


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    """A random tiny K3.1 checkpoint (3 shards, MXFP4 experts, BF16, tokenizer files), its
    weights conditioned for numerical comparisons (`random_model(conditioned=True)`)."""
    return build_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", seed=0, conditioned=True)


@pytest.fixture
def ckpt_copy(tiny_ckpt, tmp_path):
    """A private copy of the tiny checkpoint that a test may damage."""
    dst = tmp_path / "copy"
    shutil.copytree(tiny_ckpt, dst)
    return dst
