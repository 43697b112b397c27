"""The layer-streamed forward (moe/hf/stream.py) equals the in-memory import's: on tiny random transformers models
of several families (MLA with an MTP layer, tied embeddings, Mixtral's block_sparse_moe, gpt-oss's sinks,
LongCat-Flash's dual sublayers, a bf16 checkpoint, block FP8), the same expert ids, gates, scores and logits, with one block's weights in memory at a time."""

import json
import shutil

import jax
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file

torch = pytest.importorskip("torch", reason="torch builds the reference models")
transformers = pytest.importorskip("transformers", reason="transformers builds the reference models")
transformers.utils.logging.disable_progress_bar()

from moe.hf import load_hf_moe  # noqa: E402
from moe.hf import stream as streamed  # noqa: E402
from moe.hf.tensors import read_tensors  # noqa: E402
from tests import test_hf_deepseek, test_hf_families, test_hf_gpt_oss, test_hf_longcat  # noqa: E402
from tests.hf_random import random_hf, write_fp8  # noqa: E402

CONFIGS = {"deepseek_v3": test_hf_deepseek.FAMILIES["deepseek_v3"],  # MLA, YaRN, a dense layer, an MTP layer
           "qwen3_moe": test_hf_families.FAMILIES["qwen3_moe"],  # tied head, interleaved dense layers, q/k norms
           "mixtral": test_hf_families.FAMILIES["mixtral"],  # block_sparse_moe, w1/w2/w3
           "gpt_oss": test_hf_gpt_oss._config,  # attention sinks, sliding layers, expert biases
           "longcat_flash": test_hf_longcat._config}  # DualBlock: two sublayers and a shortcut MoE
TOKENS = np.random.RandomState(1).randint(2, 128, (3, 10))


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """name -> a saved tiny random checkpoint (deepseek_v3 with an MTP layer after its last one)."""
    cache = {}

    def get(name):
        if name not in cache:
            hf = random_hf(CONFIGS[name]())
            path = tmp_path_factory.mktemp(name)
            hf.save_pretrained(str(path))
            if name == "deepseek_v3":
                test_hf_deepseek._add_mtp_layer(path, read_tensors(str(path)), hf.config.num_hidden_layers)
            cache[name] = str(path)
        return cache[name]

    return get


@nnx.jit
def _inspect(model, tokens):
    logits, aux = model.inspect(tokens)
    return logits, [(r.expert_ids, r.gates, r.scores) for r in aux.routing]


def _assert_same(path, tokens=TOKENS, keep_dtype=False):
    model, _ = load_hf_moe(path)
    want_logits, want = _inspect(model, tokens)
    stream = streamed.LayerStream(path, keep_dtype=keep_dtype)
    logits, routing = streamed.inspect(stream, tokens)
    assert len(routing) == len(want) == model.cfg.n_moe_layers > 0
    for (ids, gates, scores), r in zip(want, routing):
        np.testing.assert_array_equal(np.asarray(r.expert_ids), np.asarray(ids))
        np.testing.assert_allclose(np.asarray(r.gates), np.asarray(gates), rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(np.asarray(r.scores), np.asarray(scores), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(want_logits), rtol=1e-5, atol=1e-5)
    return stream


@pytest.mark.parametrize("name", list(CONFIGS))
def test_streamed_routing_and_logits_equal_the_in_memory_model(hf_dir, name):
    stream = _assert_same(hf_dir(name))
    # every block was read once and nothing past it: the MTP layer (deepseek_v3) is never read
    read = set(stream.files.bytes_read)
    assert read and not any(k.startswith(f"model.layers.{stream.cfg.n_layers}.") for k in read)


def test_a_bf16_checkpoint_is_held_as_stored_and_routes_as_its_fp32_import(hf_dir, tmp_path):
    """A bf16 checkpoint read in bf16 (half the bytes) routes exactly as the in-memory import, which upcasts it to
    fp32, whether the stream holds it in fp32 or, with keep_dtype, in bf16 (the block casts its weights where it
    uses them; bf16 -> fp32 is exact)."""
    src = hf_dir("mixtral")
    sd = read_tensors(src)
    save_file({k: v.astype(ml_dtypes.bfloat16) for k, v in sd.items()}, str(tmp_path / "model.safetensors"),
              metadata={"format": "pt"})
    shutil.copy(f"{src}/config.json", tmp_path / "config.json")
    read = _assert_same(str(tmp_path)).files.bytes_read
    assert sum(read.values()) == 2 * sum(v.size for v in sd.values())  # every tensor once, 2 bytes a value
    stream = _assert_same(str(tmp_path), keep_dtype=True)
    block = stream.block(0)
    assert {np.dtype(x.dtype) for x in jax.tree.leaves(nnx.state(block, nnx.Param))} == {np.dtype(ml_dtypes.bfloat16)}
    assert stream.held_bytes("blocks.0") * 2 == sum(4 * np.prod(stream.files.shapes[n])
                                                    for n in stream._tensors("blocks.0"))


def test_a_block_fp8_checkpoint_streams_as_its_import(hf_dir, tmp_path):
    """DeepSeek's block FP8 as it ships (F8_E4M3 Linears in blocks of 24 x 40: partial tiles over these shapes; BF16
    elsewhere, the router F32), dequantized as each block is read: the routing and logits of the in-memory import
    of the same files."""
    src = hf_dir("deepseek_v3")
    c = json.loads(open(f"{src}/config.json").read())
    c["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                "weight_block_size": [24, 40]}
    write_fp8(tmp_path, c, read_tensors(src), (24, 40))
    _assert_same(str(tmp_path))
