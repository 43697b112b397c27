"""Quantized HF checkpoints (moe/hf/quant.py, moe/hf/tensors.py): DeepSeek's block FP8 is dequantized exactly by
DeepSeek's rule w[i, j] = q[i, j] * scale_inv[i // bm, j // bn], partial edge tiles included (transformers 5.25's
CPU path splits rows evenly instead); a tiny deepseek_v3 quantized here to FP8 (blocks that do not divide its
dims) loads with every tensor equal to that rule and with transformers' logits and experts on the same dequantized
weights; FP8 with one scale per tensor or per output row (weight_block_size null) imports as transformers'
Fp8Dequantize computes it, bit for bit; quantization_config is accepted only for FP8 and gpt-oss's MXFP4 (the rest
refused naming the field); gpt-oss's MXFP4 dequantization equals the format's definition and transformers' own
(the checkpoints: tests/test_hf_mxfp4.py)."""

import json
import math

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from moe.hf import HFImportError, load_model, model_config
from moe.hf.load import FAMILIES as LAYOUTS
from moe.hf.quant import Fp8Blocks, dequantize_fp8, dequantize_mxfp4, quantization
from moe.hf.safetensors_io import flat_variables
from moe.hf.tensors import SafetensorsFiles, read_tensors
from moe.hf.weights import our_tensors

torch = pytest.importorskip("torch", reason="torch builds the reference models")
transformers = pytest.importorskip("transformers", reason="transformers builds the reference models")
from tests.hf_random import (  # noqa: E402
    deepseek_rule,
    hf_forward,
    ours_forward,
    quantized_linear,
    random_hf,
    same_experts,
    write_fp8,
)

transformers.utils.logging.disable_progress_bar()

E4M3 = ml_dtypes.float8_e4m3fn
BLOCK = [24, 20]  # divides none of 64 (hidden), 80 (q_b), 88 (kv_b), 16 (kv latent) ...: partial tiles everywhere
FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": BLOCK}
V = 128
TOKENS = np.random.RandomState(0).randint(0, V, (2, 12))


def tiny_deepseek_v3():
    return transformers.DeepseekV3Config(
        vocab_size=V, hidden_size=64, num_attention_heads=4, num_key_value_heads=4, rms_norm_eps=1e-5,
        max_position_embeddings=64, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8,
        num_experts_per_tok=2, kv_lora_rank=16, qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=10,
        num_hidden_layers=2, first_k_dense_replace=1, q_lora_rank=24, n_shared_experts=1, n_group=4, topk_group=2,
        routed_scaling_factor=2.5, num_nextn_predict_layers=0, eos_token_id=None, bos_token_id=None,
        pad_token_id=None, rope_parameters={"rope_type": "default", "rope_theta": 500.0})


@pytest.fixture(scope="module")
def fp8(tmp_path_factory):
    """A tiny random deepseek_v3, quantized to FP8 in BLOCK tiles; transformers' logits and experts on the
    dequantized weights (loaded into transformers as plain fp32)."""
    root = tmp_path_factory.mktemp("fp8")
    hf = random_hf(tiny_deepseek_v3())
    hf.save_pretrained(str(root / "plain"))
    sd = read_tensors(str(root / "plain"))
    config = json.loads((root / "plain" / "config.json").read_text())
    meant = write_fp8(root / "fp8", dict(config, quantization_config=FP8_CONFIG), sd, BLOCK)
    save_file(meant, str(root / "plain" / "model.safetensors"), metadata={"format": "pt"})
    reference = transformers.AutoModelForCausalLM.from_pretrained(str(root / "plain"), dtype=torch.float32).eval()
    return dict(path=root / "fp8", config=config, sd=sd, meant=meant, hf=hf_forward(reference, TOKENS))


