"""benchmarks/train_revisions.py: trees exported per revision, runs alternated, ratios and loss read right, and
nothing removed but what it made."""

import json
import shutil
import subprocess

import pytest

from benchmarks import train_revisions as tr
from plumbing.errors import UserError

needs_git = pytest.mark.skipif(shutil.which("git") is None or subprocess.run(
    ["git", "-C", str(tr.REPO), "rev-parse", "HEAD"], capture_output=True).returncode != 0,
    reason="needs git and this repository's history (a source archive has neither)")


@needs_git
def test_export_extracts_a_revision_that_imports_its_own_code(tmp_path):
    label = tr.commit_label("HEAD")
    tree = tr.export(label, tmp_path)
    assert tree == tmp_path / f"tree_{label}" and (tree / "train" / "__main__.py").is_file()
    assert not list(tmp_path.glob("*.tar"))  # the archive itself is removed
    tr.check_imports_from(tree)  # python run there imports that tree's moe and train, not the installed ones
    assert tr.export(tr.WORKTREE, tmp_path) == tr.REPO
    with pytest.raises(UserError, match="not a commit"):
        tr.commit_label("no-such-revision-xyz")


@needs_git
def test_two_names_of_one_commit_are_refused_before_anything_is_exported(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        tr.main(["--revs", "HEAD,HEAD~0", "--out", str(tmp_path / "new")])
    assert e.value.code == 2 and "same commit twice" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()  # the --out this command made is gone again


def test_check_imports_refuses_a_tree_that_imports_code_from_elsewhere(tmp_path):
    (tmp_path / "configs").mkdir()  # a folder without the packages: python finds the installed ones
    with pytest.raises(UserError, match="not from that tree"):
        tr.check_imports_from(tmp_path)


def _fake(monkeypatch, speed, seen):
    """export and train_in stand-ins: a run writes 20 windows of 10 steps at speed[rev][round] tokens/s."""
    monkeypatch.setattr(tr, "commit_label", lambda rev: rev)
    monkeypatch.setattr(tr, "check_imports_from", lambda tree: None)

    def fake_export(label, dest):
        (dest / label).mkdir()
        return dest / label

    def fake_train(tree, workdir, train_args):
        rev = tree.name
        r = sum(1 for s in seen if s[0] == rev)
        seen.append((rev, workdir, train_args))
        workdir.mkdir()
        workdir.with_suffix(".log").write_text("a log")
        rows = [{"step": s, "tokens_per_sec": 1.0 if s == 10 else speed[rev][r],  # the first window: the compile
                 "loss": 9.0 - s / 100 + (1e-4 if rev == "new" else 0)} for s in range(10, 201, 10)]
        (workdir / "metrics.jsonl").write_text("\n".join(json.dumps(x) for x in rows))
        return 42.0

    monkeypatch.setattr(tr, "export", fake_export)
    monkeypatch.setattr(tr, "train_in", fake_train)
    return fake_train


def test_measure_alternates_revisions_and_takes_ratios_within_rounds(tmp_path, monkeypatch):
    seen = []
    fake_train = _fake(monkeypatch, {"old": [1000, 500], "new": [1500, 1000]}, seen)  # round 2: a load change
    rows, runs = tr.measure(["old", "new"], 2, [], tmp_path, log=lambda *a: None, train=fake_train)
    assert [s[0] for s in seen] == ["old", "new", "old", "new"]
    assert [r["tokens/s (median of rounds)"] for r in rows] == [750, 1250]
    # speed-ups per round (1.5, 2.0), then their median: not the ratio of the medians (1.667)
    assert rows[1]["tokens/s x first (median of rounds)"] == pytest.approx(1.75)
    assert rows[1]["per round x first"] == "1.50, 2.00" and rows[0]["windows"] == 19
    losses = tr.loss_rows(["old", "new"], runs, 100)
    assert [x["step"] for x in losses] == [100, 200]
    assert losses[0] == {"step": 100, "old": "8.00000", "new": "8.00010"}


def test_main_runs_in_absolute_workdirs_and_removes_only_what_it_made(tmp_path, monkeypatch, capsys):
    seen = []
    _fake(monkeypatch, {"old": [1000], "new": [1500]}, seen)
    out = tmp_path / "out"
    out.mkdir()  # an existing, empty --out given relative to the current directory
    monkeypatch.chdir(tmp_path)
    tr.main(["--revs", "old,new", "--rounds", "1", "--steps", "30", "--out", "out", "--", "--config.x=1"])
    printed = capsys.readouterr().out
    assert "| new | 1500 | 1,500 | 1.5 |" in printed and "| 100 | 8.00000 | 8.00010 |" in printed
    assert all(w.is_absolute() and w.parent == out for _, w, _ in seen)  # not relative to a tree
    assert seen[0][2] == ["--config.train.steps=30", "--config.x=1"]
    assert out.is_dir() and not any(out.iterdir())  # trees, runs and logs removed; the user's --out kept


def test_main_never_writes_into_a_nonempty_out_nor_takes_a_workdir(tmp_path, capsys):
    (tmp_path / "mine.txt").write_text("a user's file")
    with pytest.raises(SystemExit) as e:
        tr.main(["--revs", "HEAD,WORKTREE", "--out", str(tmp_path)])
    assert e.value.code == 2 and "not empty" in capsys.readouterr().err
    assert (tmp_path / "mine.txt").read_text() == "a user's file"
    with pytest.raises(SystemExit) as e:
        tr.main(["--revs", "HEAD,WORKTREE", "--", "--workdir", str(tmp_path / "x")])
    assert e.value.code == 2 and "--workdir after" in capsys.readouterr().err
