"""Bad input that used to get an unhelpful line or a traceback: each gets one line naming the thing and the fix
(the broader table is tests/test_bad_input.py)."""

import os
from pathlib import Path

import pytest

from analysis.routing import cli as routing
from plumbing.errors import UserError
from rundir.layout import check_workdir
from train import generate
from train.command_line import load_config_file

ROOT = Path(__file__).resolve().parent.parent


def test_a_symlink_loop_workdir_says_so(tmp_path):
    os.symlink(tmp_path / "b", tmp_path / "a")
    os.symlink(tmp_path / "a", tmp_path / "b")
    with pytest.raises(UserError, match="symbolic link that leads nowhere"):
        check_workdir(tmp_path / "a")


def test_a_dashed_flag_suggests_the_underscored_one(capsys):
    with pytest.raises(SystemExit) as e:
        generate.main(["--workdir", "x", "--prompt", "hi", "--max-new-tokens", "3"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "did you mean --max_new_tokens?" in err and err.count("\n") == 1, err


def test_a_config_file_typo_suggests_the_closest_file():
    with pytest.raises(UserError, match=r"configs/tiy.py not found; pass an existing file; did you mean "
                                        r"configs/tiny.py\?"):
        load_config_file("configs/tiy.py")


def test_a_token_that_is_not_utf8_is_one_line(tiny_run, tmp_path):
    """A byte the locale cannot decode reaches argv as a surrogate (Python's surrogateescape), as here; the
    tokenizer would raise a TypeError."""
    with pytest.raises(UserError, match=r"--token b'\\xff' is not UTF-8 text"):
        routing.parse_args(["--workdir", str(tiny_run), "--out", str(tmp_path), "--token", b"\xff".decode(
            "utf-8", "surrogateescape")])
