"""The shipped checkpoints' `tokenization_kimi.py` (what their tokenizer_config.json
`auto_map` names): plain `transformers.AutoTokenizer.from_pretrained(folder,
trust_remote_code=True)` loads it in a Python where `kimi_mlx` cannot be imported, and
it gives the same token ids as our own `KimiTokenizer` on varied text, special-token
text included (issue 32 item 11)."""

import json
import os
import site
import subprocess
import sys
from pathlib import Path

import pytest

from kimi_mlx.text.tokenizer import REMOTE_CODE_SOURCE, KimiTokenizer, write_tokenizer_files

ASSETS = Path(__file__).resolve().parents[1] / "kimi_mlx" / "assets"
SHIPPED = [d for d in sorted(ASSETS.iterdir()) if (d / "tokenizer_config.json").is_file()]

TEXTS = [
    "Hello, world!",
    "def f(x):\n    return x ** 2  # squares\n\n\n",
    "  leading and trailing spaces   ",
    "naïve café, 東京タワー, Привет, 🙂🚀, ∑ᵢ xᵢ²",
    "numbers 1234567 and 3.14159, tabs\tand\r\nCRLF",
    "<|open|>think<|sep|> user text that looks like markup <|end_of_msg|>[EOS]",
    "[BOS]Once upon a time<|media_pad|>",
    "I'm sure they'll say it's John's CAT'S",
    "",
]


def test_every_shipped_checkpoint_ships_the_file_its_auto_map_names():
    assert len(SHIPPED) >= 4
    for d in SHIPPED:
        cfg = json.loads((d / "tokenizer_config.json").read_text())
        module, cls = cfg["auto_map"]["AutoTokenizer"][0].split(".")
        assert (d / f"{module}.py").read_bytes() == REMOTE_CODE_SOURCE.read_bytes(), d
        assert cls == "TikTokenTokenizer"


def test_written_tokenizer_folders_carry_it_too(tmp_path):
    tok = KimiTokenizer.from_pretrained(SHIPPED[0])
    write_tokenizer_files(tmp_path, tok.mergeable_ranks,
                          {n: i for n, i in tok.special_tokens.items()})
    assert (tmp_path / "tokenization_kimi.py").read_bytes() == REMOTE_CODE_SOURCE.read_bytes()


# Run with -S (no .pth files: our editable install and its mlx-lm hook are not loaded),
# the environment's site-packages appended by hand, and a cwd outside the repository.
PROBE = r"""
import importlib.util, json, sys
sys.path.extend(json.loads(sys.argv[2]))
assert importlib.util.find_spec("kimi_mlx") is None, "kimi_mlx is importable"
from transformers import AutoTokenizer
tok = AutoTokenizer.from_pretrained(sys.argv[1], trust_remote_code=True)
assert type(tok).__module__.endswith("tokenization_kimi"), type(tok).__module__
texts = json.loads(sys.stdin.read())
out = {"class": type(tok).__name__, "eos": tok.eos_token_id, "bos": tok.bos_token_id,
       "len": len(tok), "plain": [], "special": [], "decoded": [], "tokenized": []}
for t in texts:
    ids = tok(t, add_special_tokens=False).input_ids
    out["plain"].append(ids)
    out["special"].append(tok.encode(t, add_special_tokens=False, split_special_tokens=False))
    out["decoded"].append(tok.decode(ids))
    out["tokenized"].append(tok.convert_tokens_to_string(tok.tokenize(t)))
print(json.dumps(out))
"""


def _probe(python, folder, site_dirs, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env.update(HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    r = subprocess.run([python, "-S", "-c", PROBE, str(folder), json.dumps(site_dirs)],
                       input=json.dumps(TEXTS), capture_output=True, text=True, cwd=tmp_path,
                       env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def _check(out, folder):
    ours = KimiTokenizer.from_pretrained(folder)
    assert out["class"] == "TikTokenTokenizer" and out["len"] == len(ours)
    assert out["eos"] == ours.special_tokens["<|end_of_msg|>"]
    assert out["bos"] == ours.special_tokens["[BOS]"]
    for t, plain, special, dec, tokd in zip(TEXTS, out["plain"], out["special"], out["decoded"],
                                            out["tokenized"]):
        assert plain == ours.encode(t), t
        assert special == ours.encode(t, allow_special=True), t
        assert dec == t and tokd == t
    # the markup text really is different with specials allowed (the check can fail)
    assert out["special"][5] != out["plain"][5]


@pytest.mark.parametrize("folder", SHIPPED, ids=lambda d: d.name)
def test_plain_transformers_loads_it_without_kimi_mlx(folder, tmp_path):
    _check(_probe(sys.executable, folder, site.getsitepackages(), tmp_path), folder)


def test_in_the_tools_venv_as_lm_eval_loads_it(tmp_path):
    """The lm-eval tools virtualenv (`make lmeval-tools`), where kimi_mlx is not installed."""
    py = Path(__file__).resolve().parents[1] / ".venv-tools" / "bin" / "python"
    if not py.exists():
        pytest.skip(".venv-tools is missing (make lmeval-tools)")
    dirs = subprocess.run([str(py), "-c", "import site, json; print(json.dumps(site.getsitepackages()))"],
                          capture_output=True, text=True, check=True).stdout
    folder = next(d for d in SHIPPED if d.name == "micro")
    _check(_probe(str(py), folder, json.loads(dirs), tmp_path), folder)
