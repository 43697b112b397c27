"""analysis.compare, .paths, .counterfactual and .importance answer --help (exit 0) and a mistyped flag (exit 2,
one line) without loading JAX, matplotlib or the training stack."""

import subprocess
import sys

import pytest

HEAVY = ("jax", "torch", "tensorboardX", "orbax.checkpoint", "tensorflow_datasets", "grain", "matplotlib")


@pytest.mark.parametrize("module", ["compare", "paths", "counterfactual", "importance"])
def test_help_and_bad_flag_without_heavy_imports(module):
    for argv, code in ((["--help"], 0), (["--workdir", "x", "--stepp", "3"], 2)):
        out = subprocess.run([sys.executable, "-X", "importtime", "-m", f"analysis.{module}", *argv],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == code, (argv, out.stderr[-500:])
        loaded = {line.split("|")[-1].strip() for line in out.stderr.splitlines() if line.startswith("import time:")}
        assert not loaded & set(HEAVY), (argv, sorted(loaded & set(HEAVY)))
        if code == 0:
            assert out.stdout.startswith(f"usage: python -m analysis.{module}")
        else:
            errors = [line for line in out.stderr.splitlines() if not line.startswith("import time:")]
            assert len(errors) == 1 and "did you mean --step?" in errors[0], errors
