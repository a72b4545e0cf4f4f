"""Shared fixtures: small checkpoints in the official layout, built once per session; the
rest of the fixture layer is in tests/fixtures/ (loaded below)."""

import shutil

import pytest

from kimi_mlx.testing.checkpoints import build_checkpoint

# tests/fixtures/: the session-scoped micro model, server, 3-stage pipeline and tensor node
# shared by the modules that only read them (shared), the clean-up after a timed-out test
# (timeouts), the disk prompt-cache stores closed after each test (stores), the start-up
# counter (counting, only under KIMI_MLX_COUNT_STARTUPS), per-test CPU seconds (cputime,
# only under KIMI_MLX_TEST_CPU) and the long runs left to make test-e2e (long_runs)
pytest_plugins = ["fixtures.counting", "fixtures.cputime", "fixtures.long_runs", "fixtures.planted",
                  "fixtures.shared", "fixtures.stores",
                  "fixtures.timeouts"]


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
