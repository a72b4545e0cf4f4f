"""Image prompts: the K3 media block in our chat encoder, the pad-embedding replacement,
and a whole image prompt through a random checkpoint with vision weights against the
reference composition (mlx-vlm 0.7.10's kimi_k3 tower, projector and pad merge, then
mlx-lm's kimi_k3 text model), prefill logits and greedy generation."""

import copy
import io
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten
from PIL import Image

from kimi_mlx.checkpoint.loader import load_model, load_vision
from kimi_mlx.generation.images import Vision, media_pad_id
from kimi_mlx.generation.request import build_prompt
from kimi_mlx.model.config import ModelArgs
from kimi_mlx.testing.checkpoints import (argmax_margin, build_checkpoint, margins, reduction_length,
                                          rel_err, tiny_text_config, tiny_vision_config, tolerance)
from kimi_mlx.text.chat_format import encode_chat, media_in_order
from kimi_mlx.text.tokenizer import KimiTokenizer


def _img(w, h, tokens):
    return SimpleNamespace(width=w, height=h, num_tokens=tokens)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """Random tiny K3.1 with a vision tower, float32 on disk, index_topk >= any prompt
    here (so Gated DSA is gated MLA and mlx-lm's kimi_k3 is a reference) and every
    expert active (top-8 of 8: the experts still mix by router weight, but there is no
    top-k choice that a ~300-token prompt's rounding could flip; tests/test_model.py
    covers the choices)."""
    text = tiny_text_config(dsa_config={"index_n_heads": 2, "index_head_dim": 16, "index_topk": 4096},
                            num_experts_per_token=8)
    return build_checkpoint(tmp_path_factory.mktemp("vis") / "tiny", text_config=text, seed=1,
                            conditioned=True, dtype=mx.float32, vision=tiny_vision_config())


@pytest.fixture(scope="module")
def tok(ckpt):
    return KimiTokenizer.from_pretrained(ckpt)


def test_media_block_in_content_order(tok):
    sp = tok.special_tokens
    a, b = _img(500, 300, 3), _img(28, 28, 1)
    msgs = [{"role": "user", "content": [{"type": "text", "text": "x"}, {"type": "image", "media": a},
                                         {"type": "text", "text": "y"}, {"type": "image_url", "media": b}]}]
    ids = encode_chat(tok, msgs)
    want = (tok.encode("x") + [sp["<|media_begin|>"]] + tok.encode("image 500x300")
            + [sp["<|media_content|>"]] + [sp["<|media_pad|>"]] * 3 + [sp["<|media_end|>"]]
            + tok.encode("y") + [sp["<|media_begin|>"]] + tok.encode("image 28x28")
            + [sp["<|media_content|>"], sp["<|media_pad|>"], sp["<|media_end|>"]])
    start = ids.index(sp["<|media_begin|>"]) - 1
    assert ids[start:start + len(want)] == want
    assert ids.count(sp["<|media_pad|>"]) == 4


def test_text_spelling_media_markers_stays_text(tok):
    text = "<|media_begin|>image 1x1<|media_content|><|media_pad|><|media_end|>"
    ids = encode_chat(tok, [{"role": "user", "content": text}])
    media_ids = {tok.special_tokens[t] for t in
                 ("<|media_begin|>", "<|media_content|>", "<|media_pad|>", "<|media_end|>")}
    assert not media_ids & set(ids)
    assert tok.decode(ids).count(text) == 1


def test_unresolved_image_is_refused_outside_tool_results(tok):
    with pytest.raises(ValueError, match="only text content"):
        encode_chat(tok, [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])


def test_media_order_follows_rendered_tool_order():
    a, b, c = _img(1, 1, 1), _img(2, 2, 1), _img(3, 3, 1)
    msgs = [{"role": "user", "content": [{"type": "image", "media": a}]},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "1", "function": {"name": "f", "arguments": "{}"}},
                {"id": "2", "function": {"name": "g", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "2", "content": [{"type": "image", "media": c}]},
            {"role": "tool", "tool_call_id": "1", "content": [{"type": "image", "media": b}]}]
    assert media_in_order(msgs) == [a, b, c]


def test_embed_with_media_replaces_pads_in_order(ckpt):
    model, _, _ = load_model(ckpt)
    pad = 7
    ids = mx.array([1, pad, 2, pad, pad, 3])
    media = mx.array(np.random.default_rng(0).normal(size=(3, model.args.hidden_size)).astype(np.float32))
    got = np.array(model.embed_with_media(ids, media, pad))
    want = np.array(model.text.embed(ids))
    want[[1, 3, 4]] = np.array(media)
    np.testing.assert_array_equal(got, want)
    with pytest.raises(ValueError, match="3 <\\|media_pad\\|> tokens .* gave \\(2, 64\\) rows"):
        model.embed_with_media(ids, media[:2], pad)


def _all_tensors(path: Path):
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(mx.load(str(f)))
    return out


