"""gpt-oss's MXFP4 experts (moe/hf/quant.py, moe/hf/tensors.py): a tiny random gpt_oss whose experts are quantized
here to MXFP4 and written as the Hub writes them (`*_blocks` / `*_scales`, the rest BF16) imports bit for bit as
the same weights dequantized and written in BF16, in memory, streamed a block at a time and sharded; transformers'
Mxfp4Config(dequantize=True) loads the same weights and computes our logits and expert ids; modules_to_not_convert
is transformers' pattern rule and must agree with what is stored; a box of an MXFP4 weight reads only its blocks,
and dequantizing one holds one fp32 copy of it."""

import json
import tracemalloc

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file

torch = pytest.importorskip("torch", reason="torch builds the reference models")
transformers = pytest.importorskip("transformers", reason="transformers builds the reference models")
from moe.hf import HFImportError, load_model  # noqa: E402
from moe.hf.quant import FP4_VALUES, Mxfp4, dequantize_mxfp4  # noqa: E402
from moe.hf.safetensors_io import flat_variables  # noqa: E402
from moe.hf.stream import LayerStream  # noqa: E402
from moe.hf.tensors import SafetensorsFiles  # noqa: E402
from tests.hf_random import hf_forward, ours_forward, random_hf, same_experts  # noqa: E402
from tests.test_hf_gpt_oss import TOKENS, _config  # noqa: E402

transformers.utils.logging.disable_progress_bar()
transformers.utils.logging.set_verbosity_error()

HUB = {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
                                  "lm_head"], "quant_method": "mxfp4"}  # openai/gpt-oss-20b's
EXPERTS = ("gate_up_proj", "down_proj")


def quantize_mxfp4(w):
    """w [E, out, in] -> (blocks uint8 [E, out, in / 32, 16], scales uint8 [E, out, in / 32]): per 32 inputs the
    power of two that brings the largest |value| to at most 6, each value rounded to the nearest E2M1 code."""
    E, rows, cols = w.shape
    g = w.reshape(E, rows, cols // 32, 32)
    exponent = np.ceil(np.log2(np.maximum(np.abs(g).max(-1), 2.0 ** -100) / 6.0)).astype(np.int32)
    scales = np.clip(exponent + 127, 1, 254).astype(np.uint8)
    x = g / np.ldexp(1.0, scales.astype(np.int32) - 127)[..., None]
    code = np.abs(np.abs(x)[..., None] - FP4_VALUES[:8]).argmin(-1) | ((x < 0) << 3)
    blocks = (code[..., 0::2] | (code[..., 1::2] << 4)).astype(np.uint8)
    return np.ascontiguousarray(blocks), np.ascontiguousarray(scales)  # safetensors writes the buffer as laid out


def write(path, config, tensors):
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def checkpoints(root, sd, config, plain_layers=(), keep=HUB["modules_to_not_convert"]):
    """(MXFP4 dir, BF16 dir of the same weights): experts quantized except in `plain_layers`."""
    quantized, plain = {}, {}
    for k, v in sd.items():
        layer = int(k.split(".")[2]) if k.startswith("model.layers.") else None
        if k.endswith(tuple(f"experts.{p}" for p in EXPERTS)):
            blocks, scales = quantize_mxfp4(np.ascontiguousarray(v.swapaxes(1, 2)))  # stored [E, out, in]
            w = dequantize_mxfp4(blocks, scales).swapaxes(1, 2)  # transformers' [E, in, out]
            plain[k] = np.ascontiguousarray(w).astype(ml_dtypes.bfloat16)  # exact: FP4 x 2^k is a bf16
            if layer in plain_layers:
                quantized[k] = plain[k]
            else:
                quantized[k + "_blocks"], quantized[k + "_scales"] = blocks, scales
        else:
            quantized[k] = plain[k] = v.astype(ml_dtypes.bfloat16)
    return (write(root / "mxfp4", dict(config, quantization_config=dict(HUB, modules_to_not_convert=keep)),
                  quantized), write(root / "bf16", config, plain))


@pytest.fixture(scope="module")
def mxfp4(tmp_path_factory):
    hf = random_hf(_config())
    config = hf.config.to_dict()
    sd = {k: v.numpy() for k, v in hf.state_dict().items()}
    q, plain = checkpoints(tmp_path_factory.mktemp("mxfp4"), sd, config)
    return dict(q=q, plain=plain, sd=sd, config=config)


def test_mxfp4_experts_import_as_their_dequantized_copy_in_memory_and_streamed(mxfp4):
    got, want = flat_variables(load_model(mxfp4["q"])), flat_variables(load_model(mxfp4["plain"]))
    assert got.keys() == want.keys()
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    # the experts are the 4-bit grid's values, not the originals (the comparison above would accept those)
    original = mxfp4["sd"]["model.layers.2.mlp.experts.gate_up_proj"][..., 1::2]
    assert np.abs(got["blocks.2.ffn.w_up"] - original).max() > 0.01
    stream = LayerStream(mxfp4["q"])
    for i in range(stream.cfg.n_layers):
        block = stream.block(i)
        for w in ("w_gate", "w_up", "w_down", "b_gate", "b_up", "b_down"):
            np.testing.assert_array_equal(np.asarray(getattr(block.ffn, w).get_value()), want[f"blocks.{i}.ffn.{w}"])
    assert stream.held_bytes("blocks.0") > 2 * stream.disk_bytes("blocks.0")  # fp32 held, 4.25 bits per expert weight


def test_mxfp4_logits_and_experts_match_transformers_dequantized(mxfp4):
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        mxfp4["q"], dtype=torch.float32, quantization_config=transformers.Mxfp4Config(dequantize=True)).eval()
    model = load_model(mxfp4["q"])
    ours = flat_variables(model)
    theirs = {k: v.numpy() for k, v in hf.state_dict().items()}
    for i in range(model.cfg.n_layers):  # transformers' weights, bit for bit
        gate_up = theirs[f"model.layers.{i}.mlp.experts.gate_up_proj"]
        np.testing.assert_array_equal(ours[f"blocks.{i}.ffn.w_gate"], gate_up[..., 0::2])
        np.testing.assert_array_equal(ours[f"blocks.{i}.ffn.w_up"], gate_up[..., 1::2])
        np.testing.assert_array_equal(ours[f"blocks.{i}.ffn.w_down"], theirs[f"model.layers.{i}.mlp.experts.down_proj"])
    hf_logits, hf_ids = hf_forward(hf, TOKENS, routers=("mlp.router",))
    logits, ids = ours_forward(model, jnp.asarray(TOKENS))
    err = np.abs(np.asarray(logits) - hf_logits).max() / np.abs(hf_logits).max()
    print(f"gpt_oss MXFP4: max |logit diff| / max |logit| = {err:.1e}; experts {same_experts(ids, hf_ids)}")
    assert err <= 1e-4
    assert same_experts(ids, hf_ids) == [1.0] * model.cfg.n_layers


