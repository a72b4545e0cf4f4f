"""`kimi-mlx generate --image` end to end on a random checkpoint with vision weights:
the streamed text equals a cache-free greedy reference over the same image embeddings,
the prompt's token count is the rule's, and each error names what is wrong."""

import io

import mlx.core as mx
import numpy as np
import pytest
from PIL import Image

from kimi_mlx.checkpoint.loader import load_model
from kimi_mlx.commands.main import main
from kimi_mlx.generation.images import Vision
from kimi_mlx.generation.request import build_prompt
from kimi_mlx.testing.checkpoints import (argmax_margin, build_checkpoint, model_tolerance,
                                          tiny_text_config, tiny_vision_config)
from kimi_mlx.text.reply_parse import ReplyStream
from kimi_mlx.text.tokenizer import KimiTokenizer
from kimi_mlx.vision.preprocess import token_count


@pytest.fixture(scope="module")
def vckpt(tmp_path_factory):
    # every expert active: no routing near-ties between the cached and uncached decode
    text = tiny_text_config(num_experts_per_token=8)
    return build_checkpoint(tmp_path_factory.mktemp("vcli") / "tiny", text_config=text, seed=2,
                            conditioned=True, vision=tiny_vision_config())


def _write(path, w, h, seed, fmt="PNG"):
    arr = np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)
    Image.fromarray(arr).save(path, fmt)
    return path


def _run(argv, capsys):
    code = main(argv)
    cap = capsys.readouterr()
    return code, cap.out, cap.err


def _greedy_reference(model, vision, tok, ids, images, n):
    """Greedy tokens by a full forward over [prompt embeddings (images in) + generated
    tokens' embeddings] at every step (no cache)."""
    pad = tok.special_tokens["<|media_pad|>"]
    prompt = model.embed_with_media(mx.array(ids), vision.features(images), pad)
    tol = model_tolerance(model.args, len(ids) + n)
    out = []
    for _ in range(n):
        emb = mx.concatenate([prompt, model.text.embed(mx.array(out, mx.int32))]) if out else prompt
        logits = model(mx.array([ids + out]), input_embeddings=emb[None])
        assert argmax_margin(logits[0, -1]) >= tol, "near tie in the greedy token"
        out.append(int(mx.argmax(logits[0, -1]).item()))
    return out


def test_generate_with_two_images(vckpt, tmp_path, capsys):
    a = _write(tmp_path / "a.png", 112, 84, 0)
    b = _write(tmp_path / "b.jpg", 60, 30, 1, "JPEG")
    prompt = "Compare the pictures."
    code, out, err = _run(["generate", "--model", str(vckpt), "--prompt", prompt, "--image", str(a),
                           "--image", str(b), "--max-tokens", "6", "--reasoning-effort", "low"], capsys)
    assert code == 0, err
    tok = KimiTokenizer.from_pretrained(vckpt)
    # prompt tokens by the rule: text prompt + per image begin/content/end + "image WxH" + pads
    text_only = build_prompt(tok, prompt, None, False, "low")
    want_n = len(text_only) + sum(3 + len(tok.encode(f"image {w}x{h}")) + token_count(w, h)
                                  for w, h in ((112, 84), (60, 30)))
    assert token_count(112, 84) == 12 and token_count(60, 30) == 6
    assert f"Prompt: {want_n} tokens" in out
    model, _, _ = load_model(vckpt, verbose=False)
    vision = Vision(vckpt)
    images = [vision.load_image(a), vision.load_image(b)]
    ids = build_prompt(tok, prompt, None, False, "low", images)
    assert len(ids) == want_n
    want = _greedy_reference(model, vision, tok, ids, images, 6)
    eos = set(tok.eos_token_ids)
    if any(t in eos for t in want):
        want = want[: next(i for i, t in enumerate(want) if t in eos)]
    stream = ReplyStream()
    events = stream.feed(tok.decode(want)) + stream.finish()
    assert out.split("=" * 10)[1].strip("\n") == "".join(t for _, t in events)


