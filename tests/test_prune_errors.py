"""Bad input to `kimi-mlx prune`: a clear message each, exit status 2, nothing left behind."""

import errno
import json
import shutil

import pytest

from kimi_mlx.commands.main import main as cli_main
from kimi_mlx.prune import writer
from kimi_mlx.testing.prune import moe_text_config, write_code_text
from kimi_mlx.testing.checkpoints import build_checkpoint


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("perr") / "src", moe_text_config(num_layers=3))


@pytest.fixture(scope="module")
def code(tmp_path_factory):
    return write_code_text(tmp_path_factory.mktemp("data") / "code.txt", n=40)


@pytest.fixture
def parent(tmp_path):
    d = tmp_path / "outs"
    d.mkdir()
    return d


def prune(capsys, src, calib, out, *extra):
    argv = ["prune", "--model", str(src), "--out", str(out), "--quiet", "--seq-len", "64",
            "--calib-tokens", "300"]
    if calib is not None:
        argv += ["--calib", *map(str, calib)]
    code = cli_main(argv + list(extra or ["--keep", "0.5"]))
    return code, capsys.readouterr().err


def assert_nothing_left(parent):
    assert list(parent.iterdir()) == [], [p.name for p in parent.iterdir()]


def test_missing_calibration(src, parent, capsys):
    code, err = prune(capsys, src, [parent.parent / "nope.jsonl"], parent / "o")
    assert code == 2 and "nope.jsonl: calibration data not found" in err
    code, err = prune(capsys, src, None, parent / "o")
    assert code == 2 and "no calibration data given" in err
    assert_nothing_left(parent)


