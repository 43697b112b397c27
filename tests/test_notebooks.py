"""Every notebook in analysis/notebooks runs top to bottom on the tiny trained run (papermill; any cell error
fails the test) and prints no warning. The parameters cell gets the run directory, a small token budget and an
output folder."""

import json
import logging
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
NOTEBOOKS = sorted((ROOT / "analysis" / "notebooks").glob("*.ipynb"))


def _kernel_name():
    """The registered python3 kernel, or one registered for this interpreter if there is none."""
    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel

    try:
        KernelSpecManager().get_kernel_spec("python3")
    except NoSuchKernel:
        from ipykernel.kernelspec import install

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
    import papermill
    from traitlets.config import Config

    params = {"workdir": str(tiny_run), "max_tokens": 1000, "compare_step": 10, "out_dir": str(tmp_path / "out"),
              "baseline_tokens": 512, "shuffles": 3}
    with caplog.at_level(logging.WARNING, logger="papermill"):
        # IPC, not TCP, between papermill and its local kernel: the kernel warns about unencrypted TCP.
        papermill.execute_notebook(str(path), str(tmp_path / path.name), parameters=params, cwd=str(ROOT),
                                   kernel_name=_kernel_name(), progress_bar=False, execution_timeout=600,
                                   config=Config({"KernelManager": {"transport": "ipc"}}))
    assert not caplog.records, [r.getMessage() for r in caplog.records]  # e.g. a parameter line it cannot parse
    assert _stderr(tmp_path / path.name) == ""
    if path.name == "routing.ipynb":
        out = tmp_path / "out"
        assert (out / "tokens.html").is_file() and (out / "loss_curves.png").is_file()
        assert len(list(out.glob("*.png"))) >= 16
        for name in ("specialization.png", "ablation_importance.png", "dynamics_saturation.png", "dynamics_bias.png"):
            assert (out / name).is_file(), name