def test_fp8_checkpoint_dequantizes_by_deepseeks_rule_and_matches_transformers(fp8):
    edges = [k for k, v in fp8["sd"].items() if quantized_linear(k, v) and v.shape[0] % BLOCK[0]
             and v.shape[1] % BLOCK[1]]
    assert "model.layers.0.self_attn.kv_b_proj.weight" in edges and len(edges) > 10  # partial tiles on both axes
    model = load_model(str(fp8["path"]))
    cfg = model.cfg
    # (a) every variable is DeepSeek's rule on the stored FP8 (the rest as stored), bit for bit
    want = our_tensors(cfg, LAYOUTS["deepseek_v3"].layout(fp8["config"]), fp8["meant"], "test")
    got = flat_variables(model)
    assert got.keys() == want.keys()
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    # the FP8 grid is coarse: the dequantized weights are not the originals, which the parity below would accept
    assert not np.allclose(fp8["meant"]["model.layers.1.self_attn.o_proj.weight"],
                           fp8["sd"]["model.layers.1.self_attn.o_proj.weight"], atol=1e-3)
    # (b) logits and (c) chosen experts equal transformers' on the same dequantized weights
    logits, ids = ours_forward(model, jnp.asarray(TOKENS))
    hf_logits, hf_ids = fp8["hf"]
    err = np.abs(np.asarray(logits) - hf_logits).max() / np.abs(hf_logits).max()
    print(f"FP8 deepseek_v3: max |logit diff| / max |logit| = {err:.1e} (scale {np.abs(hf_logits).max():.1f}); "
          f"experts {same_experts(ids, hf_ids)}")
    assert err < 1e-5
    assert same_experts(ids, hf_ids) == [1.0] * cfg.n_moe_layers


def test_ue8m0_scales_are_multiplied_as_stored(fp8, tmp_path):
    """V3.1 / V3.2 (scale_fmt ue8m0): F32 scales that are powers of two, except o_proj's (V3.1's caveat): the same
    multiply, no rounding of a scale to a power of two."""
    odd = lambda name: "o_proj" not in name
    config = dict(fp8["config"], quantization_config=dict(FP8_CONFIG, scale_fmt="ue8m0"))
    meant = write_fp8(tmp_path, config, fp8["sd"], BLOCK, power_of_two=odd)
    files = SafetensorsFiles(str(tmp_path), quantization(config, "config.json"))
    scale = files._stored("model.layers.1.self_attn.o_proj.weight_scale_inv")
    assert not np.all(np.log2(scale) == np.round(np.log2(scale)))  # o_proj's scales are not powers of two
    for k in ("model.layers.1.self_attn.o_proj.weight", "model.layers.1.mlp.experts.3.down_proj.weight"):
        np.testing.assert_array_equal(files.read(k), meant[k], err_msg=k)
    assert "model.layers.1.self_attn.o_proj.weight_scale_inv" not in files.shapes  # folded into its weight


def test_partial_tiles_follow_the_block_size_not_an_even_split():
    """DeepSeek-V3's kv_a_proj_with_mqa is [576, 7168]: rows 512..575 (64 rows) use scale row 4. transformers'
    CPU path would split 576 rows over 5 scale rows (not a whole number: it refuses); an even split where it
    divides (200 rows, 2 scale rows) would use block 100. Both checked on small shapes."""
    rng = np.random.default_rng(0)
    blocks = Fp8Blocks(128, 128)
    for rows, cols in ((576, 256), (200, 192)):
        q = rng.normal(size=(rows, cols)).astype(E4M3)
        s = rng.uniform(0.5, 2, (math.ceil(rows / 128), math.ceil(cols / 128))).astype(np.float32)
        w = dequantize_fp8(q, s, blocks)
        np.testing.assert_array_equal(w, deepseek_rule(q, s, (128, 128)))
        last = rows - 1
        assert w[last, 0] == np.float32(q[last, 0]) * s[-1, 0] and w[127, 0] == np.float32(q[127, 0]) * s[0, 0]
    # leading axes (stacked experts [E, out, in]) tile each matrix alike
    q3 = rng.normal(size=(3, 40, 30)).astype(E4M3)
    s3 = rng.uniform(0.5, 2, (3, 2, 2)).astype(np.float32)
    w3 = dequantize_fp8(q3, s3, Fp8Blocks(24, 20))
    for e in range(3):
        np.testing.assert_array_equal(w3[e], deepseek_rule(q3[e], s3[e], (24, 20)))


