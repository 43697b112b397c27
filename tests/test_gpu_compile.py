"""benchmarks/gpu_compile.py: what can be checked without the CUDA plugin (CI has none): its refusals, a row
that fails or hangs in its subprocess, and the kernel counts it reads off the optimized HLO."""

import json
import os
import subprocess
import time

import pytest

from benchmarks import gpu_compile


def test_without_the_cuda_plugin_it_says_how_to_install_it(monkeypatch, capsys):
    monkeypatch.setattr(gpu_compile, "plugin_ready", lambda: False)
    with pytest.raises(SystemExit) as e:
        gpu_compile.main([])
    assert e.value.code == 2 and "gpu_compile_setup.sh" in capsys.readouterr().err


def test_a_missing_target_config_is_refused(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(gpu_compile, "plugin_ready", lambda: True)
    with pytest.raises(SystemExit) as e:
        gpu_compile.main(["--target", str(tmp_path / "none.txtpb")])
    assert e.value.code == 2 and "--target" in capsys.readouterr().err


SPEC = dict(dispatch="dropless", grouped="slab", experts=8, scan="on", remat="save_moe", n_layers=2, batch=1,
            target=gpu_compile.TARGET, attention="pallas_flash")


def test_a_row_that_fails_or_hangs_says_so(monkeypatch):
    def failing(cmd, timeout, env):
        assert json.loads(cmd[cmd.index("--_row") + 1]) == SPEC  # the row's spec reaches the subprocess
        return subprocess.CompletedProcess(cmd, 1, stdout="", stderr="Traceback...\nRuntimeError: no cuda\n"
                                           "For simplicity, JAX has removed its internal frames")

    monkeypatch.setattr(gpu_compile, "run_group", failing)
    row = gpu_compile._run_in_subprocess(SPEC, timeout=5)
    assert row["compile s"].startswith("failed") and "RuntimeError: no cuda" in row["compile s"]

    def hanging(cmd, timeout, env):
        raise subprocess.TimeoutExpired(cmd, timeout)

    monkeypatch.setattr(gpu_compile, "run_group", hanging)
    assert gpu_compile._run_in_subprocess(SPEC, timeout=5)["compile s"] == "> 5 (not finished)"


def test_a_finished_row_is_read_from_the_subprocess(monkeypatch):
    row = {"grouped matmul": "slab", "compile s": 12.5}
    monkeypatch.setattr(gpu_compile, "run_group", lambda cmd, timeout, env: subprocess.CompletedProcess(
        cmd, 0, stdout="log line\nROW " + json.dumps(row) + "\n", stderr=""))
    assert gpu_compile._run_in_subprocess(SPEC, timeout=5) == row


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return "\nState:\tZ" not in f.read()  # a zombie has exited
    except FileNotFoundError:
        return False


def test_a_timeout_kills_the_rows_child_processes_too(tmp_path):
    """As ptxas under a hung compile: a grandchild of the row's process must not outlive the timeout."""
    pidfile = tmp_path / "grandchild.pid"
    cmd = ["bash", "-c", 'sleep 300 & echo $! > "$PIDFILE"; wait']
    with pytest.raises(subprocess.TimeoutExpired):
        gpu_compile.run_group(cmd, timeout=5, env={**os.environ, "PIDFILE": str(pidfile)})
    grandchild = int(pidfile.read_text())
    deadline = time.time() + 5
    while _alive(grandchild) and time.time() < deadline:
        time.sleep(0.1)
    assert not _alive(grandchild)


@pytest.mark.parametrize("flags", [["--experts", "8,x"], ["--dispatch", "droples"], ["--dispatch", "dropless:atomic"],
                                   ["--dispatch", "capacity:gather"], ["--grouped_matmul", "slb"],
                                   ["--scan_layers", "maybe"], ["--remat", "on"], ["--attention", "cudnn"]])
def test_bad_flags_get_one_line_and_exit_2(monkeypatch, capsys, flags):
    monkeypatch.setattr(gpu_compile, "plugin_ready", lambda: True)
    with pytest.raises(SystemExit) as e:
        gpu_compile.main(flags)
    assert e.value.code == 2 and flags[0] in capsys.readouterr().err


def test_kernel_stats_count_the_optimized_programs_kernels():
    hlo = ('%f = fusion(%a), kind=kCustom, backend_config={"kind":"__triton_nested_gemm_fusion"}\n'
           "%s = scatter(%x, %i, %u)\n%w = while(%t)\n%c = conditional(%p)\n%g = fusion(%b), kind=kLoop\n")
    stats = gpu_compile._kernel_stats(hlo)
    assert (stats["fusions"], stats["triton GEMMs"], stats["scatters"], stats["whiles"], stats["conditionals"]) == (
        2, 1, 1, 1, 1)


def test_the_h200_target_config_is_shipped():
    text = open(gpu_compile.TARGET).read()
    assert "cuda_compute_capability" in text and 'device_description_str: "NVIDIA H200"' in text