def test_generate_image_errors(vckpt, tiny_ckpt, tmp_path, capsys):
    good = _write(tmp_path / "ok.png", 28, 28, 0)
    text_only = build_checkpoint(tmp_path / "text", extras=False)
    code, _, err = _run(["generate", "--model", str(text_only), "--prompt", "hi", "--image", str(good)], capsys)
    assert code == 2 and "has no vision weights" in err and "cannot take --image" in err
    (tmp_path / "bad.png").write_bytes(b"\x89PNG\r\n\x1a\nnot really")
    code, _, err = _run(["generate", "--model", str(vckpt), "--prompt", "hi", "--image",
                         str(tmp_path / "bad.png")], capsys)
    assert code == 2 and "bad.png: corrupt or truncated image" in err
    code, _, err = _run(["generate", "--model", str(vckpt), "--prompt", "hi", "--image",
                         str(tmp_path / "missing.png")], capsys)
    assert code == 2 and "missing.png: cannot read the image file" in err
    code, _, err = _run(["generate", "--model", str(vckpt), "--prompt", "hi", "--image", str(good),
                         "--ignore-chat-template"], capsys)
    assert code == 2 and "--image needs the chat encoding" in err
    code, _, err = _run(["generate", "--model", str(vckpt), "--prompt", "hi", "--image", str(good),
                         "--max-kv-size", "100"], capsys)
    assert code == 2 and "image(s) take 1 of the prompt's tokens" in err


def test_chat_image_turn_then_text_turn_reuses_the_cache(vckpt, tmp_path):
    """Turn 1 carries an image, turn 2 only text: with the cache reused (turn 2 feeds only
    its new tokens) the replies equal those of a fresh prefill of the whole conversation.
    Replies are greedy over the letters a-z only, so that they re-encode to the same ids
    (a random model's bytes are rarely valid UTF-8) and the cache can be reused."""
    from kimi_mlx.checkpoint.loader import load_for_generation
    from kimi_mlx.commands.chat import Conversation, chat_turn

    model, wrapper, tok, _ = load_for_generation(str(vckpt))
    vision = Vision(vckpt)
    image = vision.load_image(_write(tmp_path / "c.png", 56, 56, 3))

    def greedy(logprobs):  # byte-level vocabulary: ids 97..122 are a..z
        return mx.argmax(logprobs[:, 97:123], axis=-1) + 97

    def two_turns(reuse):
        conv = Conversation()
        chat_turn(model, wrapper, tok, conv, "What is this?", "low", greedy, 4, 4096,
                  reuse_cache=reuse, images=[image], vision=vision)
        chat_turn(model, wrapper, tok, conv, "And the colours?", "low", greedy, 4, 4096,
                  reuse_cache=reuse, vision=vision)
        return conv

    reused, fresh = two_turns(True), two_turns(False)
    assert reused.reused_tokens > 0 and fresh.reused_tokens == 0
    assert reused.processed == fresh.processed
    assert reused.messages[1] == fresh.messages[1]
    assert reused.messages[3] == fresh.messages[3]
    # four turns, three of them prefilling the image (the fresh ones from the tower's
    # cached rows): the tower ran once
    assert vision.stats()["tower_runs"] == 1 and vision.stats()["cache_hits"] == 2


def test_chat_image_command(vckpt, tmp_path, monkeypatch, capsys):
    """`/image PATH` attaches to the next message only; errors name the file; a
    checkpoint without vision weights says so."""
    import io as _io

    from kimi_mlx.commands import chat as chat_cli

    seen = []
    monkeypatch.setattr(chat_cli, "chat_turn", lambda *a, **k: seen.append(
        (a[4], [(im.width, im.height) for im in k["images"]], k["vision"] is not None)))
    pic = _write(tmp_path / "p.png", 100, 50, 0)
    lines = [f"/image {pic}", f"/image {tmp_path / 'nope.png'}", "look", "again", "/exit"]
    monkeypatch.setattr("sys.stdin", _io.StringIO("".join(l + "\n" for l in lines)))
    assert main(["chat", "--model", str(vckpt)]) == 0
    err = capsys.readouterr().err
    assert f"[image {pic}: 100x50, {token_count(100, 50)} tokens" in err
    assert "nope.png: cannot read the image file" in err
    assert seen == [("look", [(100, 50)], True), ("again", [], True)]

    text_only = build_checkpoint(tmp_path / "t", extras=False)
    monkeypatch.setattr("sys.stdin", _io.StringIO(f"/image {pic}\n/exit\n"))
    assert main(["chat", "--model", str(text_only)]) == 0
    assert "has no vision weights" in capsys.readouterr().err
