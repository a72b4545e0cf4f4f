"""Loader: official layout in, bit-exact MXFP4, layer ranges, and clear errors on bad input."""

import copy
import json
import struct

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models import kimi_k3

from kimi_mlx.checkpoint import loader
from kimi_mlx.model.config import ConfigError
from kimi_mlx.checkpoint.loader import CheckpointError, load_model, needed_shards
from kimi_mlx.testing.checkpoints import margins, model_tolerance, rel_err

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def ocp_mxfp4_decode(packed: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """OCP MX v1.0 decode in NumPy: element 2j = low nibble of byte j, 2j+1 = high nibble;
    E2M1 magnitude from bits 0-2, sign bit 3; E8M0 scale 2^(s-127) per 32 elements."""
    lo, hi = packed & 0x0F, packed >> 4
    nib = np.stack([lo, hi], axis=-1).reshape(*packed.shape[:-1], -1)
    mag = np.array(E2M1, dtype=np.float64)[nib & 7]
    val = np.where(nib & 8, -mag, mag)
    scale = np.exp2(scales.astype(np.float64) - 127.0)
    return val * np.repeat(scale, 32, axis=-1)


def test_spec_mxfp4_vector():
    packed = np.array([[0x21, 0x43, 0x65, 0x87, 0xF9] + [0] * 11], dtype=np.uint8)
    got = ocp_mxfp4_decode(packed, np.array([[0x80]], dtype=np.uint8))[0, :10]
    np.testing.assert_array_equal(got, [1, 2, 3, 4, 6, 8, 12, -0.0, -1, -12])


def test_loaded_experts_dequantise_bit_for_bit(tiny_ckpt):
    model, config, _ = load_model(tiny_ckpt)
    arrays = {}
    for f in sorted(tiny_ckpt.glob("*.safetensors")):
        arrays.update(mx.load(str(f)))
    layer = model.layers[1].block_sparse_moe.switch_mlp
    for proj, w in (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2")):
        q = getattr(layer, proj)
        assert q.mode == "mxfp4" and q.bits == 4 and q.group_size == 32
        ours = np.array(mx.dequantize(q.weight, q.scales, mode="mxfp4", group_size=32, bits=4)
                        .astype(mx.float32))
        for e in (0, 5):
            pre = f"language_model.model.layers.1.block_sparse_moe.experts.{e}.{w}"
            want = ocp_mxfp4_decode(np.array(arrays[pre + ".weight_packed"]),
                                    np.array(arrays[pre + ".weight_scale"]))
            np.testing.assert_array_equal(ours[e], want)


def test_dtypes_are_kept_as_stored(tiny_ckpt):
    model, _, _ = load_model(tiny_ckpt)
    attn = model.layers[0].self_attn
    assert attn.q_proj.weight.dtype == mx.bfloat16
    assert attn.q_conv1d.weight.dtype == mx.float32 and attn.A_log.dtype == mx.float32
    assert attn.A_log.shape == (2,)  # first num_heads of the zero-padded [128]
    moe = model.layers[1].block_sparse_moe
    assert moe.gate.e_score_correction_bias.dtype == mx.float32
    assert moe.switch_mlp.gate_proj.weight.dtype == mx.uint32


def test_matches_mlx_lm_kimi_k3_loaded_from_the_same_files(tiny_ckpt):
    """Our loader vs mlx-lm's own kimi_k3 loader (indexer dropped; prompt < index_topk)."""
    ours, config, _ = load_model(tiny_ckpt)
    cfg = copy.deepcopy(config)
    cfg["model_type"] = "kimi_k3"
    ref = kimi_k3.Model(kimi_k3.ModelArgs.from_dict(cfg))
    files = {}
    for f in sorted(tiny_ckpt.glob("*.safetensors")):
        files.update(mx.load(str(f)))
    files = {k: v for k, v in files.items() if ".indexer." not in k}
    files = ref.sanitize(files)
    nn.quantize(ref, group_size=32, bits=4, mode="mxfp4",
                class_predicate=lambda p, m: f"{p}.scales" in files)
    ref.load_weights(list(files.items()), strict=True)
    # Same bf16 values widened to float32 in both, so only the math is compared.
    for m in (ours, ref):
        m.apply(lambda x: x.astype(mx.float32) if mx.issubdtype(x.dtype, mx.floating) else x)
    tokens = mx.array([[1, 2, 3, 4, 5, 6, 7]])  # 7 < index_topk 8: dense
    tol = model_tolerance(ours.args, tokens.shape[1])
    with margins() as m:
        a, b = ours(tokens), ref(tokens)
    m.check(tol)
    assert rel_err(a, b) < tol


def test_layer_range_opens_only_its_shards(tiny_ckpt, monkeypatch):
    opened = []
    real = mx.load
    monkeypatch.setattr(loader.mx, "load", lambda p, *a, **k: opened.append(p) or real(p, *a, **k))
    index = json.loads((tiny_ckpt / "model.safetensors.index.json").read_text())["weight_map"]
    model, _, report = load_model(tiny_ckpt, start=0, end=2)
    want = {index["language_model.model.embed_tokens.weight"]} | {
        f for n, f in index.items() if n.startswith(("language_model.model.layers.0.",
                                                     "language_model.model.layers.1."))}
    assert {p.split("/")[-1] for p in opened} == want == set(report.shards_opened)
    assert len(want) < 3
    assert sorted(want) == needed_shards(tiny_ckpt, 0, 2)
    assert not hasattr(model.text, "norm") and len(model.layers) == 2


def test_missing_shard(ckpt_copy):
    (ckpt_copy / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"model-00002-of-00003.safetensors.*missing"):
        load_model(ckpt_copy)


def test_truncated_shard(ckpt_copy):
    f = ckpt_copy / "model-00003-of-00003.safetensors"
    f.write_bytes(f.read_bytes()[:-1000])
    with pytest.raises(CheckpointError, match=r"00003.*truncated: tensor"):
        load_model(ckpt_copy)


def _rewrite(path, name, array):
    arrays = dict(mx.load(str(path)))
    arrays[name] = array
    mx.save_safetensors(str(path), arrays, metadata={"format": "pt"})


def test_wrong_shape(ckpt_copy):
    name = "language_model.model.layers.0.self_attn.q_proj.weight"
    shard = json.loads((ckpt_copy / "model.safetensors.index.json").read_text())["weight_map"][name]
    _rewrite(ckpt_copy / shard, name, mx.zeros((31, 64), mx.bfloat16))
    with pytest.raises(CheckpointError, match=r"q_proj.weight has shape \[31, 64\], expected \[32, 64\]"):
        load_model(ckpt_copy)


def test_wrong_dtype(ckpt_copy):
    name = "language_model.model.layers.4.self_attn.o_proj.weight"
    shard = json.loads((ckpt_copy / "model.safetensors.index.json").read_text())["weight_map"][name]
    _rewrite(ckpt_copy / shard, name, mx.zeros((64, 32), mx.int32))
    with pytest.raises(CheckpointError, match=r"o_proj.weight has dtype .*int32, expected a float"):
        load_model(ckpt_copy)


def test_missing_tensor_in_index(ckpt_copy):
    p = ckpt_copy / "model.safetensors.index.json"
    index = json.loads(p.read_text())
    del index["weight_map"]["language_model.model.layers.2.self_attn.indexer.wk.weight"]
    p.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"layers.2.self_attn.indexer.wk.weight is missing"):
        load_model(ckpt_copy)


def test_unknown_model_type(ckpt_copy):
    p = ckpt_copy / "config.json"
    cfg = json.loads(p.read_text())
    cfg["model_type"] = "llama"
    p.write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=r"config.json: model_type 'llama' is not a Kimi K3.1"):
        load_model(ckpt_copy)


