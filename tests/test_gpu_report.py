"""benchmarks/gpu_report.py runs end to end at toy shapes on CPU and writes every section of its report."""

import os
import shlex
import subprocess
from pathlib import Path

import pytest

from benchmarks import gpu_report


@pytest.mark.slow  # a few small compilations (~1 min on a shared 2-core box)
def test_gpu_report_tiny_writes_every_section(tmp_path):
    out = tmp_path / "report.md"
    gpu_report.main(["--tiny", "--out", str(out), "--attention_impl", "xla"])
    text = out.read_text()
    for title in ("## Device", "## GPU-only tests", "## Grouped matmuls' bf16 error", "## MoE layer vs dense FFN", "## Train step",
                  "## Train step profile", "## MoE layer, skewed routings"):
        assert title in text
    assert "FAILED" not in text
    assert "test_cudnn_equals_einsum_on_gpu" in text  # the GPU tests were collected
    assert "from 4 to 8 routed experts" in text
    assert "| empty_and_padding | d/dw_down |" in text  # the accuracy table
    assert "| dropless:gather | slab |" in text  # the layer rows A/B dropless's backward by gathers
    assert "| dropless | slab:1.25/1.5/2 | skewed@0.06 |" in text  # the slabs' A/B under an uneven routing
    assert "dot_general" in text  # the profile's table names the ops' JAX origin
    assert "## Decoding at long context" in text and "| mla | naive | 128 |" in text
    assert "XLA target config: none (not a GPU)" in text and not list(tmp_path.glob("*.txtpb"))


@pytest.mark.parametrize("flag,value", [("--sections", "tests,speed"), ("--remat", "off,everything")])
def test_flags_reject_unknown_names(capsys, flag, value):
    with pytest.raises(SystemExit) as e:
        gpu_report.main([flag, value])
    assert e.value.code == 2 and flag in capsys.readouterr().err


def test_the_gpus_target_config_is_saved_beside_the_report(monkeypatch, tmp_path):
    """On a GPU, XLA dumps its target config when it compiles; the report keeps it for benchmarks/gpu_compile.py."""
    def fake_gpu_process(cmd, env, **kw):
        assert env["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"  # the report's process holds the GPU's memory
        dump = env["XLA_FLAGS"].split("=", 1)[1]
        with open(os.path.join(dump, "module_0001.jit__lambda.gpu_target_config.pbtxt"), "w") as f:
            f.write('device_description_str: "NVIDIA H200"\n')
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(subprocess, "run", fake_gpu_process)
    line = gpu_report.save_target_config(str(tmp_path / "report.md"))
    saved = tmp_path / "report.target_config.txtpb"
    assert str(saved) in line and saved.read_text() == 'device_description_str: "NVIDIA H200"\n'


def test_a_hung_target_config_process_does_not_end_the_report(monkeypatch, tmp_path):
    def hung(cmd, timeout, **kw):
        raise subprocess.TimeoutExpired(cmd, timeout)

    monkeypatch.setattr(subprocess, "run", hung)
    assert "not saved" in gpu_report.save_target_config(str(tmp_path / "report.md"))
    assert not list(tmp_path.iterdir())


SESSION = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_session.sh"


def test_gpu_session_steps_are_valid_gpu_report_flags():
    steps = [shlex.split(line)[3:] for line in SESSION.read_text().splitlines() if line.startswith("step ")]
    assert len(steps) == 6
    sections = []
    for args in steps:
        a = gpu_report.parser().parse_args(args)
        sections += a.sections.split(",")
    # every section has its step but the accuracy table (the GPU tests, in the tests step, assert its bounds)
    assert set(sections) == set(gpu_report.SECTIONS) - {"accuracy"}


def test_gpu_session_skips_the_steps_its_budget_cannot_hold(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path), BUDGET_S="30")
    done = subprocess.run(["bash", str(SESSION)], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    console = (tmp_path / "console.txt").read_text()
    assert console.count(": skipped,") == 6 and "== done" in console


def test_gpu_session_runs_each_step_under_its_limit_and_reports_its_exit(tmp_path):
    """A stand-in python3 that prints its arguments and fails: every step runs gpu_report with its flags under
    `timeout`, and the console records each step's exit status."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text('#!/bin/sh\necho "FAKE $*"\nexit 3\n')
    (bin_dir / "python3").chmod(0o755)
    out = tmp_path / "out"
    env = dict(os.environ, OUT=str(out), PATH=f"{bin_dir}:{os.environ['PATH']}")
    done = subprocess.run(["bash", str(SESSION)], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    console = (out / "console.txt").read_text()
    for name in ("train", "tests", "layer_profile", "fallback", "decode", "speculative"):
        assert f"FAKE -m benchmarks.gpu_report --out {out}/{name}.md --sections" in console, console
        assert f"== {name}: exit 3 after" in console, console
    assert "--remat save_moe\n" in console and console.count("--no_target_config") == 5
