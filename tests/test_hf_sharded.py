"""The sharded HF import (moe/hf/sharded.py, moe/hf/pieces.py, SafetensorsFiles.read_block): a box of a stored
tensor is read from its own byte ranges (FP8 by whole scale tiles, partial tiles at the edges, dequantized by
moe/hf/quant.py's rule) and equals the same box of the whole tensor; every variable's slice equals the slice of the
whole variable; `load_hf_moe(DIR, mesh=...)` on 8 devices equals the single-host import, each device's slice read
on its own (about 1/8 of the bytes); and 2 processes x 4 devices each read about half the checkpoint."""

import json
import os
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file

torch = pytest.importorskip("torch", reason="torch builds the reference models")
transformers = pytest.importorskip("transformers", reason="transformers builds the reference models")
transformers.utils.logging.disable_progress_bar()

from moe.hf import load_hf_moe  # noqa: E402
from moe.hf.load import open_checkpoint  # noqa: E402
from moe.hf.pieces import Piece  # noqa: E402
from moe.hf.quant import Fp8Blocks  # noqa: E402
from moe.hf.tensors import SafetensorsFiles, read_tensors  # noqa: E402
from moe.hf.weights import plan  # noqa: E402
from moe.sharding import make_mesh, state_shardings  # noqa: E402
from tests import test_hf_deepseek, test_hf_families  # noqa: E402
from tests.conftest import FAST_COMPILE_XLA_FLAGS  # noqa: E402
from tests.hf_random import deepseek_rule, quantize, random_hf, write_fp8  # noqa: E402
from tests.test_multiprocess import _free_port  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BLOCK = (24, 40)  # FP8 tiles that do not divide the tiny shapes: partial tiles at the bottom and right edges


def _boxes(shape, rng, n=12):
    """Random boxes (a slice per axis), the whole tensor and single elements at the corners among them."""
    out = [tuple(slice(None) for _ in shape), tuple(slice(d - 1, d) for d in shape), tuple(slice(0, 1) for _ in shape)]
    for _ in range(n):
        box = []
        for d in shape:
            a = int(rng.integers(0, d))
            box.append(slice(a, int(rng.integers(a + 1, d + 1))))
        out.append(tuple(box))
    return out


def test_read_block_reads_the_box_and_only_its_bytes(tmp_path):
    rng = np.random.default_rng(0)
    arrays = {"a": rng.standard_normal((5, 7, 9)).astype(ml_dtypes.bfloat16),
              "b": rng.standard_normal((33, 17)).astype(np.float32)}
    save_file(arrays, str(tmp_path / "model.safetensors"))
    files = SafetensorsFiles(str(tmp_path), keep_dtype=True)
    for name, arr in arrays.items():
        for box in _boxes(arr.shape, rng):
            files.bytes_read.clear()
            got = files.read_block(name, box)
            np.testing.assert_array_equal(got, arr[box])
            assert got.dtype == arr.dtype and files.bytes_read[name] == arr[box].nbytes