def test_empty_calibration(src, parent, tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n")
    code, err = prune(capsys, src, [empty], parent / "o")
    assert code == 2 and "calibration data is empty" in err and "empty.txt" in err
    jsonl = tmp_path / "blank.jsonl"
    jsonl.write_text("\n\n")
    code, err = prune(capsys, src, [jsonl], parent / "o")
    assert code == 2 and "calibration data is empty" in err
    folder = tmp_path / "nothing"
    folder.mkdir()
    code, err = prune(capsys, src, [folder], parent / "o")
    assert code == 2 and "calibration folder has no files" in err
    assert_nothing_left(parent)


def test_malformed_calibration_record(src, parent, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"text": \n')
    code, err = prune(capsys, src, [bad], parent / "o")
    assert code == 2 and "bad.jsonl:2: not a JSON record" in err
    bad.write_text('{"question": "?"}\n')
    code, err = prune(capsys, src, [bad], parent / "o")
    assert code == 2 and "bad.jsonl:1: a record needs 'messages'" in err
    assert_nothing_left(parent)


@pytest.mark.parametrize("flags, msg", [
    (["--keep", "0"], "--keep must be a fraction in (0, 1]"),
    (["--keep", "1.01"], "--keep must be a fraction in (0, 1]"),
    (["--keep", "0.05"], "--keep 0.05 leaves 1 of 16 experts, fewer than num_experts_per_token = 2"),
    (["--experts", "1"], "--experts must be in [2, 16] (num_experts_per_token to num_experts)"),
    (["--experts", "17"], "--experts must be in [2, 16]"),
])
def test_keep_out_of_range(src, code, parent, capsys, flags, msg):
    rc, err = prune(capsys, src, [code], parent / "o", *flags)
    assert rc == 2 and msg in err
    assert_nothing_left(parent)


def test_source_not_in_a_known_layout(src, code, parent, tmp_path, capsys):
    rc, err = prune(capsys, tmp_path / "missing", [code], parent / "o")
    assert rc == 2 and "missing: no such model folder" in err
    empty = tmp_path / "empty"
    empty.mkdir()
    rc, err = prune(capsys, empty, [code], parent / "o")
    assert rc == 2 and "not a Kimi K3.1 checkpoint in the official layout" in err and "config.json" in err
    llama = tmp_path / "llama"
    shutil.copytree(src, llama)
    (llama / "config.json").write_text(json.dumps({"model_type": "llama"}))
    rc, err = prune(capsys, llama, [code], parent / "o")
    assert rc == 2 and "model_type 'llama' is not a Kimi K3.1 checkpoint" in err
    stacked = tmp_path / "stacked"
    shutil.copytree(src, stacked)
    index = json.loads((stacked / "model.safetensors.index.json").read_text())
    index["weight_map"] = {k.replace(".experts.0.w1.weight_packed", ".switch_mlp.gate_proj.weight"): v
                           for k, v in index["weight_map"].items() if ".experts." not in k
                           or ".experts.0.w1.weight_packed" in k}
    (stacked / "model.safetensors.index.json").write_text(json.dumps(index))
    rc, err = prune(capsys, stacked, [code], parent / "o")
    assert rc == 2 and "stacked `switch_mlp` tensors, an mlx-lm conversion" in err
    assert_nothing_left(parent)


def test_existing_out_is_refused_unless_force(src, code, parent, capsys):
    out = parent / "o"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    rc, err = prune(capsys, src, [code], out)
    assert rc == 2 and "already exists; choose another --out or pass --force" in err
    assert (out / "keep.txt").read_text() == "mine"
    rc, err = prune(capsys, src, [code], out, "--keep", "0.5", "--force")
    assert rc == 0, err
    assert not (out / "keep.txt").exists() and (out / "config.json").exists()
    assert sorted(p.name for p in parent.iterdir()) == ["o"]


def test_out_inside_the_source_is_refused(src, code, capsys):
    rc, err = prune(capsys, src, [code], src / "pruned")
    assert rc == 2 and "must not be, contain or sit inside the source" in err
    rc, err = prune(capsys, src, [code], src, "--keep", "0.5", "--force")
    assert rc == 2 and "must not be, contain or sit inside the source" in err
    assert not (src / "pruned").exists()


def _raise(err):
    def f(*a, **k):
        raise OSError(err, f"simulated: {errno.errorcode[err]}")
    return f


def test_disk_full_while_writing(src, code, parent, capsys, monkeypatch):
    monkeypatch.setattr(writer, "write_shard", _raise(errno.ENOSPC))
    rc, err = prune(capsys, src, [code], parent / "o")
    assert rc == 2 and "no space left on the device" in err and str(parent / "o") in err
    assert_nothing_left(parent)


def test_not_enough_free_space_is_found_before_calibrating(src, code, parent, capsys, monkeypatch):
    from kimi_mlx.prune import pipeline

    monkeypatch.setattr(pipeline.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(1, 1, 1000))
    monkeypatch.setattr(pipeline, "observe", _raise(errno.EIO))  # must not be reached
    rc, err = prune(capsys, src, [code], parent / "o")
    assert rc == 2 and "not enough free space" in err and "1000" not in err and "GB free" in err
    assert_nothing_left(parent)


def test_read_only_output_disk(src, code, parent, capsys, monkeypatch):
    # As root a chmod'ed folder is still writable, so the OS error is simulated.
    monkeypatch.setattr(writer.tempfile, "mkdtemp", _raise(errno.EROFS))
    rc, err = prune(capsys, src, [code], parent / "deeper" / "o")
    assert rc == 2 and "the file system is read-only" in err
    assert_nothing_left(parent)  # the parent folder it created is gone again


def test_permission_denied_at_the_rename(src, code, parent, capsys, monkeypatch):
    real = writer.os.rename

    def rename(a, b):
        if str(b).endswith("/o"):
            raise OSError(errno.EACCES, "simulated")
        return real(a, b)

    monkeypatch.setattr(writer.os, "rename", rename)
    rc, err = prune(capsys, src, [code], parent / "o")
    assert rc == 2 and "permission denied" in err
    assert_nothing_left(parent)


def test_interrupt_leaves_nothing(src, code, parent, monkeypatch):
    from kimi_mlx.prune import pipeline

    monkeypatch.setattr(pipeline, "write_checkpoint", _interrupt)
    assert cli_main(["prune", "--model", str(src), "--calib", str(code), "--out", str(parent / "o"),
                     "--keep", "0.5", "--quiet", "--calib-tokens", "200"]) == 130
    assert_nothing_left(parent)


def _interrupt(*a, **k):
    raise KeyboardInterrupt


def test_random_method_needs_no_calibration_and_makes_no_pass(src, parent, capsys, monkeypatch):
    """--method random without --calib: no pass over the model; the kept experts are the
    seeded draw (numpy default_rng([seed, layer]), top n_keep); --protect-super-experts
    still asks for data."""
    import numpy as np

    from kimi_mlx.prune import pipeline

    def no_pass(*a, **k):
        raise AssertionError("random pruning ran a calibration pass")

    monkeypatch.setattr(pipeline, "observe", no_pass)
    code, err = prune(capsys, src, None, parent / "r", "--keep", "0.5", "--method", "random",
                      "--seed", "3")
    assert code == 0, err
    report = json.loads((parent / "r" / "saliency.json").read_text())
    cfg = json.loads((src / "config.json").read_text())
    E = cfg["text_config"]["num_experts"] if "text_config" in cfg else cfg["num_experts"]
    assert len(report["layers"]) == 2  # layers 1 and 2 of 3 are MoE
    for layer in report["layers"]:
        draw = np.random.default_rng([3, layer["layer"]]).random(E)
        assert layer["kept"] == sorted(np.argsort(-draw, kind="stable")[: E // 2].tolist())
    code, err = prune(capsys, src, None, parent / "p", "--keep", "0.5", "--method", "random",
                      "--protect-super-experts")
    assert code == 2 and "needs calibration data (--calib)" in err
    assert not (parent / "p").exists()
