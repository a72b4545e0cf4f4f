"""MLX's wired limit of a process that loads a draft model beside its target counts the
draft too: `kimi-mlx generate --draft-model micro-draft` on a faked Mac
(`kimi_mlx.testing.fake_metal`) must wire the target's and the draft's tensors (each
checkpoint's shard files less their headers) plus both models' caches, worked out by hand
from each config.json (`test_wired.cache_by_hand`, K31_SPEC.md section 4). Before, only
the target was planned: the draft's weights were held past the wired limit."""

from __future__ import annotations

import pytest

from kimi_mlx.testing import fake_metal

from test_wired import MICRO, _run, cache_by_hand, file_weight_bytes

pytestmark = pytest.mark.skipif(MICRO is None, reason="needs the shipped micro checkpoint")
DRAFT = None if MICRO is None else MICRO.parent / "micro-draft"


@pytest.mark.skipif(DRAFT is None or not DRAFT.exists(), reason="needs micro-draft")
@pytest.mark.timeout(600)
def test_generate_with_a_draft_model_wires_both_models(tmp_path):
    rec = tmp_path / "calls.jsonl"
    r = _run(["generate", "--prompt", "def", "--max-tokens", "3", "--max-kv-size", "512",
              "--ignore-chat-template", "--draft-model", str(DRAFT), "--num-draft-tokens", "2"],
             rec)
    assert r.returncode == 0, r.stderr
    target = file_weight_bytes(MICRO) + cache_by_hand(MICRO, 512)
    draft = file_weight_bytes(DRAFT) + cache_by_hand(DRAFT, 512)
    assert draft > 0
    calls = fake_metal.records(rec)
    assert [c["limit"] for c in calls] == [target + draft, 0], (target, draft, calls)
