"""Every notebook in analysis/notebooks runs top to bottom on the tiny trained run (papermill; any cell error
fails the test). The parameters cell gets the run directory, a small token budget and an output folder."""

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


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs(path, tiny_run, tmp_path):
    import papermill

    params = {"workdir": str(tiny_run), "max_tokens": 1000, "compare_step": 10, "out_dir": str(tmp_path / "out")}
    papermill.execute_notebook(str(path), str(tmp_path / path.name), parameters=params, cwd=str(ROOT),
                               kernel_name=_kernel_name(), progress_bar=False, execution_timeout=600)
    if path.name == "routing.ipynb":
        assert (tmp_path / "out" / "tokens.html").is_file()
        assert len(list((tmp_path / "out").glob("*.png"))) >= 9