@pytest.mark.parametrize("shape", [(100, 70), (3, 50, 90)])
def test_an_fp8_box_reads_whole_tiles_and_equals_the_dequantized_box(tmp_path, shape):
    """DeepSeek's rule indexes tiles from the tensor's origin: a box starting inside a tile reads that tile whole
    (and its scale), and nothing outside the tiles the box touches."""
    rng = np.random.default_rng(1)
    w = rng.standard_normal(shape).astype(np.float32)
    lead = shape[:-2]
    qs = [quantize(w[i], BLOCK) for i in np.ndindex(*lead)] if lead else [quantize(w, BLOCK)]
    q = np.stack([a for a, _ in qs]).reshape(shape)
    s = np.stack([b for _, b in qs]).reshape(*lead, *qs[0][1].shape)
    save_file({"w": q, "w_scale_inv": s}, str(tmp_path / "model.safetensors"))
    files = SafetensorsFiles(str(tmp_path), Fp8Blocks(*BLOCK))
    whole = np.stack([deepseek_rule(a, b, BLOCK) for a, b in qs]).reshape(shape)
    np.testing.assert_array_equal(files.read("w"), whole)
    for box in _boxes(shape, rng):
        files.bytes_read.clear()
        np.testing.assert_array_equal(files.read_block("w", box), whole[box])
        lo = [b.indices(n)[0] for b, n in zip(box[-2:], shape[-2:])]
        hi = [b.indices(n)[1] for b, n in zip(box[-2:], shape[-2:])]
        tiles = [(a // t, -(-z // t)) for a, z, t in zip(lo, hi, BLOCK)]
        rows, cols = [min(b * t, n) - a * t for (a, b), t, n in zip(tiles, BLOCK, shape[-2:])]
        n_lead = int(np.prod([len(range(*b.indices(n))) for b, n in zip(box[:-2], lead)]))
        assert files.bytes_read["w"] == n_lead * rows * cols  # one byte an FP8 value: the touched tiles only
        assert files.bytes_read["w_scale_inv"] == 4 * n_lead * (tiles[0][1] - tiles[0][0]) * (tiles[1][1] - tiles[1][0])


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> directory: deepseek_v3 in block FP8 with an MTP layer (MLA, partial tiles, a dense layer), and
    qwen3_moe with its experts stored fused (gate_up_proj [E, 2F, D], down_proj [E, D, F]) and a tied head."""
    out = {}
    src = tmp_path_factory.mktemp("deepseek_src")
    hf = random_hf(test_hf_deepseek.FAMILIES["deepseek_v3"]())
    hf.save_pretrained(str(src))
    test_hf_deepseek._add_mtp_layer(src, read_tensors(str(src)), hf.config.num_hidden_layers)
    c = json.loads((src / "config.json").read_text())
    c["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(BLOCK)}
    out["deepseek_v3_fp8"] = tmp_path_factory.mktemp("deepseek_v3_fp8")
    write_fp8(out["deepseek_v3_fp8"], c, read_tensors(str(src)), BLOCK)
    qwen = tmp_path_factory.mktemp("qwen3_moe_fused")
    hf = random_hf(test_hf_families.FAMILIES["qwen3_moe"]())
    hf.save_pretrained(str(qwen))
    sd, fused = read_tensors(str(qwen)), {}
    E = hf.config.num_experts
    for k in list(sd):
        if ".experts.0.gate_proj." in k:
            p = k.split("experts.0.")[0] + "experts."
            fused[p + "gate_up_proj"] = np.stack([np.concatenate([sd.pop(f"{p}{e}.gate_proj.weight"),
                                                                  sd.pop(f"{p}{e}.up_proj.weight")]) for e in range(E)])
            fused[p + "down_proj"] = np.stack([sd.pop(f"{p}{e}.down_proj.weight") for e in range(E)])
    save_file({**sd, **fused}, str(qwen / "model.safetensors"), metadata={"format": "pt"})
    out["qwen3_moe_fused"] = qwen
    return out


@pytest.mark.parametrize("name", ["deepseek_v3_fp8", "qwen3_moe_fused"])
def test_every_variable_slice_equals_the_slice_of_the_whole_variable(checkpoints, name):
    ck = open_checkpoint(str(checkpoints[name]))
    rng = np.random.default_rng(2)
    steps = plan(ck.cfg, ck.layout, ck.files.shapes, ck.where)
    pieces = {k: p for s in steps for k, p in s.pieces.items()}
    assert any(p.rows for p in pieces.values()) == (name == "qwen3_moe_fused")  # the up half of gate_up_proj
    for k, piece in pieces.items():
        whole = piece.read(ck.files)
        for box in _boxes(piece.shape, rng, n=4):
            np.testing.assert_array_equal(piece.read_slice(ck.files, box), whole[box], err_msg=k)


def _leaves(model):
    return {".".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(nnx.state(model))}


@pytest.mark.parametrize("name", ["deepseek_v3_fp8", "qwen3_moe_fused"])
def test_the_sharded_import_equals_the_single_host_import(checkpoints, name, monkeypatch):
    """On 8 devices (fsdp 2 x expert 4): every array as training shards it, the values of the single-host import,
    and each device's slice of an expert array read on its own: 1/8 of that array's bytes."""
    path = str(checkpoints[name])
    want = _leaves(load_hf_moe(path)[0])
    mesh = make_mesh(1, 2, 4, 1)
    reads, read_slice = [], Piece.read_slice

    def counted(self, src, index):
        before = src.bytes_read.total()
        out = read_slice(self, src, index)
        reads.append((self, src.bytes_read.total() - before))
        return out

    monkeypatch.setattr(Piece, "read_slice", counted)
    model, _ = load_hf_moe(path, mesh=mesh)
    got = _leaves(model)
    assert set(got) == set(want)
    shardings = dict(nnx.to_flat_state(state_shardings(nnx.state(model), mesh)))
    for k, v in got.items():
        assert v.sharding == shardings[tuple(int(p) if p.isdigit() else p for p in k.split("."))].get_value(), k
        np.testing.assert_array_equal(np.asarray(v), np.asarray(want[k]), err_msg=k)
    ck = open_checkpoint(path)
    experts = [(p, n) for p, n in reads if p.names and "experts" in p.names[0] and "shared" not in p.names[0]]
    n_moe = sum(ck.cfg.is_moe_layer(i) for i in range(ck.cfg.n_layers + ck.cfg.mtp_depth))  # MTP blocks too
    assert len(experts) == 8 * 3 * n_moe  # each device's slice of each expert array, read once
    for piece, n in experts:
        whole = sum(ck.files.stored_bytes(t) for t in piece.names)
        whole //= ck.files.shapes[piece.names[0]][-2] // piece.hf_shape[-2]  # the gate or up half of gate_up_proj
        if name == "qwen3_moe_fused":
            assert n == whole // 8, (piece.names[0], n, whole)
        else:  # FP8 tiles of 40 columns straddle the fsdp cut at 32: both halves read those tiles whole
            assert whole // 8 <= n <= whole // 4, (piece.names[0], n, whole)


WORKER = """
import json, sys, jax
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(num_processes=2, process_id=int(sys.argv[2]))
import numpy as np
from flax import nnx
from moe.hf import load_hf_moe
from moe.hf.load import open_checkpoint
from moe.hf.sharded import load_sharded
from moe.sharding import make_mesh
ck = open_checkpoint(sys.argv[1])
model = load_sharded(ck.cfg, ck.layout, ck.files, ck.where, make_mesh(1, 2, 4, 1))
ref = load_hf_moe(sys.argv[1])[0]  # the single-host import, to compare this process's shards with
want = {p: v.get_value() for p, v in nnx.to_flat_state(nnx.state(ref))}
err = max(float(np.abs(np.asarray(s.data) - np.asarray(want[p])[s.index]).max())
          for p, v in nnx.to_flat_state(nnx.state(model)) for s in v.get_value().addressable_shards)
stored = sum(ck.files.stored_bytes(n) for n in ck.files.shapes)
print("RESULT", json.dumps({"err": err, "read": ck.files.bytes_read.total(), "stored": stored}))
jax.distributed.shutdown()
"""


def test_two_processes_each_read_about_half_the_checkpoint(checkpoints):
    """jax.distributed on localhost, 2 processes x 4 CPU devices, fsdp spanning the processes: each holds the
    single-host import's values in its shards and has read about half the checkpoint's bytes."""
    port = _free_port()
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT), "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
           "XLA_FLAGS": f"--xla_force_host_platform_device_count=4 {FAST_COMPILE_XLA_FLAGS}"}
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(checkpoints["qwen3_moe_fused"]), str(i)], env=env,
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-3000:]
    results = [json.loads(out.split("RESULT ")[1].splitlines()[0]) for out in outs]
    print("2 processes, bytes read of the checkpoint:", [r["read"] / r["stored"] for r in results])
    for r in results:
        assert r["err"] == 0.0
        assert 0.45 * r["stored"] <= r["read"] <= 0.6 * r["stored"], r
