"""`kimi-mlx chat`: preserved thinking across turns and exact cache reuse."""

import mlx.core as mx
from mlx_lm.sample_utils import make_sampler

from kimi_mlx.commands.chat import Conversation, chat_turn
from kimi_mlx.text.chat_format import encode_chat, render_chat
from kimi_mlx.checkpoint.loader import load_for_generation


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


def _repl(tiny_ckpt, monkeypatch, capsys, lines, turn=None):
    """Run `kimi-mlx chat` on stdin `lines`; `turn` replaces chat_turn when given."""
    import io

    from kimi_mlx.commands import chat as chat_cli, main as cli

    if turn is not None:
        monkeypatch.setattr(chat_cli, "chat_turn", turn)
    monkeypatch.setattr("sys.stdin", io.StringIO("".join(l + "\n" for l in lines)))
    rc = cli.main(["chat", "--model", str(tiny_ckpt), "--max-tokens", "3"])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_repl_commands_answer_and_unknown_ones_are_not_sent(tiny_ckpt, monkeypatch, capsys):
    sent = []
    rc, _, err = _repl(tiny_ckpt, monkeypatch, capsys,
                       ["/foo bar", "/effort low", "/effort medium", "/reset", "/exit", "never"],
                       turn=lambda *a, **k: sent.append(a[4]))
    assert rc == 0 and sent == []
    assert "unknown command /foo" in err
    assert "[thinking effort: low]" in err
    assert "/effort takes one of low, high, max (now low)" in err
    assert "[conversation reset]" in err


def test_ctrl_c_during_a_reply_drops_that_turn_and_the_chat_goes_on(tiny_ckpt, monkeypatch, capsys):
    """The interrupted turn's user message is dropped and the cache rolled back; the next
    turn is answered from a conversation without it."""
    from kimi_mlx.commands import chat as chat_cli

    real, seen = chat_cli.chat_turn, []

    def ctrl_c(logprobs):
        raise KeyboardInterrupt

    def turn(model, wrapper, tok, conv, text, effort, sampler, *a, **k):
        real(model, wrapper, tok, conv, text, effort, ctrl_c if text == "first" else sampler, *a, **k)
        seen.append(([m["content"] for m in conv.messages if m["role"] == "user"], conv.reused_tokens))

    rc, _, err = _repl(tiny_ckpt, monkeypatch, capsys, ["first", "second"], turn=turn)
    assert rc == 0
    assert "[interrupted: reply discarded]" in err
    assert seen == [(["second"], 0)]


def test_help_lists_the_commands(tiny_ckpt, monkeypatch, capsys):
    rc, _, err = _repl(tiny_ckpt, monkeypatch, capsys, ["/help"], turn=lambda *a, **k: None)
    assert rc == 0 and "unknown command" not in err
    for command in ("/help", "/reset", "/effort low|high|max", "/exit", "Ctrl-D", "Ctrl-C"):
        assert err.count(command) >= 2, command  # the banner and the /help list


def test_num_draft_tokens_without_a_draft_is_an_error(capsys):
    """Not silently ignored: the flag only means something with --draft-model."""
    from kimi_mlx.commands.main import main

    assert main(["chat", "--num-draft-tokens", "5"]) == 2
    assert "--num-draft-tokens needs --draft-model" in capsys.readouterr().err


def test_a_resumed_conversation_continues_from_the_cache_on_disk(tiny_ckpt, monkeypatch, capsys, tmp_path):
    """`chat --conversation F --prompt-cache-dir D`, quit, started again: the next turn
    reads the conversation's cache back from disk (told on stderr) and replies what the
    same resumed conversation replies without any cache."""
    import io
    import shutil

    from kimi_mlx.commands import main as cli

    def run(lines, *flags):
        monkeypatch.setattr("sys.stdin", io.StringIO("".join(l + "\n" for l in lines)))
        rc = cli.main(["chat", "--model", str(tiny_ckpt), "--max-tokens", "6",
                       "--system-prompt", "You explain the Python standard library. " * 8, *flags])
        out = capsys.readouterr()
        assert rc == 0, out.err
        return out.out, out.err

    conv, disk = str(tmp_path / "conv.json"), ["--prompt-cache-dir", str(tmp_path / "pc")]
    run(["What is functools.partial?"], "--conversation", conv, *disk)
    shutil.copy(conv, tmp_path / "copy.json")
    got, err = run(["And reduce?"], "--conversation", conv, *disk)
    assert "[resumed 3 messages" in err and "prompt tokens from the cache on disk]" in err
    want, err = run(["And reduce?"], "--conversation", str(tmp_path / "copy.json"))
    assert "from the cache on disk" not in err
    assert got == want
