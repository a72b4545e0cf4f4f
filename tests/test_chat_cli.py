"""`kimi-mlx chat`: preserved thinking across turns and exact cache reuse."""

import mlx.core as mx
from mlx_lm.sample_utils import make_sampler

from kimi_mlx.chat_cli import Conversation, chat_turn
from kimi_mlx.chat_format import encode_chat, render_chat
from kimi_mlx.generate import load_for_generation


def test_second_turn_keeps_reasoning_and_cache_reuse_is_exact(tiny_ckpt):
    model, wrapper, tok, _ = load_for_generation(str(tiny_ckpt))
    greedy = make_sampler(0.0)
    conv = Conversation("be brief")
    first = chat_turn(model, wrapper, tok, conv, "hi", "low", greedy, 6, 4096)
    stored = conv.messages[2]
    assert stored["role"] == "assistant"
    assert stored["reasoning_content"] == first["reasoning_content"]

    # Fresh prefill of turn two...
    fresh = Conversation("be brief")
    fresh.messages = list(conv.messages)
    second_fresh = chat_turn(model, wrapper, tok, fresh, "and then?", "low", greedy, 6, 4096,
                             reuse_cache=False)
    assert fresh.reused_tokens == 0
    # ...equals turn two served from a cache that already holds turn one (re-encoded).
    prefix = encode_chat(tok, conv.messages, reasoning_effort="low", add_generation_prompt=False)
    conv.cache = model.make_cache()
    mx.eval(model(mx.array([prefix]), conv.cache))
    conv.processed = prefix
    second_cached = chat_turn(model, wrapper, tok, conv, "and then?", "low", greedy, 6, 4096)
    assert conv.reused_tokens == len(prefix) > 20
    assert second_cached == second_fresh

    # The second prompt carried the first reply's reasoning inside its think block.
    text = render_chat(conv.messages[:4], reasoning_effort="low", add_generation_prompt=True)
    assert f"<|open|>think<|sep|>{stored['reasoning_content']}<|close|>think<|sep|>" in text