def test_modules_to_not_convert_is_transformers_rule_and_agrees_with_the_weights(mxfp4, tmp_path):
    from transformers.quantizers.quantizers_utils import should_convert_module

    patterns = ["model.layers.*.self_attn", "lm_head", "model.layers.1", "mlp.router", "layers.3.mlp.experts"]
    for name in ("model.layers.0.self_attn", "model.layers.11.mlp.experts", "model.layers.1.mlp.experts", "lm_head",
                 "model.layers.0.mlp.router", "model.layers.3.mlp.experts", "model.layers.13.mlp.experts",
                 "model.embed_tokens"):
        assert Mxfp4(tuple(patterns)).converts(name) == should_convert_module(name, patterns), name
    # layer 1's experts stored plain and listed: read as stored, the rest dequantized
    keep = [*HUB["modules_to_not_convert"], "model.layers.1.mlp.experts"]
    q, plain = checkpoints(tmp_path / "mixed", mxfp4["sd"], mxfp4["config"], plain_layers=(1,), keep=keep)
    files = SafetensorsFiles(q, Mxfp4(tuple(keep)))
    assert files._at["model.layers.1.mlp.experts.gate_up_proj"][1] == "BF16"
    assert "model.layers.0.mlp.experts.gate_up_proj_blocks" in files._at
    got, want = flat_variables(load_model(q)), flat_variables(load_model(plain))
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    # listed but stored as MXFP4: the config and the weights disagree
    config = json.loads((tmp_path / "mixed" / "mxfp4" / "config.json").read_text())
    config["quantization_config"]["modules_to_not_convert"] = [*keep, "model.layers.2.mlp.experts"]
    (tmp_path / "mixed" / "mxfp4" / "config.json").write_text(json.dumps(config))
    with pytest.raises(HFImportError, match=r"'model\.layers\.2\.mlp\.experts\.\w+_proj_blocks' is MXFP4 but "
                                            r"quantization_config\.modules_to_not_convert lists"):
        load_model(q)


