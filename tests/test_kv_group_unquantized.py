"""A BF16 (unquantized) DSA cache stores nothing per group, so its group setting is not
part of its format: batch caches that differ only there merge and extend, as the
one-process server's did not when its load path defaulted to group 64 and the cache to
128 (`cannot extend a kv_bits=None/64 batch cache with a kv_bits=None/128 one`, a 500 on
every batched n-gram request). 8-bit caches of different groups still refuse, naming
both formats."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from kimi_mlx.model.cache import BatchDSACache, DSACache


def _filled(bits, group, n, seed):
    rng = np.random.default_rng(seed)
    c = DSACache(bits, group)
    lat = mx.array(rng.standard_normal((1, 1, n, 64)).astype(np.float32))
    pe = mx.array(rng.standard_normal((1, 1, n, 16)).astype(np.float32))
    idx = mx.array(rng.standard_normal((1, 1, n, 32)).astype(np.float32))
    c.update_and_fetch_all(lat, pe, idx)
    return c, np.asarray(lat), np.asarray(idx)


def test_unquantized_caches_of_different_group_settings_merge_and_extend():
    a, lat_a, idx_a = _filled(None, 64, 5, 0)
    b, lat_b, idx_b = _filled(None, 128, 3, 1)
    merged = BatchDSACache.merge([a, b])
    # row 1 is left-padded by 2: its last 3 positions hold b's values unchanged
    assert np.array_equal(np.asarray(merged.keys[1, :, 2:5]), lat_b[0])
    assert np.array_equal(np.asarray(merged.index_keys[0, :, :5]), idx_a[0])
    other = BatchDSACache.merge([_filled(None, 32, 5, 2)[0]])
    merged.extend(other)
    assert merged.keys.shape[0] == 3


def test_8bit_caches_of_different_groups_still_refuse():
    a = BatchDSACache.merge([_filled(8, 32, 5, 0)[0]])
    b = BatchDSACache.merge([_filled(8, 64, 5, 1)[0]])
    with pytest.raises(ValueError, match="8/32.*8/64|kv_bits"):
        a.extend(b)
