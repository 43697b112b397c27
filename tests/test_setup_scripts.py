"""The shell scripts that build environments outside CI (benchmarks/*.sh) refuse what would overwrite or misuse
a user's files, with one line and exit 2, before they download anything."""

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _run(script, *args, cwd=ROOT):
    return subprocess.run(["bash", str(ROOT / "benchmarks" / script), *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, timeout=60)


@pytest.mark.parametrize("script", ["jax011_venv.sh", "setup_maxtext.sh", "gpu_compile_setup.sh"])
def test_venv_scripts_refuse_an_existing_directory(script, tmp_path):
    (tmp_path / "keep.txt").write_text("a user's file")
    p = _run(script, tmp_path)
    assert p.returncode == 2 and "already exists" in p.stderr and len(p.stderr.strip().splitlines()) == 1
    assert (tmp_path / "keep.txt").read_text() == "a user's file" and len(list(tmp_path.iterdir())) == 1
    assert not tmp_path.with_name(tmp_path.name + ".partial").exists()


def test_gpu_wheels_refuses_an_unknown_flag(tmp_path):
    p = _run("gpu_wheels.sh", "--maxtex", cwd=tmp_path)  # it writes .whl/ and .git/info/exclude where it runs
    assert p.returncode == 2 and "unknown flag --maxtex" in p.stderr and len(p.stderr.strip().splitlines()) == 1
    assert not list(tmp_path.iterdir())


def test_gpu_compile_setup_refuses_a_python_without_jax_0112(tmp_path):
    site = tmp_path / "site"
    p = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_compile_setup.sh"), str(site)], capture_output=True,
                       text=True, cwd=ROOT, timeout=60, env={"PATH": "/usr/bin:/bin", "PYTHON": "/bin/false"})
    assert p.returncode == 2 and "jax 0.11.2" in p.stderr and len(p.stderr.strip().splitlines()) == 1
    assert not list(tmp_path.iterdir())