def test_an_mxfp4_box_reads_its_blocks_only_and_one_fp32_copy_is_held(mxfp4, tmp_path):
    files = SafetensorsFiles(mxfp4["q"], Mxfp4(tuple(HUB["modules_to_not_convert"])))
    name = "model.layers.0.mlp.experts.gate_up_proj"
    assert files.shapes[name] == (4, 64, 64) and files.held_bytes(name) == 4 * 64 * 64 * 4
    whole = files.read(name)
    rng = np.random.default_rng(0)
    for step in (1, 1, 1, 2, 2, 3):  # gpt-oss's gate and up: every other output column of gate_up_proj
        box = tuple(slice(*sorted(rng.choice(n + 1, 2, replace=False))) for n in whole.shape)
        box = (*box[:2], slice(box[2].start, box[2].stop, step))
        files.bytes_read.clear()
        np.testing.assert_array_equal(files.read_block(name, box), whole[box])
        groups = -(-box[1].stop // 32) - box[1].start // 32
        outputs = len(range(box[2].start, box[2].stop, step))
        rows = (box[0].stop - box[0].start) * (step * (outputs - 1) + 1 if outputs else 0)
        assert files.bytes_read == {name + "_blocks": rows * groups * 16, name + "_scales": rows * groups}
    # one read holds the fp32 result, the stored bytes (an eighth of it) and one expert's fp32 at a time
    rng = np.random.default_rng(1)
    big = "model.layers.0.mlp.experts.down_proj"
    write(tmp_path, {}, {big + "_blocks": rng.integers(0, 256, (16, 64, 8, 16), np.uint8),
                         big + "_scales": rng.integers(120, 130, (16, 64, 8), np.uint8)})
    files = SafetensorsFiles(str(tmp_path), Mxfp4())
    files.read(big)  # warm
    tracemalloc.start()
    try:
        out = files.read(big)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert out.shape == (16, 256, 64) and out.flags["C_CONTIGUOUS"]  # held as is: no copy follows
    assert out.nbytes <= peak <= 1.35 * out.nbytes, (peak, out.nbytes)  # a second copy would be 2x


def test_mxfp4_tensors_that_do_not_fit_are_refused(mxfp4, tmp_path):
    blocks = np.zeros((2, 8, 2, 16), np.uint8)
    base = "model.layers.0.mlp.experts.down_proj"
    quant = Mxfp4(tuple(HUB["modules_to_not_convert"]))
    for tensors, match in [
        ({base + "_blocks": blocks}, "is MXFP4 without its scales"),
        ({base + "_blocks": blocks, base + "_scales": np.zeros((2, 8, 3), np.uint8)}, "do not fit"),
        ({base + "_blocks": blocks[0], base + "_scales": np.zeros((8, 2), np.uint8)}, "do not fit"),
        ({base + "_blocks": blocks, base + "_scales": np.zeros((2, 8, 2), np.uint8),
          base: np.zeros((2, 64, 8), np.float32)}, "stored both plain and as MXFP4"),
    ]:
        write(tmp_path, {}, tensors)
        with pytest.raises(HFImportError, match=match):
            SafetensorsFiles(str(tmp_path), quant)
    write(tmp_path, {}, {base + "_blocks": blocks, base + "_scales": np.zeros((2, 8, 2), np.uint8)})
    with pytest.raises(HFImportError, match=r"_blocks' is U8; only F32, F16, BF16 weights .* mxfp4"):
        SafetensorsFiles(str(tmp_path))  # no mxfp4 quantization_config


def test_the_memory_benchmarks_gpt_oss_checkpoint_loads_with_its_parameter_count(tmp_path):
    """benchmarks/hf_import_memory.py --dtype mxfp4 writes gpt-oss's Hub layout; its size formula is the model's."""
    from benchmarks.hf_import_memory import GPT_OSS_SHAPE, gpt_oss_layers, gpt_oss_params, write_gpt_oss_mxfp4

    c = dict(GPT_OSS_SHAPE, hidden_size=64, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, num_local_experts=4, vocab_size=128, sliding_window=4)
    gb = 4 * gpt_oss_params(c, 3) / 1e9
    write_gpt_oss_mxfp4(str(tmp_path), gb, c)
    model = load_model(str(tmp_path))
    assert model.cfg.n_layers == gpt_oss_layers(gb, c) == 3
    assert sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param))) == gpt_oss_params(c, 3)


def test_the_sharded_import_of_mxfp4_experts_equals_the_single_host_one(mxfp4):
    """Every variable's slice (a device's shard) read on its own equals the slice of the whole; on 8 devices (fsdp 2 x
    expert 4) the sharded import holds the single-host import's values."""
    from moe.hf import load_hf_moe
    from moe.hf.load import open_checkpoint
    from moe.hf.weights import plan
    from moe.sharding import make_mesh
    from tests.test_hf_sharded import _boxes

    ck = open_checkpoint(mxfp4["q"])
    rng = np.random.default_rng(3)
    for step in plan(ck.cfg, ck.layout, ck.files.shapes, ck.where):
        for k, piece in step.pieces.items():
            if ".ffn.w_" in k:
                whole = piece.read(ck.files)
                for box in _boxes(piece.shape, rng, n=3):
                    np.testing.assert_array_equal(piece.read_slice(ck.files, box), whole[box], err_msg=k)
    want = flat_variables(load_model(mxfp4["q"]))
    model, _ = load_hf_moe(mxfp4["q"], mesh=make_mesh(1, 2, 4, 1))
    got = flat_variables(model)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
