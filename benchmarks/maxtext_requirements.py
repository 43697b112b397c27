"""The requirement list `benchmarks/setup_maxtext.sh` installs into MaxText's own venv: the `tpu` extra of a
maxtext wheel (MaxText's tested dependency set) minus what a CPU or GPU box cannot or need not run.

    python -m benchmarks.maxtext_requirements WHEEL > requirements.txt

Standard library only: it runs with whichever Python calls the setup script.
"""

import re
import sys
import zipfile

EXTRA = "tpu"
# TPU/NVIDIA runtimes (a CPU box cannot use them; a GPU box gets them from jax[cuda12]) and linters/type checkers.
SKIP = re.compile(r"(libtpu|nvidia-.*|cuda-.*|pylint|pyink|pytype|pre-commit|black|isort|astroid|mccabe|importlab|"
                  r"pycnite|scipy-stubs|hypothesis|coverage|auditwheel)", re.I)
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def requirements(metadata: str, extra: str = EXTRA) -> list[str]:
    """The `Requires-Dist` lines of a wheel's METADATA that belong to `extra`, SKIP left out, each with its other
    environment markers kept (e.g. `tzdata; sys_platform == 'win32'`)."""
    clause = rf"extra\s*==\s*['\"]{re.escape(extra)}['\"]"
    is_extra = re.compile(rf"\s*(?:\band\s+{clause}|{clause}(?:\s+and\b)?)\s*")
    out = []
    for line in metadata.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        req, _, marker = line.split(":", 1)[1].partition(";")
        if not is_extra.search(marker):
            continue
        req, marker = req.strip(), is_extra.sub("", marker).strip()
        if not SKIP.fullmatch(NAME.match(req).group(0)):
            out.append(f"{req}; {marker}" if marker else req)
    return out


def wheel_metadata(path: str) -> str:
    with zipfile.ZipFile(path) as z:
        name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        return z.read(name).decode()


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m benchmarks.maxtext_requirements WHEEL")
    print("\n".join(requirements(wheel_metadata(sys.argv[1]))))
