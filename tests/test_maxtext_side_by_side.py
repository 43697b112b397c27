"""benchmarks/maxtext_side_by_side.py: MaxText's overrides follow the shared preset and its log is parsed (MaxText
itself runs in its own venv, not in tests)."""

import os
import zipfile

import pytest

from benchmarks import maxtext_side_by_side as sbs
from benchmarks.maxtext_requirements import requirements, wheel_metadata

LOG = """I1123 metric_logger.py:265] completed step: 0, seconds: 0.358, TFLOP/s/device: 0.151, Tokens/s/device: 5723.276, total_weights: 2048
I1123 metric_logger.py:265] completed step: 1, seconds: 0.769, TFLOP/s/device: 0.070, Tokens/s/device: 2661.877, total_weights: 2048
I1123 metric_logger.py:265] completed step: 2, seconds: 9.471, TFLOP/s/device: 0.006, Tokens/s/device: 216.234, total_weights: 2048
I1123 metric_logger.py:265] completed step: 3, seconds: 12.817, TFLOP/s/device: 0.004, Tokens/s/device: 159.791, total_weights: 2048
I1123 metric_logger.py:265] completed step: 4, seconds: 8.712, TFLOP/s/device: 0.006, Tokens/s/device: 235.086, total_weights: 2048
"""


def test_parse_maxtext_log_skips_warmup_steps_and_takes_the_median():
    r = sbs.parse_maxtext_log(LOG)
    assert r["steps timed"] == 3 and r["step s"] == 9.471 and r["maxtext TFLOP/s"] == 0.006


def test_maxtext_args_match_the_shared_preset():
    args = dict(a.split("=", 1) for a in sbs.maxtext_args("cpu", 6, "dense", "/tmp/x"))
    assert (args["base_emb_dim"], args["base_num_decoder_layers"], args["first_num_dense_layers"]) == ("256", "4", "1")
    assert (args["num_experts"], args["num_experts_per_tok"], args["shared_experts"]) == ("16", "4", "1")
    assert (args["per_device_batch_size"], args["max_target_length"], args["dtype"]) == ("8", "256", "float32")
    assert args["sparse_matmul"] == "False" and args["hardware"] == "cpu"
    # MLA at MaxText's deepseek3-tiny ranks, on both sides; MaxText unscanned, dropless unless told a capacity
    assert (args["q_lora_rank"], args["kv_lora_rank"], args["qk_rope_head_dim"], args["v_head_dim"]) == (
        "32", "16", "16", "64")
    ours = sbs.preset("maxtext_cpu")["model"]
    assert (ours["attention"], ours["q_lora_rank"], ours["kv_lora_rank"]) == ("mla", 32, 16)
    assert args["scan_layers"] == "False" and args["capacity_factor"] == "-1.0"
    cap = dict(a.split("=", 1) for a in sbs.maxtext_args("cpu", 6, "dense", "/tmp/x", capacity_factor=1.25))
    assert cap["capacity_factor"] == "1.25" and cap["sparse_matmul"] == "False"
    assert (sbs.maxtext_moe("dropless", "cpu"), sbs.maxtext_moe("dropless", "gpu"), sbs.maxtext_moe("capacity", "gpu")) \
        == ("ragged_dot", "tokamax", "dense")
    gpu = dict(a.split("=", 1) for a in sbs.maxtext_args("gpu", 6, "tokamax", "/tmp/x"))
    assert gpu["use_tokamax_gmm"] == "True" and gpu["dtype"] == "bfloat16" and gpu["weight_dtype"] == "float32"
    assert (args["attention"], gpu["attention"]) == ("dot_product", "cudnn_flash_jax")  # cuDNN on both sides on GPU
    assert dict(a.split("=", 1) for a in sbs.maxtext_args("gpu", 6, "tokamax", "/x", "autoselected"))["attention"] \
        == "autoselected"


def test_setup_keeps_the_tpu_extra_minus_runtimes_and_linters_with_other_markers(tmp_path):
    meta = "\n".join([
        "Name: maxtext", "Requires-Dist: absl-py>=2.5.0; extra == 'tpu'", "Requires-Dist: jax>=0.11.1; extra == 'tpu'",
        "Requires-Dist: jax>=0.11.1; extra == 'cuda12'",  # another extra
        "Requires-Dist: numpy>=2",  # no extra: not MaxText's tested pin set
        "Requires-Dist: libtpu>=0.0.46; (platform_machine == 'x86_64' and sys_platform == 'linux') and extra == 'tpu'",
        "Requires-Dist: nvidia-cuda-cccl>=13.3; (sys_platform == 'linux') and extra == 'tpu'",
        "Requires-Dist: pylint>=4.0.8; extra == 'tpu'", "Requires-Dist: blackjax>=1; extra == 'tpu'",
        "Requires-Dist: tzdata>=2026.4; (sys_platform == 'win32') and extra == 'tpu'",
        "Requires-Dist: uvloop>=0.22; extra == \"tpu\" and python_version >= '3.12'",
    ])
    assert requirements(meta) == ["absl-py>=2.5.0", "jax>=0.11.1", "blackjax>=1",
                                  "tzdata>=2026.4; (sys_platform == 'win32')", "uvloop>=0.22; python_version >= '3.12'"]
    wheel = tmp_path / "maxtext-0.0.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("maxtext-0.0.0.dist-info/METADATA", meta)
    assert wheel_metadata(str(wheel)) == meta


def test_run_maxtext_takes_a_command_on_path(tmp_path, monkeypatch):
    """On the lent GPU machine MaxText runs under `python3` from PATH (its wheels on PYTHONPATH), not a venv path."""
    fake = tmp_path / "fake-python3"
    fake.write_text("#!/bin/sh\n"
                    'if [ "$1" = "-c" ]; then echo /pkg/maxtext; exit 0; fi\n'
                    f"cat <<'LOG'\n{LOG}\nLOG\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    assert sbs.run_maxtext("fake-python3", "cpu", 6, "dense", 60)["step s"] == 9.471
    with pytest.raises(FileNotFoundError, match="setup_maxtext.sh"):
        sbs.run_maxtext("no-such-python3", "cpu", 6, "dense", 60)
    fake.write_text("#!/bin/sh\necho \"ModuleNotFoundError: No module named 'grain'\" >&2\nexit 1\n")
    with pytest.raises(RuntimeError, match="cannot import maxtext: ModuleNotFoundError: No module named 'grain'"):
        sbs.run_maxtext("fake-python3", "cpu", 6, "dense", 60)  # a wheel missing there: the module is named


def test_main_passes_scan_layers_to_our_side(monkeypatch, capsys):
    seen = {}

    def fake_bench(name, dispatch, n_experts, peak, **kw):
        seen.update(kw, name=name)
        return {"MFU %": 10.0, "step ms": 100.0, "tokens/s": 20480.0, "scan layers": kw["scan_layers"]}

    monkeypatch.setattr(sbs.train_step, "bench", fake_bench)
    monkeypatch.setattr(sbs, "measure_peak_flops", lambda: 1e12)
    monkeypatch.setattr(sbs.host_memory, "keep_freed_memory", lambda: None)
    rows = sbs.main(["--shape", "gpu", "--scan_layers", "on", "--skip_maxtext"])
    assert seen["name"] == "maxtext_gpu" and seen["scan_layers"] == "on" and seen["attention"] == "cudnn"
    assert [r["MoE path"] for r in rows] == ["dropless / auto, scan on", "capacity / auto, scan on"]
    assert "skipped" in capsys.readouterr().out