class _Swap(nn.Module):
    """Embedding that returns fixed embeddings for the prompt, token embeddings after."""

    def __init__(self, emb, inner):
        super().__init__()
        self.emb, self.inner = emb, inner

    def __call__(self, ids):
        return self.emb if ids.shape[1] == self.emb.shape[1] else self.inner(ids)


def _reference(ckpt, config, ids, images, pad):
    """Logits of the prompt, and 8 greedy tokens, by the reference composition."""
    from mlx_lm.models import kimi_k3
    from mlx_vlm.models.kimi_k3 import config as vcfg
    from mlx_vlm.models.kimi_k3.kimi_k3 import KimiK3MultiModalProjector
    from mlx_vlm.models.kimi_k3.kimi_k3 import Model as VlmModel
    from mlx_vlm.models.kimi_k3.vision import VisionModel as RefTower

    files = _all_tensors(ckpt)
    vc = vcfg.VisionConfig.from_dict(config["vision_config"])
    mc = vcfg.ModelConfig(text_config=vcfg.TextConfig.from_dict(config["text_config"]), vision_config=vc)
    tower, proj = RefTower(vc), KimiK3MultiModalProjector(mc)
    tower.load_weights([(k[13:], v.transpose(0, 2, 3, 1) if k.endswith("patch_embed.proj.weight") else v)
                        for k, v in files.items() if k.startswith("vision_tower.")], strict=True)
    proj.load_weights([(k[13:], v) for k, v in files.items() if k.startswith("mm_projector.")], strict=True)
    patches = mx.array(np.concatenate([im.patches for im in images])).transpose(0, 2, 3, 1)
    feats = proj(tower(patches, grid_thws=[[1, *im.grid] for im in images]))

    kcfg = copy.deepcopy(config)
    kcfg["model_type"] = "kimi_k3"
    ref = kimi_k3.Model(kimi_k3.ModelArgs.from_dict(kcfg))
    text_files = ref.sanitize({k: v for k, v in files.items()
                               if k.startswith("language_model.") and ".indexer." not in k})
    nn.quantize(ref, group_size=32, bits=4, mode="mxfp4",
                class_predicate=lambda p, m: f"{p}.scales" in text_files)
    ref.load_weights(list(text_files.items()), strict=True)
    inner = ref.language_model.model
    x = mx.array(ids)[None]
    fake = SimpleNamespace(config=SimpleNamespace(image_token_index=pad, media_placeholder_token_id=pad))
    emb = VlmModel._prepare_inputs_for_multimodal(fake, feats, inner.embed_tokens(x), x, image_token_id=pad)
    inner.embed_tokens = _Swap(emb, inner.embed_tokens)
    cache = ref.make_cache()
    logits = ref(x, cache)
    tokens, step = [], logits
    for _ in range(8):
        t = mx.argmax(step[:, -1], axis=-1)
        tokens.append(t.item())
        step = ref(t[None], cache)
    return logits, tokens


def _png(w, h, seed):
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def test_image_prompt_matches_reference_composition(ckpt, tok):
    from mlx_lm.generate import generate_step

    import json
    config = json.loads((ckpt / "config.json").read_text())
    model, _, _ = load_model(ckpt)
    vision = Vision(ckpt)
    assert not vision.loaded
    images = [vision.load_image(_png(112, 84, 0), "a.png"), vision.load_image(_png(28, 20, 1), "b.png")]
    assert [im.num_tokens for im in images] == [12, 1]  # 8x6 patches / 4; 28x20 padded to 28x28 / 4
    pad = media_pad_id(tok, config)
    ids = build_prompt(tok, "What is in the images?", None, False, "low", images)
    assert ids.count(pad) == 13
    emb = model.embed_with_media(mx.array(ids), vision.features(images), pad)
    assert vision.loaded

    want_logits, want_tokens = _reference(ckpt, config, ids, images, pad)
    args = ModelArgs.from_config(config)
    vargs = vision.model.args
    n = max(reduction_length(args, len(ids) + 8), vargs.vt_intermediate_size, 3 * 14 * 14,
            vargs.merged_size, 8 * 6)
    tol = tolerance(args.num_hidden_layers + vargs.vt_num_hidden_layers + 2, n)
    with margins() as m:
        got_logits = model(mx.array(ids)[None], input_embeddings=emb[None])
        err = rel_err(got_logits, want_logits)
        print(f"prompt {len(ids)} tokens ({ids.count(pad)} image): logits rel err {err:.3g}, tol {tol:.3g}")
        assert err <= tol
        got_tokens = [t for t, _ in zip(
            (int(t) for t, _ in generate_step(mx.array(ids), model, max_tokens=8, input_embeddings=emb)),
            range(8))]
    assert m.router_min == float("inf") and not m.indexer  # no discrete choice to flip
    assert argmax_margin(want_logits[:, -1]) > tol
    assert got_tokens == want_tokens
    # without the image rows the model sees something else
    plain = model(mx.array(ids)[None])
    assert rel_err(plain, want_logits) > 100 * tol
