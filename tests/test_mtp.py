"""`--draft mtp`: a checkpoint's own MTP layers as the speculative draft.

References are independent of `kimi_mlx.speculative.mtp`: a NumPy float64 computation of the MTP
forward straight from the checkpoint's tensors (MXFP4 experts decoded by hand, DSA top-k
by a loop), mlx-lm's `generate_step` for plain greedy output, a plain token-by-token
decode for the target's caches, and one uncached pass over the final sequence for the
MTP's cache.
"""

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import ArraysCache
from mlx_lm.sample_utils import make_sampler

from kimi_mlx.model.cache import DSACache
from kimi_mlx.checkpoint.loader import load_model
from kimi_mlx.speculative.mtp import MTP, load_mtp, mtp_generate_step, target_forward
from kimi_mlx.checkpoint.shards import CheckpointError
from kimi_mlx.speculative.loop import SpecStats
from kimi_mlx.testing.checkpoints import (build_checkpoint, margins, model_tolerance, reduction_length,
                              rel_err, tolerance)

N = 6  # tiny_text_config's num_hidden_layers: the MTP layer is layers.6
PRE = f"language_model.model.layers.{N}."


@pytest.fixture(scope="module")
def mtp_ckpt(tmp_path_factory):
    """The tiny checkpoint (seed 0, conditioned) plus one MTP layer (num_nextn_predict_layers 1)."""
    return build_checkpoint(tmp_path_factory.mktemp("mtp") / "tiny-mtp", seed=0,
                            conditioned=True, mtp_layers=1)


@pytest.fixture(scope="module")
def loaded(mtp_ckpt):
    model, _, report = load_model(mtp_ckpt, verbose=False)
    return model, load_mtp(mtp_ckpt, model), report


# ---------------------------------------------------------------------------- loading


def test_trunk_loads_unchanged_and_the_mtp_layer_on_request(mtp_ckpt, tiny_ckpt, loaded):
    model, mtp, report = loaded
    index = json.loads((mtp_ckpt / "model.safetensors.index.json").read_text())["weight_map"]
    mtp_names = [n for n in index if n.startswith(PRE)]
    assert report.skipped["mtp"] == len(mtp_names) > 20  # the whole layer, experts included
    plain, _, _ = load_model(tiny_ckpt, verbose=False)  # same seed, no MTP layer
    ours, want = dict(tree_flatten(model.parameters())), dict(tree_flatten(plain.parameters()))
    assert ours.keys() == want.keys()
    assert all(mx.array_equal(ours[k], want[k]).item() for k in want)
    params = dict(tree_flatten(mtp.parameters()))
    assert all(k.startswith(PRE) for k in params)
    for k in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
              "block_sparse_moe.switch_mlp.gate_proj.scales", "self_attn.indexer.wk.weight"):
        assert PRE + k in params
    assert params[PRE + "block_sparse_moe.switch_mlp.gate_proj.weight"].dtype == mx.uint32
    assert mtp.mtp_layers[0].block_sparse_moe.switch_mlp.gate_proj.mode == "mxfp4"


def test_a_checkpoint_without_mtp_layers_is_refused_naming_it_and_the_key(tiny_ckpt):
    with pytest.raises(CheckpointError) as e:
        load_mtp(tiny_ckpt)
    assert str(tiny_ckpt) in str(e.value) and "num_nextn_predict_layers" in str(e.value)


def test_a_missing_mtp_tensor_is_named(mtp_ckpt, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(mtp_ckpt, bad)
    idx = bad / "model.safetensors.index.json"
    data = json.loads(idx.read_text())
    del data["weight_map"][PRE + "hnorm.weight"]
    idx.write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match=r"layers\.6\.hnorm\.weight is missing"):
        load_mtp(bad)


# ------------------------------------------------------------- forward vs reference

