"""The catalog of models a server may load (`server.catalog`) and Ollama's keep_alive read
as seconds. References: Go's `time.ParseDuration` grammar and Ollama's api/types.go
`Duration.UnmarshalJSON` (a number is seconds, negative is forever), figures by hand."""

import pytest

from kimi_mlx.server.catalog import FOREVER, catalog, parse_keep_alive
from kimi_mlx.server.cli import main as server_main


@pytest.mark.parametrize("value, seconds", [
    (0, 0.0), ("0", 0.0), (300, 300.0), (2.5, 2.5), ("5m", 300.0), ("1h30m", 5400.0),
    ("300ms", 0.3), ("1.5h", 5400.0), ("2h45m30.5s", 9930.5), ("+10s", 10.0), ("1us", 1e-6),
    (-1, FOREVER), ("-1m", FOREVER), ("-0.5s", FOREVER), (-0.0, 0.0)])
def test_keep_alive_as_ollama_reads_it(value, seconds):
    got = parse_keep_alive(value)
    assert got == seconds if seconds is None else got == pytest.approx(seconds)


@pytest.mark.parametrize("value", ["300", "5", "", "m", "5x", "1h 30m", "5m-", True, None, {}, [1]])
def test_keep_alive_refuses_what_go_refuses(value):
    with pytest.raises(ValueError, match="keep_alive"):
        parse_keep_alive(value)


def _ckpt(folder):
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"")
    return str(folder)


def test_catalog_from_flags(tmp_path):
    d = tmp_path / "models"
    b, a = _ckpt(d / "b"), _ckpt(d / "a")
    (d / "notes").mkdir()  # no checkpoint in it: not a model
    (d / "half").mkdir()
    (d / "half" / "config.json").write_text("{}")  # no weights: not a model
    x = _ckpt(tmp_path / "x")
    assert catalog(None, None, None, lambda: x) == {"x": x}
    assert catalog([x], None, "served", lambda: "unused") == {"served": x}
    assert catalog(None, str(d), None, lambda: "unused") == {"a": a, "b": b}
    assert list(catalog([f"first={x}"], str(d), None, lambda: "unused")) == ["first", "a", "b"]
    # a plain --model comes first, then the named ones, then the folder's
    assert list(catalog([f"n={a}", x], str(d), None, lambda: "unused")) == ["x", "n", "a", "b"]
    # a hub id's "/" is not a NAME=
    assert catalog(["org/repo=v2"], None, None, lambda: "unused") == {"repo=v2": "org/repo=v2"}


@pytest.mark.parametrize("models, folder, needle", [
    (["p1", "p2"], None, "one checkpoint without a name"),
    (["a=p1", "a=p2"], None, "given twice"),
    (["=p1"], None, "NAME=PATH"),
    (["a="], None, "NAME=PATH"),
    (None, "missing", "not a folder"),
    (None, "empty", "no checkpoint"),
    (["a=p", "a=q"], None, "'a'"),
])
def test_catalog_errors_name_the_flag(tmp_path, models, folder, needle):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=needle):
        catalog(models, str(tmp_path / folder) if folder else None, None, lambda: "d")


def test_duplicate_between_model_and_folder(tmp_path):
    a = _ckpt(tmp_path / "m" / "a")
    with pytest.raises(ValueError, match="--models-dir.*'a' is given twice"):
        catalog([f"a={a}"], str(tmp_path / "m"), None, lambda: "d")


@pytest.mark.parametrize("flags, needle", [
    (["--models-dir", "/nonexistent/kimi-mlx-models"], "not a folder"),
    (["--idle-unload", "-1"], "--idle-unload must be >= 0"),
    (["--model-wait", "0"], "--model-wait must be > 0"),
    (["--allow-models", "nothere"], "--allow-models names 'nothere'"),
])
def test_server_refuses_bad_model_flags_before_loading(flags, needle, capsys):
    assert server_main(["--port", "0", *flags]) == 2
    assert needle in capsys.readouterr().err
