"""A reply from a prompt-cache snapshot and a cache-free reply run the same float
operations in the same order: the one-process engine splits every prefill at the
snapshot policy's points (message ends, every 1024 tokens) whether or not a prompt cache
is there, so the positions after a restored prefix are computed in the same chunks as in
a full prefill, and the next-token logits are bit for bit equal (not merely close).

Three engines on the shipped micro model, the second turn of a conversation (past
index_topk: DSA's sparse path): cache-free, a cold cache (a miss, storing snapshots) and
a hit (restored from the turn-one snapshot). The reference for "the same tokens" is the
cache-free engine, which has no snapshot to restore."""

import mlx.core as mx
import pytest

from kimi_mlx.checkpoint.loader import load_for_generation
from kimi_mlx.generation.request import default_model
from kimi_mlx.server.engine import Engine
from kimi_mlx.server.prompt_cache import PromptCache


@pytest.fixture(scope="module")
def micro():
    return load_for_generation(str(default_model()))[0]


def ids_of(seed, n):
    return [3 + (seed * 7919 + 31 * i) % 150 for i in range(n)]


def next_logits(engine, model, ids, segment_ends):
    """The first reply token's logits [vocab] after the engine's prefill of ids[:-1]
    (from its prompt cache when it holds a prefix), as `Engine._run` computes them."""
    cache, start = None, 0
    if engine.prompt_cache is not None:
        cache, start = engine.prompt_cache.fetch(ids)
    if cache is None:
        cache, start = model.make_cache(), 0
    engine.prefill(ids, cache, start, segment_ends)
    out = model(mx.array(ids[-1:])[None], cache=cache)[0, -1]
    mx.eval(out)
    return out, start


@pytest.mark.parametrize("turn_two", [40, 1100])  # a short turn, and one past `every`
def test_a_restored_prefix_gives_the_cache_free_logits_bit_for_bit(micro, turn_two):
    system, user1, reply1, user2 = (ids_of(1, 70), ids_of(2, 23), ids_of(3, 31),
                                    ids_of(4, turn_two))
    turn1 = system + user1 + [9]  # [9]: the assistant header's last token
    ends1 = [len(system), len(system) + len(user1)]
    turn2 = system + user1 + reply1 + user2 + [9]
    ends2 = ends1 + [len(system) + len(user1) + len(reply1), len(turn2) - 1]

    free = Engine(micro, [0], prompt_cache=None)
    cached = Engine(micro, [0], prompt_cache=PromptCache(1 << 30))
    want1, _ = next_logits(free, micro, turn1, ends1)
    got1, start = next_logits(cached, micro, turn1, ends1)  # a miss: stores snapshots
    assert start == 0 and mx.array_equal(got1, want1).item()
    want2, _ = next_logits(free, micro, turn2, ends2)
    got2, start = next_logits(cached, micro, turn2, ends2)  # a hit: turn one's prefix
    assert start == ends1[-1]
    assert mx.array_equal(got2, want2).item(), mx.abs(got2 - want2).max().item()
