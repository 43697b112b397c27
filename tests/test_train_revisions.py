"""benchmarks/train_revisions.py: trees exported per revision, runs alternated, ratios and loss read right."""

import json
import shutil
import subprocess

import pytest

from benchmarks import train_revisions as tr
from train.errors import UserError

needs_git = pytest.mark.skipif(shutil.which("git") is None or subprocess.run(
    ["git", "-C", str(tr.REPO), "rev-parse", "HEAD"], capture_output=True).returncode != 0,
    reason="needs git and this repository's history (a source archive has neither)")


@needs_git
def test_export_extracts_a_revision_that_imports_its_own_code(tmp_path):
    label, tree = tr.export("HEAD", tmp_path)
    assert tree == tmp_path / f"tree_{label}" and (tree / "train" / "__main__.py").is_file()
    assert not list(tmp_path.glob("*.tar"))  # the archive itself is removed
    tr.check_imports_from(tree)  # python run there imports that tree's moe and train, not the installed ones
    assert tr.export(tr.WORKTREE, tmp_path) == (tr.WORKTREE, tr.REPO)
    with pytest.raises(UserError, match="not a commit"):
        tr.export("no-such-revision-xyz", tmp_path)


def test_check_imports_refuses_a_tree_that_imports_code_from_elsewhere(tmp_path):
    (tmp_path / "configs").mkdir()  # a folder without the packages: python finds the installed ones
    with pytest.raises(UserError, match="not from that tree"):
        tr.check_imports_from(tmp_path)


def test_measure_alternates_revisions_and_takes_ratios_within_rounds(tmp_path, monkeypatch):
    monkeypatch.setattr(tr, "export", lambda rev, dest: (rev, dest / rev))
    speed = {"old": [1000, 500], "new": [1500, 1000]}  # round 2 is slower for both: a load change
    order = []

    def fake_train(tree, workdir, train_args):
        rev, r = tree.name, len([o for o in order if o == tree.name])
        order.append(rev)
        workdir.mkdir(parents=True)
        rows = [{"step": s, "tokens_per_sec": 1.0 if s == 10 else speed[rev][r],  # the first window: the compile
                 "loss": 9.0 - s / 100 + (1e-4 if rev == "new" else 0)} for s in range(10, 201, 10)]
        (workdir / "metrics.jsonl").write_text("\n".join(json.dumps(x) for x in rows))
        return 42.0

    rows, runs = tr.measure(["old", "new"], 2, [], tmp_path, log=lambda *a: None, train=fake_train)
    assert order == ["old", "new", "old", "new"]
    assert [r["tokens/s (median of rounds)"] for r in rows] == [750, 1250]
    # speed-ups per round (1.5, 2.0), then their median: not the ratio of the medians (1.667)
    assert rows[1]["tokens/s x first (median of rounds)"] == pytest.approx(1.75)
    assert rows[1]["per round x first"] == "1.50, 2.00" and rows[0]["windows"] == 19
    losses = tr.loss_rows(["old", "new"], runs, 100)
    assert [x["step"] for x in losses] == [100, 200]
    assert losses[0] == {"step": 100, "old": "8.00000", "new": "8.00010"}


def test_main_never_writes_into_a_nonempty_out(tmp_path, capsys):
    (tmp_path / "mine.txt").write_text("a user's file")
    with pytest.raises(SystemExit) as e:
        tr.main(["--revs", "HEAD,WORKTREE", "--out", str(tmp_path)])
    assert e.value.code == 2 and "not empty" in capsys.readouterr().err
    assert (tmp_path / "mine.txt").read_text() == "a user's file"