LUT = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def np_mxfp4(packed: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """K31_SPEC.md section 2: element 2j is the low nibble of byte j; E2M1 with bit 3 the
    sign; one E8M0 scale 2^(s-127) per 32 elements."""
    codes = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(packed.shape[0], -1)
    vals = LUT[codes & 7] * np.where(codes & 8, -1.0, 1.0)
    return vals * np.repeat(2.0 ** (scale.astype(np.float64) - 127), 32, axis=1)


def np_rms(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def np_situ(g, u):
    return 4 * np.tanh(g / 4) / (1 + np.exp(-g)) * 25 * np.tanh(u / 25)


def checkpoint_arrays(ckpt):
    """Every tensor of the checkpoint as float64 (uint8 stays uint8), read from the shards."""
    out = {}
    for f in sorted(ckpt.glob("model-*.safetensors")):
        for k, v in mx.load(str(f)).items():
            out[k] = np.array(v) if v.dtype == mx.uint8 else np.array(v.astype(mx.float32), np.float64)
    return out


def np_mtp(W, args, hidden, tokens, swap=False):
    """The MTP forward of DeepSeek-V3 / vLLM `deepseek_mtp.py` over T pairs from an empty
    cache, written out: returns (y [T, d], logits [T, V]). swap: the other concat order."""
    P = {k[len(PRE):]: v for k, v in W.items() if k.startswith(PRE)}
    eps = args.rms_norm_eps
    e = np_rms(W["language_model.model.embed_tokens.weight"][tokens], P["enorm.weight"], eps)
    h = np_rms(hidden, P["hnorm.weight"], eps)
    x = np.concatenate([h, e] if swap else [e, h], -1) @ P["eh_proj.weight"].T
    a = np_rms(x, P["input_layernorm.weight"], eps)
    y = x + np_dsa(P, args, a)
    b = np_rms(y, P["post_attention_layernorm.weight"], eps)
    y = y + np_moe(P, args, b)
    logits = np_rms(y, P["shared_head.norm.weight"], eps) @ W["language_model.lm_head.weight"].T
    return y, logits


def np_dsa(P, args, x):
    T = x.shape[0]
    H, nope, rope, vd, r = (args.num_attention_heads, args.qk_nope_head_dim,
                            args.qk_rope_head_dim, args.v_head_dim, args.kv_lora_rank)
    qr = np_rms(x @ P["self_attn.q_a_proj.weight"].T, P["self_attn.q_a_layernorm.weight"], 1e-6)
    q = (qr @ P["self_attn.q_b_proj.weight"].T).reshape(T, H, nope + rope)
    ckv = x @ P["self_attn.kv_a_proj_with_mqa.weight"].T
    c = np_rms(ckv[:, :r], P["self_attn.kv_a_layernorm.weight"], 1e-6)
    kpe = ckv[:, r:]
    kvb = (c @ P["self_attn.kv_b_proj.weight"].T).reshape(T, H, nope + vd)
    qi = (qr @ P["self_attn.indexer.wq_b.weight"].T).reshape(T, args.index_n_heads, -1)
    ki = x @ P["self_attn.indexer.wk.weight"].T
    ki = ((ki - ki.mean(-1, keepdims=True)) / np.sqrt(ki.var(-1, keepdims=True) + args.rms_norm_eps)
          * P["self_attn.indexer.k_norm.weight"] + P["self_attn.indexer.k_norm.bias"])
    hw = x @ P["self_attn.indexer.weights_proj.weight"].T
    out = np.zeros((T, H, vd))
    for t in range(T):
        score = [(hw[t] * np.maximum(qi[t] @ ki[s], 0)).sum() for s in range(t + 1)]
        keep = np.argsort(-np.array(score), kind="stable")[: min(args.index_topk, t + 1)]
        for hd in range(H):
            s = (kvb[keep, hd, :nope] @ q[t, hd, :nope] + kpe[keep] @ q[t, hd, nope:])
            p = np.exp((s - s.max()) / np.sqrt(nope + rope))
            out[t, hd] = (p / p.sum()) @ kvb[keep, hd, nope:]
    gate = 1 / (1 + np.exp(-(x @ P["self_attn.g_proj.weight"].T)))
    return (out.reshape(T, H * vd) * gate) @ P["self_attn.o_proj.weight"].T


def np_moe(P, args, x):
    m = "block_sparse_moe."
    s = 1 / (1 + np.exp(-(x @ P[m + "gate.weight"].T)))
    choice = s + P[m + "gate.e_score_correction_bias"]
    z = x @ P[m + "routed_expert_down_proj.weight"].T
    y = np.zeros_like(z)
    for t in range(x.shape[0]):
        top = np.argsort(-choice[t])[: args.num_experts_per_token]
        w = s[t, top] / s[t, top].sum() * args.routed_scaling_factor
        for wk, e in zip(w, top):
            ex = {j: np_mxfp4(P[f"{m}experts.{e}.{j}.weight_packed"],
                              P[f"{m}experts.{e}.{j}.weight_scale"]) for j in ("w1", "w2", "w3")}
            y[t] += wk * (np_situ(z[t] @ ex["w1"].T, z[t] @ ex["w3"].T) @ ex["w2"].T)
    y = np_rms(y, P[m + "routed_expert_norm.weight"], args.rms_norm_eps)
    y = y @ P[m + "routed_expert_up_proj.weight"].T
    sh = m + "shared_experts."
    g, u = x @ P[sh + "gate_proj.weight"].T, x @ P[sh + "up_proj.weight"].T
    return y + np_situ(g, u) @ P[sh + "down_proj.weight"].T


def test_mtp_forward_matches_a_numpy_reference_from_the_checkpoint(mtp_ckpt, loaded):
    model, mtp, _ = loaded
    args = model.args
    T = 13  # past index_topk (8): the sparse path, in prefill and in decode
    prompt = [(11 * i + 5) % 256 for i in range(T + 1)]
    hidden, _ = target_forward(model, mx.array(prompt[:-1])[None], None)
    pairs = np.array(prompt[1:])
    W = checkpoint_arrays(mtp_ckpt)
    y_ref, logits_ref = np_mtp(W, args, np.array(hidden[0], np.float64), pairs)
    tol = tolerance(2, reduction_length(args, T))  # eh_proj + one layer, then the head
    with margins() as m:
        y1, l1 = mtp.step(hidden, mx.array(pairs)[None], DSACache())  # one call
        cache = DSACache()
        outs = [mtp.step(hidden[:, :5], mx.array(pairs[:5])[None], cache)]
        for t in range(5, T):  # then one pair at a time, as drafting does
            outs.append(mtp.step(hidden[:, t : t + 1], mx.array(pairs[t : t + 1])[None], cache))
        y2 = mx.concatenate([o[0] for o in outs], axis=1)
        l2 = mx.concatenate([o[1] for o in outs], axis=1)
        mx.eval(y1, l1, y2, l2)
    m.check(tol, need_indexer=True)
    for y, lg in ((y1, l1), (y2, l2)):
        assert rel_err(y[0], y_ref) < tol and rel_err(lg[0], logits_ref) < tol
    # the test sees the concat order: the other one is far off
    _, swapped = np_mtp(W, args, np.array(hidden[0], np.float64), pairs, swap=True)
    assert rel_err(l1[0], swapped) > 100 * tol


# ---------------------------------------------------------------------- the loop


def plain_greedy(model, prompt, n):
    gen = generate_step(mx.array(prompt), model, max_tokens=n, sampler=make_sampler(0.0))
    return [int(t) for t, _ in gen]


class Oracle:
    """Replaces the MTP's logits with a fixed sequence's token two ahead (wrong at every
    third position), keeping its real forward and cache: drafts that are accepted and
    rejected, whatever the random MTP weights predict."""

    def __init__(self, mtp, seq, vocab):
        self.real, self.seq, self.vocab = mtp.step, seq, vocab

    def __call__(self, hidden, tokens, cache):
        y, _ = self.real(hidden, tokens, cache)
        L = tokens.shape[1]
        want = []
        for j in range(cache.offset - L, cache.offset):
            t = self.seq[j + 2] if j + 2 < len(self.seq) else 0
            want.append((t + 1) % 256 if j % 3 == 1 else t)
        return y, 10.0 * mx.eye(self.vocab)[mx.array(want)][None]


@pytest.mark.parametrize("plen,ks", [(5, (1, 3)), (13, (2, 4))])  # prompt within / past
def test_greedy_mtp_equals_plain_greedy(loaded, plen, ks, monkeypatch):  # index_topk (8)
    model, mtp, _ = loaded
    prompt = [(7 * i + 3) % 250 for i in range(plen)]
    want = plain_greedy(model, prompt, 18)
    # the real (random) MTP: its drafts are all rejected
    assert [t for t, _, _ in mtp_generate_step(prompt, model, mtp, num_draft_tokens=ks[1],
                                               max_tokens=8)] == want[:8]
    monkeypatch.setattr(mtp, "step", Oracle(mtp, prompt + want, model.args.vocab_size))
    steps = []  # (k, accepted) per verify step
    for k in ks:
        stats = SpecStats()
        got = [t for t, _, _ in mtp_generate_step(prompt, model, mtp, num_draft_tokens=k,
                                                  max_tokens=12, stats=stats)]
        assert got == want[:12], k
        steps += [(k, n) for n in stats.per_step]
    # partly accepted steps (rollbacks inside the drafts) and wholly accepted ones
    assert any(0 < n < k for k, n in steps) and any(n == k for k, n in steps), steps


def test_greedy_mtp_with_auto_k_equals_plain_greedy(loaded, monkeypatch):
    """--num-draft-tokens auto: k changes step to step, the output stays plain greedy."""
    from kimi_mlx.speculative.auto_k import AutoK

    model, mtp, _ = loaded
    prompt = [(7 * i + 3) % 250 for i in range(13)]
    want = plain_greedy(model, prompt, 16)
    monkeypatch.setattr(mtp, "step", Oracle(mtp, prompt + want, model.args.vocab_size))
    auto = AutoK(4, explore_every=2)
    got = [t for t, _, _ in mtp_generate_step(prompt, model, mtp, num_draft_tokens=auto,
                                              max_tokens=16)]
    assert got == want
    assert len({k for k in auto.ks if k}) >= 2, auto.ks


def cache_arrays(c):
    if isinstance(c, ArraysCache):
        return {"conv": c[0], "state": c[1]}
    n = c.offset
    return {"offset": mx.array(n), "latent": c.keys[..., :n, :], "k_pe": c.values[..., :n, :],
            "index_keys": c.index_keys[..., :n, :]}


def assert_caches_close(got, want, tol):
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        a, b = cache_arrays(a), cache_arrays(b)
        assert a.keys() == b.keys()
        for k in b:
            if k == "offset":
                assert a[k].item() == b[k].item(), (i, a[k].item(), b[k].item())
            else:
                assert a[k].shape == b[k].shape and rel_err(a[k], b[k]) < tol, (i, k)


def test_caches_after_verify_steps_with_rejections_equal_a_plain_run(loaded, monkeypatch):
    model, mtp, _ = loaded
    args = model.args
    prompt = [(7 * i + 4) % 240 for i in range(11)]  # choices with margins (checked below)
    want = plain_greedy(model, prompt, 24)
    monkeypatch.setattr(mtp, "step", Oracle(mtp, prompt + want, args.vocab_size))
    cache = model.make_cache() + mtp.make_cache()
    stats = SpecStats()
    with margins() as m:
        got = [t for t, _, _ in mtp_generate_step(prompt, model, mtp, num_draft_tokens=3,
                                                  max_tokens=14, prompt_cache=cache,
                                                  stats=stats)]
    assert got == want[:14] and any(n < 3 for n in stats.per_step) and stats.accepted > 0
    seq = prompt + got[:-1]  # the target holds every token but the last one yielded
    L = len(seq)
    tol = model_tolerance(args, L, depth=N + 1)
    with margins() as m2:
        plain = model.make_cache()
        model(mx.array(prompt)[None], plain)
        for t in got[:-1]:
            model(mx.array([[t]]), plain)
        hidden, _ = target_forward(model, mx.array(seq)[None], None)
        # the MTP holds pairs (h_j, s_j+1) for j < off; the rest wait in its pending cache
        n = len(model.layers)
        off = cache[n].offset
        mtp_ref = DSACache()
        MTP.step(mtp, hidden[:, :off], mx.array(seq[1 : off + 1])[None], mtp_ref)
    m.check(tol, need_indexer=True)
    m2.check(tol, need_indexer=True)
    assert_caches_close(cache[:n], plain, tol)
    assert L - 4 <= off < L  # at most one step's tokens (k + 1) wait
    assert_caches_close([cache[n]], [mtp_ref], tol)
    pend_h, pend_t = cache[n + 1][0], cache[n + 1][1]
    assert pend_h.shape[1] == L - off and rel_err(pend_h, hidden[:, off:]) < tol
    assert pend_t.tolist() == seq[off + 1 :]  # their next tokens, but the unfed last one


def test_mtp_continues_from_its_caches_in_a_second_call(loaded):
    """Two calls on one cache (a chat's second turn) give what one call on the whole
    sequence gives: the pending hidden carries over."""
    model, mtp, _ = loaded
    prompt = [(3 * i + 2) % 250 for i in range(6)]
    first = [t for t, _, _ in mtp_generate_step(prompt, model, mtp, num_draft_tokens=2,
                                                max_tokens=5)]
    cache = model.make_cache() + mtp.make_cache()
    list(mtp_generate_step(prompt, model, mtp, num_draft_tokens=2, max_tokens=5,
                           prompt_cache=cache))
    more = [first[-1], 17, 42]  # the last token yielded was not fed: it leads the next prompt
    got = [t for t, _, _ in mtp_generate_step(more, model, mtp, num_draft_tokens=2,
                                              max_tokens=6, prompt_cache=cache)]
    assert got == plain_greedy(model, prompt + first + [17, 42], 6)
    n, L = len(model.layers), len(prompt + first + [17, 42] + got[:-1])
    assert cache[0][1] is not None and cache[n].offset + cache[n + 1][0].shape[1] == L


# ------------------------------------------------------------------------------- CLI


def test_generate_with_draft_mtp_prints_the_plain_greedy_text(mtp_ckpt, capsys):
    from kimi_mlx.commands import main as cli

    base = ["generate", "--model", str(mtp_ckpt), "--prompt", "hi", "-m", "8",
            "--ignore-chat-template"]
    assert cli.main(base) == 0
    plain = capsys.readouterr().out.split("=" * 10)[1]
    assert cli.main(base + ["--draft", "mtp", "--num-draft-tokens", "2"]) == 0
    out = capsys.readouterr().out
    assert out.split("=" * 10)[1] == plain and "Speculative:" in out


def test_draft_mtp_errors(tiny_ckpt, capsys):
    from kimi_mlx.commands import main as cli

    assert cli.main(["generate", "--model", str(tiny_ckpt), "--prompt", "hi", "--draft",
                     "mtp"]) == 2
    err = capsys.readouterr().err
    assert "num_nextn_predict_layers" in err and str(tiny_ckpt) in err
    assert cli.main(["generate", "--model", str(tiny_ckpt), "--prompt", "hi", "--draft",
                     "mtp", "--draft-model", str(tiny_ckpt)]) == 2
    assert "not both" in capsys.readouterr().err
    assert cli.main(["cluster", "launch", "--draft", "mtp", "--prompt", "hi",
                     "--nodes", "127.0.0.1:1"]) == 2
    assert "--draft mtp: the MTP draft runs in one process only" in capsys.readouterr().err


def test_chat_turns_with_draft_mtp_equal_plain_chat(mtp_ckpt):
    """Greedy chat turns give the same replies with `--draft mtp`, also when the turn is
    served from target + MTP caches that already hold the conversation (the MTP's
    pending hidden carried over from the call that filled them)."""
    from kimi_mlx.commands.chat import Conversation, chat_turn
    from kimi_mlx.text.chat_format import encode_chat
    from kimi_mlx.checkpoint.loader import load_for_generation
    from kimi_mlx.speculative.loop import Speculation

    model, wrapper, tok, _ = load_for_generation(str(mtp_ckpt))
    sp = Speculation(load_mtp(mtp_ckpt, model), 2)
    greedy = make_sampler(0.0)
    plain, fast = Conversation(), Conversation()
    a = chat_turn(model, wrapper, tok, plain, "hi", "low", greedy, 6, 4096)
    b = chat_turn(model, wrapper, tok, fast, "hi", "low", greedy, 6, 4096, speculation=sp)
    assert a == b and sp.stats.steps > 0

    nxt = plain.messages + [{"role": "user", "content": "and then?"}]
    ids = encode_chat(tok, nxt, reasoning_effort="low")
    prefix = encode_chat(tok, plain.messages, reasoning_effort="low", add_generation_prompt=False)
    assert ids[: len(prefix)] == prefix
    held = ids[: len(prefix) + 1]
    fast.cache = model.make_cache() + sp.draft.make_cache()
    # one step from `held`: its last token is verified, so the target then holds all of it
    list(mtp_generate_step(held, model, sp.draft, max_tokens=1, prompt_cache=fast.cache))
    n = len(model.layers)
    assert fast.cache[2].offset == len(held) and fast.cache[n + 1][0] is not None
    fast.processed = held
    a = chat_turn(model, wrapper, tok, plain, "and then?", "low", greedy, 6, 4096,
                  reuse_cache=False)
    b = chat_turn(model, wrapper, tok, fast, "and then?", "low", greedy, 6, 4096, speculation=sp)
    assert fast.reused_tokens == len(held) > 10
    assert a == b


def test_micro_mtp_export_is_a_copy_with_the_layer_it_trained(tiny_ckpt, tmp_path):
    """`make micro-mtp`'s export (`write_copy`) on the tiny checkpoint: the source is
    untouched, the copy's trunk is the source's, and its MTP layer loads with the values
    written (BF16, experts MXFP4-rounded); `build_mtp` starts from the last trunk layer."""
    import hashlib

    from kimi_mlx.micro.mtp_train import build_mtp, write_copy
    from kimi_mlx.micro.train import mxfp4_roundtrip

    def digest(folder):
        return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in folder.iterdir()}

    before = digest(tiny_ckpt)
    teacher, _, _ = load_model(tiny_ckpt, verbose=False)
    mtp = build_mtp(teacher, seed=0)
    layer, last = mtp.mtp_layers[0], teacher.layers[-1]
    assert mx.array_equal(layer.self_attn.kv_b_proj.weight,
                          last.self_attn.kv_b_proj.weight.astype(mx.float32)).item()
    write_copy(tiny_ckpt, tmp_path / "copy", mtp)
    assert digest(tiny_ckpt) == before
    model, _, _ = load_model(tmp_path / "copy", verbose=False)
    ours, want = dict(tree_flatten(model.parameters())), dict(tree_flatten(teacher.parameters()))
    assert all(mx.array_equal(ours[k], want[k]).item() for k in want)
    got = load_mtp(tmp_path / "copy", model).mtp_layers[0]
    assert mx.array_equal(got.eh_proj.weight, layer.eh_proj.weight.astype(mx.bfloat16)).item()
    q = got.block_sparse_moe.switch_mlp.up_proj
    deq = mx.dequantize(q.weight, q.scales, group_size=32, bits=4, mode="mxfp4")
    assert mx.array_equal(deq, mxfp4_roundtrip(layer.block_sparse_moe.switch_mlp.up_proj.weight)).item()


def test_an_mtp_layer_with_its_own_head_and_embedding_uses_them(mtp_ckpt, loaded, tmp_path):
    """DeepSeek's layout also ships `shared_head.head` and `embed_tokens` in the MTP layer:
    they are loaded and used instead of the trunk's (here: the trunk's head scaled by 2,
    and its embedding rows shifted by one token)."""
    import shutil

    model, mtp, _ = loaded
    own = tmp_path / "own"
    shutil.copytree(mtp_ckpt, own)
    lm = model.language_model
    extra = {PRE + "shared_head.head.weight": (2 * lm.lm_head.weight).astype(mx.bfloat16),
             PRE + "embed_tokens.weight": mx.roll(lm.model.embed_tokens.weight, -1, 0)}
    mx.save_safetensors(str(own / "model-mtp-extra.safetensors"), extra, metadata={"format": "pt"})
    idx = own / "model.safetensors.index.json"
    data = json.loads(idx.read_text())
    data["weight_map"].update({k: "model-mtp-extra.safetensors" for k in extra})
    idx.write_text(json.dumps(data))
    mine = load_mtp(own, model)
    h, _ = target_forward(model, mx.array([[5, 6, 7]]), None)
    toks = mx.array([[6, 7, 8]])
    _, base = mtp.step(h, toks + 1, DSACache())  # own row t = trunk row t + 1
    _, got = mine.step(h, toks, DSACache())
    assert rel_err(got, 2 * base) < tolerance(2, reduction_length(model.args, 3))
    assert "head" in mine.mtp_layers[0].shared_head and "embed_tokens" in mine.mtp_layers[0]


def test_the_server_engine_decodes_with_the_mtp_draft(mtp_ckpt):
    """`kimi-mlx server --draft mtp`: the one-process engine runs the MTP loop (which
    prefills itself) and gives mlx-lm's plain greedy tokens, request after request; a
    request with a prompt cache configured still works (the cache is turned off)."""
    from kimi_mlx.server.engine import Engine
    from kimi_mlx.server.jobs import Finished, Job
    from kimi_mlx.server.prompt_cache import PromptCache
    from kimi_mlx.speculative.factory import ONE_PROCESS, build_speculation
    from kimi_mlx.speculative.settings import DraftSettings

    model, _, _ = load_model(mtp_ckpt, verbose=False)
    spec = build_speculation(DraftSettings(kind="mtp", num_draft_tokens=2), where=ONE_PROCESS,
                             target_name=str(mtp_ckpt), model=model)
    engine = Engine(model, eos_ids=[], prompt_cache=PromptCache(1 << 20), speculation=spec)
    assert engine.prompt_cache is None
    engine.start()
    try:
        for prompt in ([5, 9, 2, 7, 7, 1], [3, 3, 8]):
            job = Job(prompt, 8)
            job.attach()
            events = list(engine.submit(job).events(timeout=120))
            assert isinstance(events[-1], Finished), events[-1]
            assert [e.token for e in events[:-1]] == plain_greedy(model, prompt, 8)
    finally:
        engine.stop()
    assert spec.stats.steps > 0
