"""A new user's first hour (issue 19): full BLAS speed however `kimi-mlx` is started, its
version line, progress while loading, and the help and message texts, by exact wording."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kimi_mlx.commands.blas import MARKER, OPT_OUT, openblas_path, preload_env

REPO = Path(__file__).resolve().parents[1]
SCRIPT = Path(sys.executable).parent / "kimi-mlx"


def bare_env(**extra) -> dict:
    """This environment as a new shell would have it: no preload, no re-exec marker."""
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", MARKER, OPT_OUT)}
    env.update(extra)
    return env


needs_openblas = pytest.mark.skipif(
    not sys.platform.startswith("linux") or openblas_path() is None,
    reason="Linux with Debian's libopenblas0-pthread only")

MAPS_SCRIPT = (
    "import os, sys\n"
    "from kimi_mlx.commands.blas import ensure_fast_blas\n"
    "ensure_fast_blas()\n"
    "maps = open('/proc/self/maps').read()\n"
    "print(int('openblas' in maps), os.environ.get('LD_PRELOAD', ''), sys.argv[1:])\n"
)


@needs_openblas
def test_started_without_preload_the_process_maps_openblas():
    """A process started with no LD_PRELOAD re-executes itself once with OpenBLAS
    preloaded (the kernel's own map of the process shows it), keeping its arguments."""
    res = subprocess.run([sys.executable, "-c", MAPS_SCRIPT, "a b", "c"], env=bare_env(),
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == f"1 {openblas_path()} ['a b', 'c']"


@needs_openblas
def test_opt_out_and_marker_leave_the_process_as_started():
    for extra in ({OPT_OUT: "1"}, {MARKER: "1"}):
        res = subprocess.run([sys.executable, "-c", MAPS_SCRIPT], env=bare_env(**extra),
                             capture_output=True, text=True, timeout=120)
        assert res.returncode == 0, res.stderr
        assert res.stdout.strip() == "0  []", extra


@needs_openblas
@pytest.mark.parametrize("how", ["script", "module"])
def test_kimi_mlx_version_reports_openblas_however_started(how):
    """The installed console script and `python -m kimi_mlx`, started from another folder
    without the Makefile's preload, run on OpenBLAS; with the opt-out they say why not."""
    if how == "script" and not SCRIPT.exists():
        pytest.skip(f"{SCRIPT} is not installed")
    argv = [str(SCRIPT)] if how == "script" else [sys.executable, "-m", "kimi_mlx"]
    res = subprocess.run(argv + ["--version"], env=bare_env(), cwd="/", capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("kimi-mlx ")
    assert f"BLAS: OpenBLAS ({Path(openblas_path()).parent}/" in res.stdout
    res = subprocess.run(argv + ["--version"], env=bare_env(**{OPT_OUT: "1"}), cwd="/",
                         capture_output=True, text=True, timeout=120)
    assert res.stdout.rstrip().endswith(
        f"BLAS: reference BLAS (slow: OpenBLAS is installed, {OPT_OUT} is set))")


def test_preload_env_rules():
    lib = openblas_path()
    assert preload_env({"LD_PRELOAD": ""}, platform="darwin") is None
    if lib is None:
        assert preload_env({}, platform="linux") is None
        return
    env = preload_env({"LD_PRELOAD": "/opt/libjemalloc.so", "HOME": "/h"}, platform="linux")
    assert env == {"LD_PRELOAD": f"/opt/libjemalloc.so:{lib}", "HOME": "/h", MARKER: "1"}
    assert preload_env({"LD_PRELOAD": "/x/libopenblas.so.0"}, platform="linux") is None
    assert preload_env({OPT_OUT: "0"}, platform="linux")["LD_PRELOAD"] == lib


def run_on(argv, terminal: bool, timeout: float = 180) -> str:
    """Run `python -m kimi_mlx ARGV` with stdout and stderr on a pseudo-terminal (what a
    user sees) or on a pipe; returns what was written to them together."""
    cmd = [sys.executable, "-m", "kimi_mlx"] + argv
    if not terminal:
        res = subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, timeout=timeout)
        assert res.returncode == 0, res.stdout.decode()[-2000:]
        return res.stdout.decode()
    import fcntl
    import pty
    import struct
    import termios

    master, slave = pty.openpty()
    # 24 rows x 80 columns, as a terminal window has (tqdm draws nothing 0 columns wide)
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=slave, stderr=slave)
    os.close(slave)
    chunks = []
    try:
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: the child closed its end
                break
            if not data:
                break
            chunks.append(data)
        assert proc.wait(timeout=timeout) == 0, b"".join(chunks).decode()[-2000:]
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()
    return b"".join(chunks).decode()


@pytest.mark.parametrize("command", ["generate", "eval"])
def test_loading_progress_on_a_terminal_only(tiny_ckpt, tmp_path, command):
    """A bar of bytes read (`loading <folder>`, tqdm) shows on a terminal, never in a pipe
    or with --quiet; the command's own output is the same either way."""
    if command == "generate":
        argv = ["generate", "--model", str(tiny_ckpt), "--prompt", "def f(x):",
                "--ignore-chat-template", "--max-tokens", "3", "--temp", "0"]
    else:
        data = tmp_path / "data.txt"
        data.write_text("def add(a, b):\n    return a + b\n" * 8)
        argv = ["eval", "--model", str(tiny_ckpt), "--data", str(data), "--seq-len", "16"]
    shown = run_on(argv, terminal=True)
    assert f"loading {tiny_ckpt.name}: " in shown and "B/s]" in shown
    if command == "eval":
        assert "measuring: " in shown and "tok/s]" in shown
    quiet = [run_on(argv + ["--quiet"], terminal=True)] if command == "generate" else []
    for out in [run_on(argv, terminal=False)] + quiet:
        assert f"loading {tiny_ckpt.name}" not in out and "measuring: " not in out
        assert "\r" not in out.replace("\r\n", "\n")
        assert ("Generation: 3 tokens" if command == "generate" else "perplexity: ") in out


MICRO_NOTE = (
    "note: this is the shipped micro model (kimi_mlx/assets/micro, 5.1M parameters of the "
    "Kimi K3.1 architecture), trained on Python standard-library code and documentation "
    "prose and not chat-tuned: chat prompts get noise. It continues raw text, e.g. "
    "--ignore-chat-template --prompt 'PYTHON SOFTWARE FOUNDATION LICENSE VERSION 2' or "
    "'class Queue:'. Give --model PATH_OR_HF_ID for a real model; "
    "kimi_mlx/assets/micro/MODEL_CARD.md says more about this one.\n")


def test_the_default_model_introduces_itself_to_chat_prompts(capsys):
    """A chat prompt to the shipped micro model (no --model) gets one note saying what the
    model is and which prompts suit it; a raw prompt, which it was trained for, does not."""
    from kimi_mlx.commands.main import main

    assert main(["generate", "--prompt", "Write a haiku about RAM", "--max-tokens", "2", "-q"]) == 0
    assert capsys.readouterr().err == MICRO_NOTE
    assert main(["generate", "--prompt", "class Queue:", "--ignore-chat-template",
                 "--max-tokens", "2", "-q"]) == 0
    assert capsys.readouterr().err == ""
    card = (REPO / "kimi_mlx" / "assets" / "micro" / "MODEL_CARD.md").read_text()
    assert "A 5.1M-parameter model of the Kimi K3.1 architecture" in card


def test_the_recited_license_is_what_the_readme_promises(capsys):
    """The README's first example: micro learned the stdlib's LICENSE.txt by heart (its
    model card), so the raw prompt continues with the licence's own words."""
    from kimi_mlx.commands.main import main

    license_file = Path(os.__file__).parent / "LICENSE.txt"
    if not license_file.exists():
        pytest.skip(f"{license_file} is not installed")
    heading = "PYTHON SOFTWARE FOUNDATION LICENSE VERSION 2"
    assert main(["generate", "--ignore-chat-template", "--prompt", heading,
                 "--max-tokens", "40", "--temp", "0", "-q"]) == 0
    text = capsys.readouterr().out.split("=" * 10 + "\n")[1][:-1]  # print() added a newline
    assert "This LICENSE AGREEMENT is between" in text
    after = license_file.read_text().split(heading, 1)[1]
    assert after.startswith(text)


def test_version_line_names_the_installed_versions(capsys):
    import re
    from importlib.metadata import version

    import mlx.core as mx

    from kimi_mlx.commands.main import main

    assert main(["--version"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"kimi-mlx {version('kimi-mlx')} (mlx {mx.__version__}, "
                          f"mlx-lm {version('mlx-lm')}, "), out
    assert re.fullmatch(r"kimi-mlx .* (cpu|gpu), BLAS: .+\)\n", out), out


def test_a_boolean_flag_refuses_what_is_not_a_boolean(capsys):
    from kimi_mlx.commands.main import main

    with pytest.raises(SystemExit) as e:
        main(["generate", "--prompt", "x", "--verbose", "maybe"])
    assert e.value.code == 2
    assert capsys.readouterr().err.endswith(
        "kimi-mlx generate: error: argument --verbose: expected true or false, got 'maybe'\n")


class _Terminal:
    """stdout as a terminal would be, recording what is written."""

    def __init__(self):
        self.parts = []

    def write(self, s):
        self.parts.append(s)
        return len(s)

    def flush(self):
        pass

    def isatty(self):
        return True


@pytest.mark.parametrize("no_color", [None, "1"])
def test_reasoning_is_dimmed_on_a_terminal_unless_no_color(tiny_ckpt, monkeypatch, no_color):
    """The chat encoding starts the reply in the reasoning channel, which a terminal shows
    dimmed (ESC[2m); NO_COLOR (https://no-color.org) turns every escape code off."""
    from kimi_mlx.commands.main import main

    if no_color is None:
        monkeypatch.delenv("NO_COLOR", raising=False)
    else:
        monkeypatch.setenv("NO_COLOR", no_color)
    term = _Terminal()
    monkeypatch.setattr(sys, "stdout", term)
    assert main(["generate", "--model", str(tiny_ckpt), "--prompt", "hello", "--max-tokens", "4",
                 "--temp", "0", "-q"]) == 0
    out = "".join(term.parts)
    assert ("\033[2m" in out) == (no_color is None), repr(out)
    assert "\033" in out if no_color is None else "\033" not in out


def test_max_tokens_minus_one_says_where_generation_stops(tiny_ckpt, capsys):
    from kimi_mlx.commands.main import main

    assert main(["generate", "--model", str(tiny_ckpt), "--prompt", "x" * 10,
                 "--ignore-chat-template", "--max-kv-size", "16", "--max-tokens", "-1",
                 "--temp", "0", "-q"]) == 0
    cap = capsys.readouterr()
    assert cap.err.splitlines()[-1] == (
        "note: generating at most 6 tokens: the prompt (10) and the generation must fit in 16 "
        "tokens (--max-kv-size)")
    assert "Generation: 6 tokens" in cap.out


def _option_help(parser, *path_and_flag):
    """The help string of option `flag` in the sub-command at `path` of `parser`."""
    *path, flag = path_and_flag
    for name in path:
        sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
        parser = sub.choices[name]
    return next(a.help for a in parser._actions if flag in a.option_strings)


def test_help_texts_say_what_each_command_does():
    from kimi_mlx.commands.main import build_parser

    p = build_parser()
    k_help = ("tokens the draft proposes per verify step (default 3), or auto (auto:N: at "
              "most N, default 8) to choose k as it runs from the measured acceptance per "
              "position and step time per k; needs --draft-model or --draft)")
    assert _option_help(p, "server", "--num-draft-tokens") == k_help
    assert _option_help(p, "generate", "--num-draft-tokens") == k_help
    assert _option_help(p, "server", "--max-concurrency") == (
        "sequences generated at once by continuous batching (default 4; 1 with "
        "--draft mtp or a block drafter, the only value allowed there; --draft ngram and "
        "draft models batch; 1 = one request at a time)")
    assert _option_help(p, "cluster", "server", "--context") == (
        "tokens per sequence to plan caches for (default: the model's context, or --max-kv-size)")
    assert _option_help(p, "cluster", "launch", "--context") == (
        "tokens per sequence to plan caches for (default: the prompt + --max-tokens)")
    assert _option_help(p, "cluster", "launch", "--nodes") == (
        "host[:port],host[:port],... in pipeline order, or 'auto': the nodes zeroconf finds, "
        "ordered by name (default: auto)")
    assert _option_help(p, "prune", "--context") == (
        "with --dry-run: tokens of context to plan for (default 131072, or the model's "
        "max_position_embeddings when smaller)")
    for command in ("generate", "chat", "server", "eval"):
        assert _option_help(p, command, "--quiet").startswith("no progress bar"), command
    assert _option_help(p, "cluster", "serve", "--quiet") == (
        "no progress bar while a stage loads (shown only on a terminal)")


def test_prune_dry_run_on_micro_plans_for_its_context_in_plain_sentences(capsys):
    from kimi_mlx.commands.main import main

    micro = str(REPO / "kimi_mlx" / "assets" / "micro")
    assert main(["prune", "--model", micro, "--keep", "0.5", "--q-bits", "4", "--dry-run"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[2] == (
        "Trunk (attention, dense and shared-expert MLPs, latent projections, embedding, "
        "lm_head): MLX affine 4-bit, group size 64 (as mlx_lm.convert). Norms, router, "
        "correction bias, KDA conv / A_log / dt_bias, AttnRes and kv_b_proj keep their stored "
        "dtype. Routed experts: MXFP4, byte-for-byte the source's.")
    # micro's config says max_position_embeddings 4096
    import json

    limit = json.loads((Path(micro) / "config.json").read_text())["text_config"]["max_position_embeddings"]
    assert f"fits (planner: weights + cache for {limit} tokens, 1 sequence):" in out


@pytest.mark.parametrize("command", ["generate", "eval", "plan", "convert"])
def test_a_config_file_given_as_model_is_not_a_folder(command, capsys, tmp_path):
    from kimi_mlx.commands.main import main

    micro = REPO / "kimi_mlx" / "assets" / "micro"
    argv = {"generate": ["--prompt", "hi"], "eval": ["--data", str(REPO / "README.md")],
            "plan": [], "convert": ["--q-bits", "4", "--out", str(tmp_path / "out")]}[command]
    assert main([command, "--model", str(micro / "config.json")] + argv) != 0
    err = capsys.readouterr().err
    assert err.rstrip("\n").endswith(
        f"{micro / 'config.json'}: not a folder; --model takes the checkpoint folder ({micro})"), err


def test_readme_starts_with_two_commands_and_its_examples_name_shipped_files():
    import re

    readme = (REPO / "README.md").read_text()
    first_block = readme.split("```\n")[1]
    assert [l.split("#")[0].strip() for l in first_block.splitlines()] == ["make demo", "make test"]
    assert ". .venv/bin/activate" in readme and ".venv/bin/kimi-mlx" in readme
    paths = set(re.findall(r"kimi_mlx/assets/[\w./-]+\w", readme))
    assert {"kimi_mlx/assets/micro/calib/code.txt", "kimi_mlx/assets/micro/heldout/code.txt",
            "kimi_mlx/assets/micro/heldout/prose.txt"} <= paths
    assert [p for p in sorted(paths) if not (REPO / p).exists()] == []


def test_every_asset_folder_setuptools_would_warn_about_is_listed():
    """setuptools warns (~40 lines in `make demo`) about each folder of package data that
    could be a package (an identifier name) but is absent from pyproject's `packages`."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    listed = set(project["tool"]["setuptools"]["packages"])
    assets = REPO / "kimi_mlx" / "assets"
    folders = [assets] + [p for p in assets.rglob("*") if p.is_dir()]
    importable = {".".join(p.relative_to(REPO).parts) for p in folders
                  if all(part.isidentifier() for part in p.relative_to(REPO).parts)}
    assert importable and importable - listed == set()
