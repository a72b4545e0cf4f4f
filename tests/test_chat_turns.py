"""`kimi-mlx chat` across turns: the cache holds exactly `conversation.processed`, and the
next turn served from it equals a fresh prefill of the whole conversation, whichever way
the previous turn ended (EOS, --max-tokens, Ctrl-C, the context)."""

import mlx.core as mx
import pytest
from mlx_lm.sample_utils import make_sampler

from kimi_mlx.commands.chat import Conversation, chat_turn
from kimi_mlx.text.chat_format import encode_chat
from kimi_mlx.model.dsa import DSACache
from kimi_mlx.generation.generate import InputError, default_model
from kimi_mlx.checkpoint.loader import load_for_generation
from kimi_mlx.generation.turn_cache import checkpoint, rollback, tokens_in_cache

GREEDY = make_sampler(0.0)


@pytest.fixture(scope="module")
def micro():
    """The shipped trained micro checkpoint: (model, mlx-lm wrapper, KimiTokenizer)."""
    model, wrapper, tok, _ = load_for_generation(str(default_model()))
    return model, wrapper, tok


def scripted(ids):
    """A sampler that emits `ids` in order, then the greedy token."""
    queue = list(ids)

    def sample(logprobs):
        return mx.array([queue.pop(0)]) if queue else mx.argmax(logprobs, axis=-1)

    return sample


def dsa_offsets(cache):
    return [c.offset for c in cache if isinstance(c, DSACache)]


def assert_cache_holds_processed(conv):
    offsets = dsa_offsets(conv.cache)
    assert offsets and offsets == [len(conv.processed)] * len(offsets)


def logits_gap(model, conv, follow):
    """Max |logits| difference between feeding `follow` on top of `conv.cache` and a
    fresh prefill of `conv.processed + follow`, and the logits' scale. Leaves the cache
    as it found it."""
    mark = checkpoint(conv.cache)
    reused = model(mx.array([follow]), cache=conv.cache)
    rollback(conv.cache, mark)
    fresh = model(mx.array([conv.processed + follow]), cache=model.make_cache())
    fresh = fresh[:, len(conv.processed):]
    return mx.abs(reused - fresh).max().item(), mx.abs(fresh).max().item()


# Prefilling the same ids in one chunk or in two differs by rounding only (the KDA scan
# and the attention reductions sum in another order). The micro model's weights are bf16
# but it computes in float32 (eps 2**-23 ~ 1.2e-7); over its 6 layers the measured gap is
# about 1e-6 of the logits' scale, so 2**-12 (~2.4e-4) leaves a 200x margin. One token
# fed twice (the bug this guards) moves the logits by ~0.2 of their scale.
REL_TOL = 2 ** -12


def check_next_turn_is_exact(model, tok, conv, text="and then?"):
    """The next turn's prompt extends the cache's ids, and serving it from the cache
    gives the fresh-prefill logits."""
    ids = encode_chat(tok, conv.messages + [{"role": "user", "content": text}], "low")
    n = len(conv.processed)
    assert ids[:n] == conv.processed and len(ids) > n
    gap, scale = logits_gap(model, conv, ids[n:])
    assert gap <= REL_TOL * scale, (gap, scale)


def test_length_stop_then_exact_second_turn(micro):
    model, wrapper, tok = micro
    conv = Conversation("be brief")
    chat_turn(model, wrapper, tok, conv, "Hello", "low", GREEDY, 5, 4096)
    prompt = encode_chat(tok, conv.messages[:2], "low")
    assert len(conv.processed) == len(prompt) + 5
    assert_cache_holds_processed(conv)
    check_next_turn_is_exact(model, tok, conv)
    before = len(conv.processed)
    chat_turn(model, wrapper, tok, conv, "and then?", "low", GREEDY, 4, 4096)
    assert conv.reused_tokens == before
    assert_cache_holds_processed(conv)
    check_next_turn_is_exact(model, tok, conv, "third")


def test_eos_stop_then_exact_second_turn(micro):
    model, wrapper, tok = micro
    sp = tok.special_tokens
    open_, close, sep, eom = sp["<|open|>"], sp["<|close|>"], sp["<|sep|>"], sp["<|end_of_msg|>"]
    reply = ([close] + tok.encode("think") + [sep, open_] + tok.encode("response") + [sep]
             + tok.encode("Hi there") + [close] + tok.encode("response") + [sep, close]
             + tok.encode("message") + [sep, eom])
    conv = Conversation()
    out = chat_turn(model, wrapper, tok, conv, "Hello", "low", scripted(reply), 100, 4096)
    assert out == {"reasoning_content": "", "content": "Hi there", "tool_calls": []}
    prompt = encode_chat(tok, conv.messages[:1], "low")
    assert conv.processed == prompt + reply  # the EOS token is in the cache
    assert_cache_holds_processed(conv)
    check_next_turn_is_exact(model, tok, conv)
    chat_turn(model, wrapper, tok, conv, "and then?", "low", GREEDY, 3, 4096)
    assert conv.reused_tokens == len(prompt) + len(reply)
    assert_cache_holds_processed(conv)