def test_config_missing_key(ckpt_copy):
    p = ckpt_copy / "config.json"
    cfg = json.loads(p.read_text())
    del cfg["text_config"]["kv_lora_rank"]
    p.write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=r"missing key\(s\) \['kv_lora_rank'\]"):
        load_model(ckpt_copy)


def test_plain_k3_is_refused_with_a_pointer_to_mlx_lm(ckpt_copy):
    p = ckpt_copy / "config.json"
    cfg = json.loads(p.read_text())
    cfg["model_type"] = "kimi_k3"
    del cfg["text_config"]["dsa_config"]
    p.write_text(json.dumps(cfg))
    ip = ckpt_copy / "model.safetensors.index.json"
    index = json.loads(ip.read_text())
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if ".indexer." not in k}
    ip.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="is Kimi K3, not K3.1"):
        load_model(ckpt_copy)


def test_header_length_garbage(ckpt_copy):
    f = ckpt_copy / "model-00001-of-00003.safetensors"
    data = bytearray(f.read_bytes())
    data[:8] = struct.pack("<Q", 1 << 40)
    f.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="00001.*header length"):
        load_model(ckpt_copy)


def test_flat_text_config_float32_files_and_tied_embeddings(tmp_path):
    """A config without `text_config`, F32 tensors on disk, tied lm_head: loads, keeps F32,
    and matches mlx-lm's kimi_k3 on the same files; a last-stage-only model of a tied
    checkpoint carries the embedding as its head."""
    from kimi_mlx.testing.checkpoints import build_checkpoint, tiny_text_config

    path = build_checkpoint(tmp_path / "flat", text_config=tiny_text_config(tie_word_embeddings=True),
                            dtype=mx.float32, seed=4, conditioned=True)
    p = path / "config.json"
    cfg = json.loads(p.read_text())
    flat = dict(cfg["text_config"], model_type="kimi_k31")
    p.write_text(json.dumps(flat))
    ours, config, _ = load_model(path)
    assert "lm_head" not in ours.language_model
    assert ours.layers[0].self_attn.q_proj.weight.dtype == mx.float32
    ref = kimi_k3.Model(kimi_k3.ModelArgs.from_dict(dict(flat, model_type="kimi_k3")))
    files = {}
    for f in sorted(path.glob("*.safetensors")):
        files.update(mx.load(str(f)))
    files = ref.sanitize({k: v for k, v in files.items() if ".indexer." not in k})
    nn.quantize(ref, group_size=32, bits=4, mode="mxfp4",
                class_predicate=lambda p, m: f"{p}.scales" in files)
    ref.load_weights(list(files.items()), strict=True)
    tokens = mx.array([[9, 8, 7, 6, 5]])
    tol = model_tolerance(ours.args, tokens.shape[1])
    with margins() as m:
        a, b = ours(tokens), ref(tokens)
    m.check(tol)
    assert rel_err(a, b) < tol
    last, _, _ = load_model(path, start=4)
    assert "embed_tokens" in last.text and last.text.is_last