def test_fp8_tensors_that_do_not_fit_are_refused():
    q = np.ones((40, 30), E4M3)
    with pytest.raises(HFImportError, match=r"'w': scale \[2, 1\] does not fit weight \[40, 30\].*needs \[2, 2\]"):
        dequantize_fp8(q, np.ones((2, 1), np.float32), Fp8Blocks(24, 20), "w")
    bad = q.copy()
    bad.view(np.uint8)[3, 4] = 0x7F
    with pytest.raises(HFImportError, match="'w' holds NaN"):
        dequantize_fp8(bad, np.ones((2, 2), np.float32), Fp8Blocks(24, 20), "w")
    for s in (0.0, -1.0, np.inf):
        with pytest.raises(HFImportError, match="w_scale_inv' holds a scale"):
            dequantize_fp8(q, np.full((2, 2), s, np.float32), Fp8Blocks(24, 20), "w")


def test_fp8_checkpoints_without_scales_or_config_are_refused(fp8, tmp_path):
    name = "model.layers.0.self_attn.o_proj.weight"
    tensors = {name: np.ones((64, 40), E4M3), name + "_scale_inv": np.ones((3, 2), np.float32)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(HFImportError, match=f"'{name}' is F8_E4M3 but config.json has no quantization_config"):
        SafetensorsFiles(str(tmp_path))
    save_file({name: tensors[name]}, str(tmp_path / "model.safetensors"))
    with pytest.raises(HFImportError, match=f"'{name}' is F8_E4M3 without its scales"):
        SafetensorsFiles(str(tmp_path), Fp8Blocks(24, 20))
    save_file({**tensors, name + "_scale_inv": np.ones((3, 2), ml_dtypes.bfloat16)},
              str(tmp_path / "model.safetensors"))
    with pytest.raises(HFImportError, match=r"weight_scale_inv' is BF16\[3, 2\].*needs F32\[3, 2\]"):
        SafetensorsFiles(str(tmp_path), Fp8Blocks(24, 20))
    save_file({name: tensors[name].astype(ml_dtypes.float8_e5m2)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(HFImportError, match=f"'{name}' is F8_E5M2; only F32, F16, BF16"):
        SafetensorsFiles(str(tmp_path), Fp8Blocks(24, 20))


@pytest.mark.parametrize("quant,field", [
    ({"quant_method": "fp8", "fmt": "e4m3"}, "quantization_config.weight_block_size"),
    (dict(FP8_CONFIG, weight_block_size=[128]), "quantization_config.weight_block_size"),
    (dict(FP8_CONFIG, weight_block_size=[128, 0]), "quantization_config.weight_block_size"),
    (dict(FP8_CONFIG, weight_block_size=[128, True]), "quantization_config.weight_block_size"),
    (dict(FP8_CONFIG, fmt="e5m2"), "quantization_config.fmt"),
    (dict(FP8_CONFIG, activation_scheme="static"), "quantization_config.activation_scheme"),
    (dict(FP8_CONFIG, scale_fmt="e8m0_bytes"), "quantization_config.scale_fmt"),
    (dict(FP8_CONFIG, kv_cache_scheme="fp8"), "quantization_config.kv_cache_scheme"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized"}, "quantization_config.quant_method"),
    ({"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0}, "quantization_config.quant_method"),
    ({"quant_method": "mxfp4", "dequantize": True, "block": 32}, "quantization_config.block"),
    ({"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.(1"]},
     "quantization_config.modules_to_not_convert"),
    (dict(FP8_CONFIG, modules_to_not_convert=[1]), "quantization_config.modules_to_not_convert"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quantization_config.quant_method"),
    ("fp8", "quantization_config"),
])
def test_quantization_configs_not_read_are_refused(fp8, quant, field):
    with pytest.raises(HFImportError, match=field.replace(".", r"\.")) as e:
        model_config(dict(fp8["config"], quantization_config=quant))
    assert "\n" not in str(e.value)


def test_block_fp8_of_any_block_size_is_accepted(fp8):
    for block in ([128, 128], [24, 20], [1, 32]):
        config = dict(fp8["config"], quantization_config=dict(FP8_CONFIG, weight_block_size=block))
        assert model_config(config) == model_config(fp8["config"])  # the model is the same; only its weights
        assert quantization(config, "config.json") == Fp8Blocks(*block)
    assert quantization(fp8["config"], "config.json") is None


# MXFP4 (gpt-oss): E2M1 codes, two per byte, low nibble first; one E8M0 scale (2^(byte - 127)) per 32 values.

def e2m1(code: int) -> float:
    """The OCP MX spec's FP4 E2M1: sign bit 3, exponent bits 2-1 (bias 1), mantissa bit 0; exponent 0 is
    subnormal (0 or 0.5)."""
    sign = -1.0 if code & 8 else 1.0
    exponent, mantissa = (code >> 1) & 3, code & 1
    return sign * (mantissa * 0.5 if exponent == 0 else 2.0 ** (exponent - 1) * (1 + mantissa / 2))


def mxfp4_reference(blocks, scales):
    out = np.zeros((*blocks.shape[:-1], 32), np.float64)
    for idx in np.ndindex(blocks.shape[:-1]):
        for j, byte in enumerate(blocks[idx]):
            for k, code in enumerate((int(byte) & 15, int(byte) >> 4)):
                out[idx + (2 * j + k,)] = e2m1(code) * 2.0 ** (int(scales[idx]) - 127)
    return out.reshape(*blocks.shape[:-2], -1)


def test_mxfp4_dequantization_equals_the_format_and_transformers():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (2, 6, 3, 16), dtype=np.uint8)  # [E, out, in / 32, 16]: in = 96
    scales = rng.integers(117, 137, (2, 6, 3), dtype=np.uint8)
    ours = dequantize_mxfp4(blocks, scales)
    assert ours.shape == (2, 6, 96) and ours.dtype == np.float32
    np.testing.assert_array_equal(ours, mxfp4_reference(blocks, scales))
    theirs = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32)
    np.testing.assert_array_equal(ours.transpose(0, 2, 1), theirs.numpy())  # transformers' [E, in, out]
    # byte 0x71 at scale 128: the low nibble (1: 0.5) first, then the high one (7: 6.0), both times 2
    one = dequantize_mxfp4(np.array([[0x71] + [0] * 15], np.uint8), np.array([128], np.uint8))
    assert one[:2].tolist() == [1.0, 12.0]


def test_mxfp4_nan_scales_and_bad_shapes_are_refused():
    blocks = np.zeros((4, 16), np.uint8)
    with pytest.raises(HFImportError, match="'x_blocks': an MXFP4 scale is NaN"):
        dequantize_mxfp4(blocks, np.full(4, 255, np.uint8), "x_blocks")
    with pytest.raises(HFImportError, match="do not fit"):
        dequantize_mxfp4(blocks, np.zeros(3, np.uint8))
    with pytest.raises(HFImportError, match="overflow fp32"):
        dequantize_mxfp4(np.full((1, 16), 0x77, np.uint8), np.full(1, 254, np.uint8))


# FP8 with one scale per tensor or per output row (FineGrainedFP8Config with weight_block_size null).

SCALED_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": None}


def to_torch_fp8(q):
    return torch.from_numpy(np.ascontiguousarray(q).view(np.uint8)).view(torch.float8_e4m3fn)


def transformers_dequantized(q, s):
    """transformers' own CPU dequantization of an FP8 weight and its weight_scale_inv (Fp8Dequantize)."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    return Fp8Dequantize(None)._dequantize_one(to_torch_fp8(q), torch.from_numpy(s), torch.float32).numpy()


def quantize_scaled(w, scale_shape):
    """q = e4m3(w / s) with s = amax / 448 over the whole tensor (scale_shape [], [1], [1, 1]) or each row ([out, 1])."""
    per_row = len(scale_shape) == 2 and scale_shape[0] > 1
    amax = np.abs(w).max(-1, keepdims=True) if per_row else np.abs(w).max().reshape(1, 1)
    s = (amax / 448).astype(np.float32)
    return np.clip(w / s, -448, 448).astype(E4M3), s.reshape(scale_shape)


def test_scaled_fp8_equals_transformers_dequantization():
    from moe.hf.quant import dequantize_fp8_scaled

    rng = np.random.default_rng(0)
    w = rng.normal(size=(40, 30)).astype(np.float32)
    for shape in ((), (1,), (1, 1), (40, 1)):
        q, s = quantize_scaled(w, shape)
        ours = dequantize_fp8_scaled(q, s, "w")
        np.testing.assert_array_equal(ours, transformers_dequantized(q, s))
        assert 0 < np.abs(ours - w).max() < np.abs(w).max() / 16  # e4m3's rounding
    q3 = rng.normal(size=(3, 8, 64)).astype(E4M3)
    for shape in ((3, 1, 1), (3, 8, 1)):  # fused experts [E, out, in]
        s3 = rng.uniform(0.5, 2, shape).astype(np.float32)
        np.testing.assert_array_equal(dequantize_fp8_scaled(q3, s3), transformers_dequantized(q3, s3))
    with pytest.raises(HFImportError, match=r"'w': scale \[2, 1\] is neither one value nor one per output row"):
        dequantize_fp8_scaled(q, np.ones((2, 1), np.float32), "w")


def test_scaled_fp8_checkpoint_imports_as_transformers_dequantizes_it(fp8, tmp_path):
    """Attention weights with one scale each ([]), dense MLPs [1], experts one per output row ([out, 1]); every
    variable equals transformers' Fp8Dequantize of the stored tensors, bit for bit, in memory and by boxes."""
    stored, meant = {}, {}
    for k, v in fp8["sd"].items():
        if quantized_linear(k, v):
            shape = (v.shape[0], 1) if ".experts." in k else (1,) if ".mlp." in k else ()
            q, s = quantize_scaled(v, shape)
            stored[k], stored[k + "_scale_inv"], meant[k] = q, s, transformers_dequantized(q, s)
        else:
            stored[k] = v.astype(ml_dtypes.bfloat16)
            meant[k] = stored[k].astype(np.float32)
    save_file(stored, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    config = dict(fp8["config"], quantization_config=SCALED_CONFIG)
    (tmp_path / "config.json").write_text(json.dumps(config))
    model = load_model(str(tmp_path))
    want = our_tensors(model.cfg, LAYOUTS["deepseek_v3"].layout(config), meant, "test")
    got = flat_variables(model)
    assert got.keys() == want.keys()
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    files = SafetensorsFiles(str(tmp_path), quantization(config, "config.json"))
    rng = np.random.default_rng(1)
    for name in ("model.layers.1.self_attn.o_proj.weight", "model.layers.0.mlp.down_proj.weight",
                 "model.layers.1.mlp.experts.2.up_proj.weight"):
        whole = files.read(name)
        np.testing.assert_array_equal(whole, meant[name])
        for _ in range(3):
            box = tuple(slice(*sorted(rng.choice(n + 1, 2, replace=False))) for n in whole.shape)
            np.testing.assert_array_equal(files.read_block(name, box), whole[box], err_msg=name)
    # a block-sized scale under weight_block_size null is refused naming the tensor and the shapes it may have
    name = "model.layers.1.self_attn.o_proj.weight"
    save_file({**stored, name + "_scale_inv": np.ones((3, 2), np.float32)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(HFImportError, match=r"o_proj\.weight_scale_inv' is F32\[3, 2\].*one F32 value .* one per "
                                            r"output row"):
        SafetensorsFiles(str(tmp_path), quantization(config, "config.json"))
