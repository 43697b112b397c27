"""The README's commands, run as written on a tiny run (in-process, through each CLI's main): the train
command for configs/tiny.py, then every analysis / export / generation command on `runs/default` (here a
copy of that tiny run: the real default trains for ~7 minutes), and the Python API block."""

import json
import re
import shlex
import shutil
import warnings
from pathlib import Path

import pytest
from PIL import Image

from analysis import loss_curves
from analysis.ablate import cli as ablate
from analysis.dynamics import cli as dynamics
from analysis.rank import cli as rank
from analysis.routing import cli as routing
from analysis.specialization import cli as specialization
from benchmarks.default_run import DOCS, RECORD, SPAN, parse_summary, render
from experiments.masks_round1 import runner as experiments
from train import __main__ as train_cli
from train import export, generate

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
MAINS = {"train": lambda a: train_cli.main(["train", *a]), "analysis.routing": routing.main,
         "analysis.rank": rank.main, "analysis.loss_curves": loss_curves.main, "train.export": export.main,
         "train.generate": generate.main, "analysis.specialization": specialization.main,
         "analysis.ablate": ablate.main, "analysis.dynamics": dynamics.main}
# Not run: the install lines (CI runs them), the template line and the 7-minute default run (only the tiny
# train command is run), and the hour-long mask study (parsed here; tests/test_experiments.py runs it).


def commands() -> list[str]:
    blocks = re.findall(r"```bash\n(.*?)```", README, re.S)
    lines = [line.split("  #")[0].strip() for b in blocks for line in b.splitlines()]
    return [line for line in lines if line.startswith("python -m ")]


def test_readme_lists_the_commands():
    mods = {shlex.split(c)[2] for c in commands()}
    assert {"train", "analysis.routing", "analysis.rank", "analysis.loss_curves", "experiments.masks_round1",
            "analysis.specialization", "analysis.ablate", "analysis.dynamics", "train.export",
            "train.generate"} <= mods


@pytest.mark.slow
def test_readme_commands_run_as_written(tmp_path, monkeypatch, capsys):
    (tmp_path / "configs").symlink_to(ROOT / "configs")
    (tmp_path / "experiments").symlink_to(ROOT / "experiments")  # the mask study's config file
    monkeypatch.chdir(tmp_path)
    ran = []
    train_lines = [c for c in commands() if shlex.split(c)[2] == "train" and "configs/tiny.py" in c]
    assert train_lines, "the README shows how to train configs/tiny.py"
    for line in train_lines:
        train_cli.main(shlex.split(line)[2:] + ["--config.log.progress=False", "--config.log.peak_flops=1e12"])
        ran.append(line)
    # The README's figures for the default are parsed from this summary's form (benchmarks/default_run.py).
    summary = parse_summary(capsys.readouterr().out)
    assert summary["steps"] > 0 and summary["bigram"] > 0 and summary["targets"] > 0
    workdir = shlex.split(train_lines[0]).pop(shlex.split(train_lines[0]).index("--workdir") + 1)
    shutil.copytree(tmp_path / workdir, tmp_path / "runs" / "default")
    for line in commands():
        argv = shlex.split(line)
        mod, args = argv[2], argv[3:]
        if mod == "experiments.masks_round1":
            experiments.parse_flags(["python", *args])  # parsed, not run (an hour of training)
            continue
        if mod not in MAINS or mod == "train":
            continue
        MAINS[mod](args + (["--no_progress"] if mod == "analysis.routing" else []))
        ran.append(line)
    out = capsys.readouterr().out
    assert len(ran) >= 6, ran
    assert (tmp_path / "runs/default/analysis/routing.json").is_file()
    assert (tmp_path / "runs/default/rank/rank.json").is_file()
    assert (tmp_path / "runs/default/loss_curves.png").is_file()
    # every result file says which software and machine made it (rundir.provenance)
    results = [tmp_path / "runs/default/rank/rank.json"] + [tmp_path / "runs/default/analysis" / name for name in (
        "routing.json", "specialization.json", "ablation.json", "dynamics.json")]
    for path in results:
        assert set(json.loads(path.read_text())["provenance"]) == {"commit", "jax", "machine"}, path
    assert (tmp_path / "exports/default/config.json").is_file()
    assert "In the beginning" in out
    # Every figure an analysis wrote names the run and checkpoint step it shows (analysis.figures.source).
    pngs = sorted((tmp_path / "runs/default").glob("*/*.png"))
    assert len(pngs) >= 10, pngs
    for png in pngs:
        source = Image.open(png).text.get("Source", "")
        assert "runs/default" in source and "step" in source, (png.name, source)

    api = re.search(r"```python\n(.*?)```", README, re.S).group(1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a deprecated call in the README's API is a failure, not a warning
        exec(compile(api, "README.md", "exec"), {})


def test_the_default_runs_figures_are_rendered_from_its_record():
    """Every copy of the default run's figures in README.md and docs/ is the rendering of docs/default_run.json,
    which benchmarks.default_run writes from the README command's own output: none is copied by hand."""
    record = json.loads(RECORD.read_text())
    spans = {}
    for path in DOCS:
        for m in SPAN.finditer(path.read_text()):
            spans.setdefault(path.name, []).append(m.group(1))
            assert m.group(2) == render(m.group(1), record), (path.name, m.group(1))
    assert {"minutes", "gap"} <= set(spans["README.md"]) and "curve" in spans["training.md"]
    assert record["command"] == "pip install -e . && python -m train" and record["command"] in README
