"""KimiTokenizer, the K3 special-token table, the tokenizer files, and the transformers /
mlx-lm integration. References: hand-computed ids, tiktoken itself, the spec's table."""

import base64
import json
import subprocess
import sys
from pathlib import Path

import pytest
import tiktoken

from kimi_mlx.text import chat_format
from kimi_mlx.text.hf_register import register_with_transformers
from kimi_mlx.text.tokenizer import (
    KimiTokenizer,
    kimi_special_tokens,
    write_tokenizer_files,
)

# The K2/K3 pre-tokenizer, copied from the spec (independent of the code under test).
KIMI_PAT = "|".join(
    [
        r"""[\p{Han}]+""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)

MERGES = [b"he", b"ll", b"hell", b"hello", b" w", b"or", b" wor", b" world", b"ld"]
HE, LL, HELL, HELLO, SP_W, OR, SP_WOR, SP_WORLD, LD = range(256, 265)
N_RANKS = 265
# kimi_special_tokens(265): [BOS] 265, [EOS] 266, <|end_of_msg|> 267, <|open|> 268,
# <|close|> 269, <|sep|> 270, ..., [UNK] 519, [PAD] 520.
BOS, EOS, END_OF_MSG, OPEN, CLOSE, SEP = 265, 266, 267, 268, 269, 270
UNK, PAD = 519, 520

# The release's table (task brief), by real id.
REAL_SPECIALS = {
    "[BOS]": 163584, "[EOS]": 163585, "<|end_of_msg|>": 163586, "<|open|>": 163587,
    "<|close|>": 163588, "<|sep|>": 163589, "[start_header_id]": 163590,
    "[end_header_id]": 163591, "[EOT]": 163593, "<|media_begin|>": 163602,
    "<|media_content|>": 163603, "<|media_end|>": 163604, "<|media_pad|>": 163605,
    "[UNK]": 163838, "[PAD]": 163839,
}


def hand_ranks():
    ranks = {bytes([i]): i for i in range(256)}
    for t in MERGES:
        ranks[t] = len(ranks)
    return ranks


@pytest.fixture
def tok_dir(tmp_path):
    d = tmp_path / "tok"
    write_tokenizer_files(d, hand_ranks(), kimi_special_tokens(N_RANKS))
    return d


@pytest.fixture
def tok(tok_dir):
    return KimiTokenizer.from_pretrained(tok_dir)


@pytest.fixture
def ref_enc():
    """tiktoken built directly from the same ranks: the reference encoder."""
    return tiktoken.Encoding(
        "ref", pat_str=KIMI_PAT, mergeable_ranks=hand_ranks(),
        special_tokens=kimi_special_tokens(N_RANKS),
    )


# ------------------------------------------------------------------ special table


def test_special_table_real_ids():
    sp = kimi_special_tokens(163584)
    assert len(sp) == 256
    assert sorted(sp.values()) == list(range(163584, 163840))
    for name, tid in REAL_SPECIALS.items():
        assert sp[name] == tid
    assert sp["<|reserved_token_163592|>"] == 163592
    assert sp["<|reserved_token_163837|>"] == 163837
    named = {k for k in sp if not k.startswith("<|reserved_token_")}
    assert named == set(REAL_SPECIALS)


def test_special_table_small_vocab_keeps_offsets():
    sp = kimi_special_tokens(N_RANKS)
    assert (sp["[BOS]"], sp["<|end_of_msg|>"], sp["<|open|>"], sp["<|sep|>"]) == (265, 267, 268, 270)
    assert sp["[EOT]"] == 274 and sp["<|media_pad|>"] == 286
    assert (sp["[UNK]"], sp["[PAD]"]) == (UNK, PAD)


# ----------------------------------------------------------------------- encoding


def test_hand_computed_ids(tok):
    # "hello" is a vocabulary word; " worlds": " w"(260) -> "or"(261) -> " wor"(262)
    # -> "ld"(264) -> " world"(263), then "s".
    assert tok.encode("hello worlds") == [HELLO, SP_WORLD, ord("s")]
    # "Hello": only "ll" merges.
    assert tok.encode("Hello") == [ord("H"), ord("e"), LL, ord("o")]
    # "shell": "he"(256) before "ll"(257), then he+ll = "hell".
    assert tok.encode("shell") == [ord("s"), HELL]
    # Non-ASCII falls back to bytes: é = C3 A9, 你好 = E4 BD A0 E5 A5 BD.
    assert tok.encode("é") == [0xC3, 0xA9]
    assert tok.encode("你好") == [0xE4, 0xBD, 0xA0, 0xE5, 0xA5, 0xBD]


def test_special_text_is_ordinary_unless_allowed(tok):
    assert tok.encode("<|open|>hello", allow_special=True) == [OPEN, HELLO]
    assert tok.encode("<|open|>hello") == [ord(c) for c in "<|open|>"] + [HELLO]
    assert tok.encode("[EOS]") == [ord(c) for c in "[EOS]"]


def test_matches_tiktoken_reference(tok, ref_enc):
    texts = [
        "hello world, hello worlds!", "  leading\n\nand trailing  ", "Ünïcödé 你好世界 123456",
        "<|open|>x<|sep|>y<|close|>", "tabs\tand\r\nCRLF", "👍🏽 emoji", "I'LL don't",
    ]
    for t in texts:
        assert tok.encode(t) == ref_enc.encode_ordinary(t)
        assert tok.encode(t, allow_special=True) == ref_enc.encode(t, allowed_special="all")
        assert tok.decode(tok.encode(t)) == t


def test_decode(tok):
    assert tok.decode([HELLO, SP_WORLD]) == "hello world"
    assert tok.decode([OPEN, HELLO, END_OF_MSG]) == "<|open|>hello<|end_of_msg|>"
    assert tok.decode_bytes([0xC3]) == b"\xc3"
    assert tok.decode([0xC3]) == "\ufffd"
    with pytest.raises(ValueError, match="out of range"):
        tok.decode([PAD + 1])


def test_vocab_and_lookups(tok):
    assert tok.vocab_size == len(tok) == N_RANKS + 256
    assert tok.bos_token_id == BOS
    assert tok.eos_token_ids == [END_OF_MSG, EOS]
    assert tok.eos_token_id == END_OF_MSG
    assert tok.pad_token_id == PAD and tok.unk_token_id == UNK
    assert tok.special_tokens["<|sep|>"] == SEP
    assert tok.token_to_id("<|close|>") == CLOSE
    assert tok.token_to_id(b" world") == SP_WORLD
    assert tok.token_to_id("hello") == HELLO
    assert tok.id_to_token(SP_WOR) == b" wor"
    assert tok.id_to_token(SEP) == "<|sep|>"
    with pytest.raises(KeyError):
        tok.token_to_id("nope-not-a-token")
    with pytest.raises(KeyError):
        tok.id_to_token(10**6)


def test_real_size_vocabulary(tmp_path):
    # 163584 ranks (synthetic multi-byte tokens after the bytes) + the real special ids.
    ranks = {bytes([i]): i for i in range(256)}
    for i in range(256, 163584):
        ranks[b"\xff\xfe" + i.to_bytes(3, "big")] = i
    write_tokenizer_files(tmp_path, ranks, kimi_special_tokens(163584))
    tok = KimiTokenizer.from_pretrained(tmp_path)
    assert tok.vocab_size == 163840
    assert tok.eos_token_ids == [163586, 163585]
    assert tok.encode("<|open|><|end_of_msg|>[PAD]", allow_special=True) == [163587, 163586, 163839]
    assert tok.encode("hi") == [ord("h"), ord("i")]


# ------------------------------------------------------------------------- files


def test_written_files(tok_dir):
    lines = (tok_dir / "tiktoken.model").read_text().splitlines()
    assert len(lines) == N_RANKS
    assert lines[0] == "AA== 0"
    assert lines[259] == f"{base64.b64encode(b'hello').decode()} 259" == "aGVsbG8= 259"
    cfg = json.loads((tok_dir / "tokenizer_config.json").read_text())
    assert cfg["tokenizer_class"] == "TikTokenTokenizer"
    assert cfg["auto_map"] == {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]}
    assert cfg["bos_token"] == "[BOS]"
    assert cfg["eos_token"] == "<|end_of_msg|>"
    assert cfg["pad_token"] == "[PAD]" and cfg["unk_token"] == "[UNK]"
    assert cfg["model_max_length"] == 1048576
    assert cfg["added_tokens_decoder"]["268"]["content"] == "<|open|>"
    assert cfg["added_tokens_decoder"]["268"]["special"] is True
    assert len(cfg["added_tokens_decoder"]) == 256
    # the auto_map names tokenization_kimi.py, so it is written too (plain transformers)
    assert sorted(p.name for p in tok_dir.iterdir()) == ["tiktoken.model", "tokenization_kimi.py",
                                                        "tokenizer_config.json"]


def _write_model(d, lines):
    (d / "tiktoken.model").write_text("\n".join(lines) + "\n")


def _rank_lines():
    return [f"{base64.b64encode(t).decode()} {r}" for t, r in hand_ranks().items()]


def test_missing_files(tmp_path, tok_dir):
    with pytest.raises(FileNotFoundError, match="tokenizer_config.json"):
        KimiTokenizer.from_pretrained(tmp_path)
    (tok_dir / "tiktoken.model").unlink()
    with pytest.raises(FileNotFoundError, match="tiktoken.model"):
        KimiTokenizer.from_pretrained(tok_dir)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda ls: ls.__setitem__(2, "AAA"), r"tiktoken\.model:3: expected 'base64 rank'"),
        (lambda ls: ls.__setitem__(1, "@@@ 1"), r"tiktoken\.model:2: invalid base64"),
        (lambda ls: ls.__setitem__(4, "BA== four"), r"tiktoken\.model:5: rank 'four'"),
        (lambda ls: ls.__setitem__(5, "BQ== 4"), r"tiktoken\.model:6: duplicate rank 4"),
        (lambda ls: ls.__setitem__(5, "BA== 5"), r"tiktoken\.model:6: duplicate token"),
        (lambda ls: ls.pop(100), r"without gaps; first missing: \[100\]"),
        (lambda ls: ls.__setitem__(0, "eno= 0"), r"missing 0x0"),
    ],
)
def test_malformed_rank_file(tok_dir, edit, message):
    lines = _rank_lines()
    edit(lines)
    _write_model(tok_dir, lines)
    with pytest.raises(ValueError, match=message) as e:
        KimiTokenizer.from_pretrained(tok_dir)
    assert "tiktoken.model" in str(e.value) or str(tok_dir) in str(e.value)


def test_bad_config(tok_dir):
    cfg_path = tok_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg_path.write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer_config.json: invalid JSON"):
        KimiTokenizer.from_pretrained(tok_dir)
    bad = json.loads(json.dumps(cfg))
    bad["added_tokens_decoder"]["100"] = {"content": "<|evil|>"}
    cfg_path.write_text(json.dumps(bad))
    with pytest.raises(ValueError, match=r"'<\|evil\|>' id 100 collides .*tokenizer_config.json"):
        KimiTokenizer.from_pretrained(tok_dir)
    bad = json.loads(json.dumps(cfg))
    bad["bos_token"] = "<|nope|>"
    cfg_path.write_text(json.dumps(bad))
    with pytest.raises(ValueError, match=r"bos_token '<\|nope\|>' is not a special token"):
        KimiTokenizer.from_pretrained(tok_dir)
    bad = json.loads(json.dumps(cfg))
    del bad["added_tokens_decoder"]
    cfg_path.write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="tokenizer_config.json: no added_tokens_decoder"):
        KimiTokenizer.from_pretrained(tok_dir)


def test_write_refuses_bad_input_and_leaves_nothing(tmp_path):
    ranks = hand_ranks()
    with pytest.raises(ValueError, match="collides"):
        write_tokenizer_files(tmp_path / "a", ranks, {"[BOS]": 10})
    gap = dict(ranks)
    del gap[b"he"]
    with pytest.raises(ValueError, match="gaps"):
        write_tokenizer_files(tmp_path / "b", gap, kimi_special_tokens(N_RANKS))
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


# ------------------------------------------------------------ transformers/mlx-lm

TRAP = (
    "from pathlib import Path\n"
    "Path(__file__).with_name('EXECUTED').write_text('checkpoint code ran')\n"
    "raise RuntimeError('checkpoint code must never run')\n"
)


@pytest.fixture
def release_like_dir(tok_dir):
    """Tokenizer files plus a trap tokenization_kimi.py / configuration file and a
    config.json with auto_map, as a release folder would have them."""
    (tok_dir / "tokenization_kimi.py").write_text(TRAP)
    (tok_dir / "configuration_kimi.py").write_text(TRAP)
    (tok_dir / "config.json").write_text(json.dumps({
        "model_type": "kimi_k31",
        "architectures": ["KimiK31ForConditionalGeneration"],
        "auto_map": {"AutoConfig": "configuration_kimi.KimiK31Config"},
    }))
    return tok_dir


def test_auto_tokenizer_uses_our_class(release_like_dir, tok, ref_enc):
    register_with_transformers(lazy=False)
    from transformers import AutoTokenizer

    config = json.loads((release_like_dir / "config.json").read_text())
    for model_type in ("kimi_k31", "kimi_k3", None):
        if model_type is None:
            (release_like_dir / "config.json").unlink()  # a tokenizer-only folder
        else:
            config["model_type"] = model_type
            (release_like_dir / "config.json").write_text(json.dumps(config))
        for kwargs in ({}, {"trust_remote_code": True}):
            hf = AutoTokenizer.from_pretrained(release_like_dir, **kwargs)
            assert type(hf).__name__ == "TikTokenTokenizer"
            assert type(hf).__module__ == "kimi_mlx.text.hf_tokenizer"
    assert not (release_like_dir / "EXECUTED").exists()
    assert "tokenization_kimi" not in sys.modules

    text = "hello worlds, <|open|>hello<|sep|> 你好"
    # Plain encode: special-token text is text (no path from a string to control ids)...
    assert hf.encode(text, add_special_tokens=False) == ref_enc.encode_ordinary(text)
    assert hf.encode(text) == tok.encode(text)  # no BOS/EOS added
    assert hf(text)["input_ids"] == ref_enc.encode_ordinary(text)
    assert OPEN not in hf.encode(text) and SEP not in hf(text)["input_ids"]
    # ...unless the caller asks for specials explicitly.
    with_specials = ref_enc.encode(text, allowed_special="all")
    assert hf.encode(text, split_special_tokens=False) == with_specials
    assert hf(text, split_special_tokens=False)["input_ids"] == with_specials
    assert OPEN in with_specials
    assert hf.decode(hf.encode(text)) == text
    assert hf.decode([OPEN, HELLO, END_OF_MSG], skip_special_tokens=True) == "hello"
    assert hf.convert_ids_to_tokens([HELLO, SP_WORLD, OPEN]) == ["hello", "Ġworld", "<|open|>"]
    assert hf.convert_tokens_to_ids(["hello", "Ġworld", "<|sep|>"]) == [HELLO, SP_WORLD, SEP]
    assert len(hf) == hf.vocab_size == N_RANKS + 256
    assert hf.get_vocab()["<|end_of_msg|>"] == END_OF_MSG
    assert hf.eos_token == "<|end_of_msg|>" and hf.eos_token_id == END_OF_MSG
    assert hf.bos_token_id == BOS and hf.pad_token_id == PAD


def test_apply_chat_template(release_like_dir, tok):
    register_with_transformers(lazy=False)
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(release_like_dir)
    msgs = [{"role": "user", "content": "hello <|open|>"}]
    ids = hf.apply_chat_template(msgs, add_generation_prompt=True)
    assert ids == chat_format.encode_chat(tok, msgs, "max", True)
    assert ids.count(OPEN) == 4  # effort block, user, assistant, think: not the typed one
    text = hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, reasoning_effort="low")
    assert "`thinking_effort=low`" in text and text.endswith("<|open|>think<|sep|>")
    text = hf.apply_chat_template(msgs, tokenize=False, thinking_effort="high", enable_thinking=True)
    assert "`thinking_effort=high`" in text and not text.endswith("<|open|>think<|sep|>")
    out = hf.apply_chat_template(msgs, return_dict=True)
    assert out["input_ids"] == chat_format.encode_chat(tok, msgs, "max", False)
    assert out["attention_mask"] == [1] * len(out["input_ids"])
    with pytest.raises(ValueError, match="low, high, max"):
        hf.apply_chat_template(msgs, reasoning_effort="medium")


def test_mlx_lm_load(release_like_dir, tok):
    register_with_transformers(lazy=False)
    from mlx_lm.tokenizer_utils import load

    w = load(Path(release_like_dir))
    assert type(w._tokenizer).__module__ == "kimi_mlx.text.hf_tokenizer"
    assert not (release_like_dir / "EXECUTED").exists()
    text = "hello worlds <|sep|>"
    assert w.encode(text, add_special_tokens=False) == tok.encode(text)
    assert SEP not in w.encode(text, add_special_tokens=False)
    # A whole-string marker lookup (how mlx-lm finds its think/tool markers) gets the ids.
    assert w.encode("<|sep|>", add_special_tokens=False) == [SEP]
    assert w.encode(" <|sep|>", add_special_tokens=False) == tok.encode(" <|sep|>")
    assert w.think_start == "<|open|>think<|sep|>"
    assert w.think_start_tokens == (OPEN, ord("t"), ord("h"), ord("i"), ord("n"), ord("k"), SEP)
    assert w.has_tool_calling and w.tool_call_start == "<|open|>tools<|sep|>"
    assert w.tool_call_start_tokens == (OPEN, *tok.encode("tools"), SEP)
    assert END_OF_MSG in w.eos_token_ids
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    assert w.apply_chat_template(msgs, add_generation_prompt=True) == chat_format.encode_chat(tok, msgs)
    detok = w.detokenizer
    detok.reset()
    for i in tok.encode("hello worlds 你好"):
        detok.add_token(i)
    detok.finalize()
    assert detok.text == "hello worlds 你好"


def test_save_pretrained_round_trip(release_like_dir, tmp_path, tok):
    register_with_transformers(lazy=False)
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(release_like_dir)
    out = tmp_path / "saved"
    hf.save_pretrained(out)
    again = KimiTokenizer.from_pretrained(out)
    text = "hello worlds <|open|> 你好"
    assert again.encode(text, allow_special=True) == tok.encode(text, allow_special=True)
    assert again.special_tokens == tok.special_tokens


def test_import_kimi_mlx_registers_lazily(release_like_dir):
    code = (
        "import sys, kimi_mlx\n"
        "assert 'transformers' not in sys.modules and 'tiktoken' not in sys.modules\n"
        "from transformers import AutoTokenizer\n"
        f"t = AutoTokenizer.from_pretrained({str(release_like_dir)!r})\n"
        "print(type(t).__module__, type(t).__name__, t.encode('hello worlds'))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[-2] == f"kimi_mlx.text.hf_tokenizer TikTokenTokenizer [{HELLO}, {SP_WORLD}, 115]"
    assert not (release_like_dir / "EXECUTED").exists()
