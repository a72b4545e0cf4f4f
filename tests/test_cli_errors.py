"""Argument errors are reported with the subcommand's usage, not the top-level one."""

import pytest

from kimi_mlx.commands.main import main


def test_unknown_flag_names_the_subcommand(capsys):
    with pytest.raises(SystemExit) as e:
        main(["generate", "--bogus"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "usage: kimi-mlx generate" in err
    assert "kimi-mlx generate: error: unrecognized arguments: --bogus" in err


def test_unknown_top_level_flag_still_uses_the_top_level_usage(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--bogus"])
    assert e.value.code == 2
    assert "kimi-mlx: error: unrecognized arguments: --bogus" in capsys.readouterr().err


def test_convert_errors_name_the_command(tmp_path, capsys):
    assert main(["convert", "--model", str(tmp_path), "--out", str(tmp_path / "o")]) == 2
    assert "kimi-mlx convert: error: give --q-bits" in capsys.readouterr().err


def test_an_unknown_log_level_is_refused_before_loading(capsys):
    with pytest.raises(SystemExit) as e:
        main(["server", "--log-level", "bogus"])
    assert e.value.code == 2
    assert "argument --log-level: not a logging level: 'bogus'" in capsys.readouterr().err