def test_ctrl_c_mid_reply_rolls_the_turn_back(micro):
    model, wrapper, tok = micro
    conv = Conversation()
    chat_turn(model, wrapper, tok, conv, "Hello", "low", GREEDY, 4, 4096)
    messages, processed, cache = list(conv.messages), list(conv.processed), conv.cache

    calls = []

    def interrupted(logprobs):  # Ctrl-C inside mlx-lm's loop, after the model advanced
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return mx.argmax(logprobs, axis=-1)

    with pytest.raises(KeyboardInterrupt):
        chat_turn(model, wrapper, tok, conv, "second", "low", interrupted, 20, 4096)
    assert conv.messages == messages and conv.processed == processed and conv.cache is cache
    assert_cache_holds_processed(conv)
    check_next_turn_is_exact(model, tok, conv, "second")

    def on_text(channel, text):  # Ctrl-C while the reply is printed
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        chat_turn(model, wrapper, tok, conv, "second", "low", GREEDY, 20, 4096, on_text=on_text)
    assert conv.messages == messages and conv.processed == processed
    assert_cache_holds_processed(conv)
    chat_turn(model, wrapper, tok, conv, "second", "low", GREEDY, 3, 4096)
    assert conv.reused_tokens == len(processed)
    assert_cache_holds_processed(conv)

    fresh = Conversation()
    with pytest.raises(KeyboardInterrupt):
        chat_turn(model, wrapper, tok, fresh, "Hello", "low", GREEDY, 20, 4096, on_text=on_text)
    assert fresh.cache is None and fresh.processed == [] and fresh.messages == []


def test_turn_that_fills_the_context(micro, capsys):
    model, wrapper, tok = micro
    conv = Conversation()
    prompt = encode_chat(tok, [{"role": "user", "content": "Hello"}], "low")
    context = len(prompt) + 3
    chat_turn(model, wrapper, tok, conv, "Hello", "low", GREEDY, -1, context)
    assert "reply cut at the context" in capsys.readouterr().err
    assert len(conv.processed) == context
    assert_cache_holds_processed(conv)
    check_next_turn_is_exact(model, tok, conv)
    state = (list(conv.messages), list(conv.processed))
    with pytest.raises(InputError, match="over the context"):
        chat_turn(model, wrapper, tok, conv, "more", "low", GREEDY, 5, context)
    assert (conv.messages, conv.processed) == state
    assert_cache_holds_processed(conv)


def test_tokens_in_cache_rule_matches_mlx_lm_generation_loops(micro):
    """The rule against what mlx-lm's loops leave in a cache, plain and speculative. A tiny
    random mlx-lm llama stands in (speculative decoding needs trimmable caches); as its own
    draft every draft is accepted, with another draft most are rejected, and max_tokens
    cuts rounds at each position, so runs end on draft and on main-model tokens."""
    from mlx_lm.generate import stream_generate
    from mlx_lm.models import llama
    from mlx_lm.models.cache import make_prompt_cache

    _, wrapper, tok = micro

    def tiny(seed):
        mx.random.seed(seed)
        m = llama.Model(llama.ModelArgs(
            model_type="llama", hidden_size=32, num_hidden_layers=2, intermediate_size=64,
            num_attention_heads=2, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=len(tok)))
        mx.eval(m.parameters())
        return m

    main, other = tiny(0), tiny(1)
    prompt = tok.encode("hello world, this is a prompt")
    ends = set()
    for max_tokens in (1, 2, 3, 4, 5, 7):
        cache = make_prompt_cache(main)
        rs = list(stream_generate(main, wrapper, prompt, max_tokens=max_tokens, prompt_cache=cache))
        assert cache[0].offset == len(tokens_in_cache(prompt, [r.token for r in rs]))
        for draft in (main, other):
            cache = make_prompt_cache(main) + make_prompt_cache(draft)
            rs = list(stream_generate(main, wrapper, prompt, max_tokens=max_tokens, draft_model=draft,
                                      num_draft_tokens=2, prompt_cache=cache))
            held = tokens_in_cache(prompt, [r.token for r in rs], speculative=True,
                                   last_from_draft=rs[-1].from_draft)
            assert cache[0].offset == len(held), (max_tokens, [r.from_draft for r in rs])
            ends.add(rs[-1].from_draft)
    assert ends == {True, False}
    assert tokens_in_cache([1, 2], [3, 4], speculative=True, last_from_draft=False) == [1, 2, 3]
