"""Every notebook in analysis/notebooks runs top to bottom on the tiny trained run (papermill; any cell error
fails the test) and prints no warning. The parameters cell gets a copy of the run directory (the notebook writes
into it by default) and a small token budget. routing.ipynb writes the files python -m analysis.routing writes,
under the same names, next to the run."""

import json
import logging
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
NOTEBOOKS = sorted((ROOT / "analysis" / "notebooks").glob("*.ipynb"))


def _kernel_name():
    """The registered python3 kernel, or one registered for this interpreter if there is none."""
    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel  # optional: the [test] extras

    try:
        KernelSpecManager().get_kernel_spec("python3")
    except NoSuchKernel:
        from ipykernel.kernelspec import install  # optional: the [test] extras

        install(user=True)
    return "python3"


def test_notebooks_found():
    assert any(p.name == "routing.ipynb" for p in NOTEBOOKS)


def _stderr(path):
    """Everything the notebook's cells wrote to stderr (warnings land there)."""
    cells = json.loads(Path(path).read_text())["cells"]
    return "".join("".join(o.get("text", "")) for c in cells for o in c.get("outputs", []) if o.get("name") == "stderr")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs(path, tiny_run, tmp_path, caplog):
    import papermill  # optional: the [test] extras, with traitlets
    from traitlets.config import Config

    workdir = tmp_path / "run"  # a copy: the notebook writes into WORKDIR/analysis, and tiny_run is read-only
    shutil.copytree(tiny_run, workdir)
    params = {"workdir": str(workdir), "max_tokens": 1000, "compare_step": 10, "baseline_tokens": 512, "shuffles": 3}
    with caplog.at_level(logging.WARNING, logger="papermill"):
        # IPC, not TCP, between papermill and its local kernel: the kernel warns about unencrypted TCP.
        papermill.execute_notebook(str(path), str(tmp_path / path.name), parameters=params, cwd=str(ROOT),
                                   kernel_name=_kernel_name(), progress_bar=False, execution_timeout=600,
                                   config=Config({"KernelManager": {"transport": "ipc"}}))
    assert not caplog.records, [r.getMessage() for r in caplog.records]  # e.g. a parameter line it cannot parse
    assert _stderr(tmp_path / path.name) == ""
    if path.name == "routing.ipynb":
        _same_files_as_the_cli(workdir, tmp_path / "cli", tmp_path / path.name)


# What the notebook writes besides analysis.routing's files: the figures of analysis.loss_curves,
# analysis.specialization, analysis.ablate and analysis.dynamics, under their names.
OTHER_FIGURES = {"loss_curves.png", "specialization.png", "ablation_importance.png", "ablation_domains.png",
                 "dynamics_saturation.png", "dynamics_load.png", "dynamics_bias.png"}


def _same_files_as_the_cli(workdir, cli_out, executed):
    from analysis.routing import cli as routing

    out = workdir / "analysis"  # the default, as python -m analysis.routing's
    cells = json.loads(executed.read_text())["cells"]
    stdout = "".join("".join(o.get("text", "")) for c in cells for o in c.get("outputs", []) if o.get("name") == "stdout")
    assert f"writing into {out.resolve()}\n" in stdout
    routing.main(["--workdir", str(workdir), "--out", str(cli_out), "--max_tokens", "1000", "--compare_step", "10",
                  "--no_progress"])
    cli = {p.name for p in cli_out.iterdir()}
    notebook = {p.name for p in out.iterdir()}
    assert {"routing.json", "tokens.html", "domain_specialization_top1.png", "saturation.png"} <= cli
    assert cli <= notebook, cli - notebook
    assert notebook - cli == OTHER_FIGURES, notebook - cli
