"""The planner and the build tools know the vision tower (issue 22 item 6): `kimi-mlx plan`
counts its bytes on the machine that runs it (the cluster head, stage 0's Mac in the usual
set-up); `prune` and `convert --q-bits` copy every `vision_tower.*` / `mm_projector.*`
tensor byte for byte (they are never quantized), compared on the raw safetensors bytes."""

import argparse
import re
from pathlib import Path

import pytest

from kimi_mlx.checkpoint.shards import read_header, weight_map
from kimi_mlx.commands import plan as plan_cmd
from kimi_mlx.commands.main import main as cli_main
from kimi_mlx.testing.checkpoints import build_checkpoint, tiny_vision_config
from kimi_mlx.testing.prune import moe_text_config, write_code_text

VISION = ("vision_tower.", "mm_projector.")


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("vb") / "src",
                            moe_text_config(num_layers=4, num_experts=16, top_k=2),
                            vision=tiny_vision_config())


def vision_tensors(folder):
    """{name: (dtype, shape, raw bytes)} of the vision tensors, read from the shards."""
    folder = Path(folder)
    out = {}
    for name, shard in weight_map(folder).items():
        if name.startswith(VISION):
            info = read_header(folder / shard)[name]
            with open(folder / shard, "rb") as f:
                f.seek(info.start)
                out[name] = (info.dtype, info.shape, f.read(info.end - info.start))
    return out


def test_prune_and_convert_copy_the_vision_tensors_unchanged(src, tmp_path, capsys):
    want = vision_tensors(src)
    assert len(want) > 10 and {dt for dt, _, _ in want.values()} == {"BF16"}
    code = write_code_text(tmp_path / "code.txt", n=40)
    assert cli_main(["prune", "--model", str(src), "--out", str(tmp_path / "p"), "--calib", str(code),
                     "--keep", "0.5", "--quiet", "--seq-len", "64", "--calib-tokens", "300"]) == 0
    assert cli_main(["convert", "--model", str(src), "--out", str(tmp_path / "q"), "--quiet",
                     "--q-bits", "4", "--q-group-size", "32"]) == 0
    assert cli_main(["convert", "--model", str(src), "--out", str(tmp_path / "qe"), "--quiet",
                     "--q-bits", "8", "--q-group-size", "32", "--expert-bits", "4",
                     "--expert-group-size", "32"]) == 0
    capsys.readouterr()
    for build in ("p", "q", "qe"):
        got = vision_tensors(tmp_path / build)
        assert got.keys() == want.keys(), build
        for name in want:
            assert got[name] == want[name], f"{build}: {name} changed"
    # the quantized builds did quantize the text model
    assert any(n.endswith(".scales") for n in weight_map(tmp_path / "q"))


def _plan(argv, capsys):
    p = argparse.ArgumentParser()
    plan_cmd.add_arguments(p)
    assert plan_cmd.run(p.parse_args(argv)) == 0
    return capsys.readouterr().out


def test_plan_counts_the_tower_on_the_head(capsys):
    from kimi_mlx.placement.layer_bytes import model_bytes

    vision = model_bytes("moonshotai/Kimi-K3.1-Pro").not_loaded["vision"]
    assert 0.8e9 < vision < 1.0e9  # 447M BF16 parameters (K31_SPEC section 7)
    out = _plan(["--model", "moonshotai/Kimi-K3.1-Pro", "--macs", "4x512GB", "--context", "8192"],
                capsys)
    line = next(l for l in out.splitlines() if l.startswith("vision tower + projector"))
    assert f"{vision / 1e9:.1f} GB" in line and "cluster head" in line and line.endswith("fits")
    stage0 = next(r for r in out.splitlines() if re.match(r"^0\s+mac1", r))
    total0 = float(stage0.split()[-3])
    with_tower = float(re.search(r"\(mac1\): ([\d.]+) GB", line).group(1))
    assert with_tower == pytest.approx(total0 + vision / 1e9, abs=0.11)


def test_plan_without_vision_says_nothing(tmp_path, capsys):
    text_only = build_checkpoint(tmp_path / "t", extras=False)
    out = _plan(["--model", str(text_only), "--macs", "1x64GB"], capsys)
    assert "vision tower" not in out and "vision 0" not in out
