"""Quantized HF weights, dequantized to fp32 as they are read (moe/hf/tensors.py): DeepSeek's block FP8, FP8 with one
scale per tensor or per output row, and gpt-oss's MXFP4 experts.

Block FP8 (DeepSeek-V3/R1/V3.1/V3.2, Kimi-K2-Instruct): config.json `quantization_config`
{"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [bm, bn], ...}; each quantized Linear `X.weight` is
F8_E4M3 [out, in] beside `X.weight_scale_inv` F32 [ceil(out / bm), ceil(in / bn)], and DeepSeek's rule
(inference/kernel.py `weight_dequant`) is

    w[i, j] = float32(q[i, j]) * scale_inv[i // bm, j // bn]

with partial tiles at the bottom and right edges (DeepSeek-V3's 576-row kv_a_proj_with_mqa). transformers 5.25's
CPU dequantization splits the rows evenly over the scale grid instead (block = rows // grid rows), which differs
exactly on partial tiles; it is not followed. `scale_fmt: "ue8m0"` (V3.1, V3.2) scales are F32 powers of two on
disk (V3.1's o_proj scales are not): the same multiply, never cast. Whether a tensor is quantized is read from its
dtype in the safetensors header, never from its name (moe/hf/tensors.py).

Per-tensor FP8 (transformers' FineGrainedFP8Config with `"weight_block_size": null`): `X.weight` F8_E4M3 beside an
F32 `X.weight_scale_inv` of one value ([], [1] or [1, 1]; [E, 1, 1] for fused experts) or one per output row
([out, 1]); w = float32(q) * scale, as transformers' Fp8Dequantize computes it (its scale grid then divides the
weight exactly). A config without `weight_block_size` is refused (transformers would assume [128, 128]).

MXFP4 (gpt-oss experts, OCP microscaling; `{"quant_method": "mxfp4", "modules_to_not_convert": [...]}`):
`X_blocks` uint8 [E, out, G, 16] holds 32 E2M1 codes per block along the input axis (low nibble = even element),
`X_scales` uint8 [E, out, G] an E8M0 exponent per block (2^(byte - 127)); the weight transformers holds is the
dequantized [E, out, G * 32] transposed to [E, in, out] (integrations/mxfp4.py). A module matching a
`modules_to_not_convert` pattern (transformers' should_convert_module: a prefix up to a module boundary, a regex
from the start, or a suffix) must be stored plain.

Refused by name (transformers 5.25 dequantizes neither on CPU, so there is nothing to check an import against):
`fbgemm_fp8` (per-row `weight_scale`, fbgemm_gpu kernels only) and `compressed-tensors` (its own package).
"""

import dataclasses
import math
import re

import ml_dtypes
import numpy as np

from moe.hf.common import HFImportError, refuse

FP8_KEYS = {"quant_method", "fmt", "weight_block_size", "activation_scheme", "scale_fmt", "modules_to_not_convert",
            "dequantize"}
MXFP4_KEYS = {"quant_method", "modules_to_not_convert", "dequantize"}
NOT_READ = {  # quant_method -> why it is refused
    "fbgemm_fp8": "per-row FP8 that transformers runs only with fbgemm_gpu on a GPU (no CPU dequantization to check "
                  "against); convert the weights to bf16 first",
    "compressed-tensors": "the compressed_tensors package's formats (INT4 experts in Kimi-K2-Thinking / K2.5, FP8 "
                          "with input scales ...) are not read; convert the weights to bf16 first",
}
SCALE_SUFFIX = "_scale_inv"  # DeepSeek's converter finds `f"{weight_name}_scale_inv"`
E4M3 = ml_dtypes.float8_e4m3fn


@dataclasses.dataclass(frozen=True)
class Fp8Blocks:
    """Block FP8 weights: one float32 multiplier per [rows, cols] tile of each F8_E4M3 weight."""
    rows: int
    cols: int


@dataclasses.dataclass(frozen=True)
class Fp8Scaled:
    """FP8 weights with one float32 multiplier per tensor or per output row (weight_block_size null)."""


@dataclasses.dataclass(frozen=True)
class Mxfp4:
    """gpt-oss's MXFP4 experts; `keep`: the modules_to_not_convert patterns (modules stored unquantized)."""
    keep: tuple[str, ...] = ()

    def converts(self, module: str) -> bool:
        """Whether transformers quantizes `module` (quantizers_utils.should_convert_module on `keep`)."""
        boundary = r"(?:(?<=\.)|(?=\.|$))"
        return not any(re.match(rf"(?:{k}){boundary}", module) or module.endswith(k) for k in self.keep)


def quantization(c: dict, where: str) -> Fp8Blocks | Fp8Scaled | Mxfp4 | None:
    """config.json's `quantization_config`: None without one, Fp8Blocks for DeepSeek's block FP8 (any block size),
    Fp8Scaled for FP8 with weight_block_size null, Mxfp4 for gpt-oss's; anything else refused naming the field
    (HFImportError)."""
    q = c.get("quantization_config")
    if q is None:
        return None
    if not isinstance(q, dict):
        refuse(where, "quantization_config", q, "expected an object")
    method = q.get("quant_method")
    if q.get("modules_to_not_convert") is not None and (
            not isinstance(q["modules_to_not_convert"], list)
            or not all(isinstance(m, str) for m in q["modules_to_not_convert"])):
        refuse(where, "quantization_config.modules_to_not_convert", q["modules_to_not_convert"],
               "expected a list of module names")
    if method == "mxfp4":
        for key in sorted(set(q) - MXFP4_KEYS):
            refuse(where, f"quantization_config.{key}", q[key], "an MXFP4 setting this importer does not know")
        for pattern in q.get("modules_to_not_convert") or ():
            try:
                re.compile(pattern)
            except re.error as e:
                refuse(where, "quantization_config.modules_to_not_convert", pattern,
                       f"not a regular expression ({e}); transformers matches each entry as one")
        return Mxfp4(tuple(q.get("modules_to_not_convert") or ()))
    if method in NOT_READ:
        refuse(where, "quantization_config.quant_method", method, NOT_READ[method])
    if method != "fp8":
        refuse(where, "quantization_config.quant_method", method,
               "only FP8 ('fp8', fmt 'e4m3': block or per-tensor scales) and gpt-oss's 'mxfp4' are dequantized "
               "here; convert other quantized weights to bf16 first")
    for key in sorted(set(q) - FP8_KEYS):
        refuse(where, f"quantization_config.{key}", q[key], "an FP8 setting this importer does not know")
    if q.get("fmt", "e4m3") != "e4m3":
        refuse(where, "quantization_config.fmt", q["fmt"], "only e4m3 (float8_e4m3fn) weights")
    if q.get("activation_scheme", "dynamic") != "dynamic":
        refuse(where, "quantization_config.activation_scheme", q["activation_scheme"],
               "static activation scales are not applied; only 'dynamic' (weights are dequantized to fp32)")
    if q.get("scale_fmt") not in (None, "float", "ue8m0"):
        refuse(where, "quantization_config.scale_fmt", q["scale_fmt"], "only F32 scales ('float' or 'ue8m0')")
    if "weight_block_size" in q and q["weight_block_size"] is None:
        return Fp8Scaled()
    block = q.get("weight_block_size")
    if (not isinstance(block, list) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        refuse(where, "quantization_config.weight_block_size", block,
               "expected two positive integers [rows, cols], or null for one scale per tensor or output row")
    return Fp8Blocks(*block)


def scale_grid(shape, blocks: Fp8Blocks) -> tuple[int, ...]:
    """The scale_inv shape DeepSeek's rule needs for a weight of `shape` ([..., out, in])."""
    *lead, rows, cols = shape
    return (*lead, math.ceil(rows / blocks.rows), math.ceil(cols / blocks.cols))


def _check_codes_and_scales(q: np.ndarray, scale: np.ndarray, name: str) -> None:
    """A NaN float8_e4m3fn weight code, or a scale that is not a finite positive number, refused naming the tensor."""
    if np.any((q.view(np.uint8) & 0x7F) == 0x7F):
        raise HFImportError(f"tensor {name!r} holds NaN (float8_e4m3fn code 0x7F/0xFF); re-download the checkpoint")
    if not np.all(np.isfinite(scale) & (scale > 0)):
        raise HFImportError(f"tensor {name + SCALE_SUFFIX!r} holds a scale that is not a finite positive number")


def dequantize_fp8(q: np.ndarray, scale_inv: np.ndarray, blocks: Fp8Blocks, name: str = "tensor") -> np.ndarray:
    """fp32 `q * scale_inv` per [blocks.rows, blocks.cols] tile, partial tiles at the edges (DeepSeek's rule);
    q is float8_e4m3fn [..., out, in], scale_inv float32 [..., ceil(out / rows), ceil(in / cols)]. The product is
    formed in fp32, tile row by tile row, so only the fp32 result (and one [in] row of scales) is allocated. A NaN
    weight code or a scale that is not a finite positive number is refused naming the tensor."""
    if q.ndim < 2 or tuple(scale_inv.shape) != scale_grid(q.shape, blocks):
        raise HFImportError(f"tensor {name!r}: scale {list(scale_inv.shape)} does not fit weight {list(q.shape)} in "
                            f"blocks of [{blocks.rows}, {blocks.cols}] (needs {list(scale_grid(q.shape, blocks))})")
    _check_codes_and_scales(q, scale_inv, name)
    rows, cols = q.shape[-2:]
    out = q.astype(np.float32)
    w = out.reshape(-1, rows, cols)
    s = np.asarray(scale_inv, np.float32).reshape(-1, *scale_inv.shape[-2:])
    for m in range(w.shape[0]):
        for t in range(s.shape[1]):  # one tile row: its scales repeated over the columns of each tile
            w[m, t * blocks.rows:(t + 1) * blocks.rows] *= np.repeat(s[m, t], blocks.cols)[:cols]
    return out


def scaled_fp8_fits(shape, scale_shape) -> bool:
    """Whether an F32 scale of `scale_shape` is one value for the weight of `shape` ([..., out, in]: [], [1], [1, 1]
    for a matrix; [..., 1, 1] per matrix of a stack) or one per output row ([..., out, 1])."""
    *lead, rows, _ = shape
    if not lead and tuple(scale_shape) in ((), (1,), (1, 1)):
        return True
    return tuple(scale_shape) in ((*lead, 1, 1), (*lead, rows, 1))


def dequantize_fp8_scaled(q: np.ndarray, scale: np.ndarray, name: str = "tensor") -> np.ndarray:
    """fp32 `q * scale` for a float8_e4m3fn q [..., out, in] and an F32 scale of one value per matrix or per output
    row (scaled_fp8_fits): transformers' Fp8Dequantize on such a grid, the product formed in fp32 in place of the one
    fp32 copy of q. NaN codes and scales that are not finite positive numbers are refused naming the tensor."""
    if q.ndim < 2 or not scaled_fp8_fits(q.shape, scale.shape):
        raise HFImportError(f"tensor {name!r}: scale {list(scale.shape)} is neither one value nor one per output row "
                            f"of weight {list(q.shape)}")
    _check_codes_and_scales(q, scale, name)
    out = q.astype(np.float32)
    out *= np.asarray(scale, np.float32).reshape(scale.shape if scale.ndim == q.ndim else (1, 1))
    return out


# E2M1 code -> value (bit 3 sign, bits 2-1 exponent with bias 1, bit 0 mantissa); the OCP MX spec's table.
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                      np.float32)


def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray, name: str = "tensor") -> np.ndarray:
    """gpt-oss's MXFP4 `X_blocks` uint8 [..., G, 16] and `X_scales` uint8 [..., G] -> fp32 [..., G * 32] in the
    stored orientation ([E, out, in] for experts; transformers then transposes to [E, in, out]). Element 2j of a
    block is byte j's low nibble, element 2j + 1 its high nibble; the block's value is FP4_VALUES[code] x
    2^(scale - 127), exact in fp32. A NaN scale (byte 255) or a product past fp32's range is refused naming the
    tensor."""
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8:
        raise HFImportError(f"tensor {name!r}: MXFP4 blocks and scales are uint8, got {blocks.dtype} and "
                            f"{scales.dtype}")
    if blocks.ndim < 2 or blocks.shape[-1] != 16 or blocks.shape[:-1] != scales.shape:
        raise HFImportError(f"tensor {name!r}: MXFP4 blocks {list(blocks.shape)} and scales {list(scales.shape)} "
                            "do not fit ([..., G, 16] and [..., G])")
    if np.any(scales == 255):
        raise HFImportError(f"tensor {name!r}: an MXFP4 scale is NaN (E8M0 byte 255); re-download the checkpoint")
    out = np.empty((*blocks.shape[:-1], 32), np.float32)
    flat, codes, exps = out.reshape(-1, 32), blocks.reshape(-1, 16), scales.reshape(-1, 1)
    step = -(-len(flat) // 8) or 1  # an eighth of the blocks at a time: the lookups' indices (int64) stay that small
    for a in range(0, len(flat), step):
        part = flat[a:a + step]
        part[:, 0::2] = FP4_VALUES[codes[a:a + step] & 0x0F]
        part[:, 1::2] = FP4_VALUES[codes[a:a + step] >> 4]
        with np.errstate(over="ignore"):  # refused just below, by name
            np.ldexp(part, exps[a:a + step].astype(np.int32) - 127, out=part)
    if not np.all(np.isfinite(out)):
        raise HFImportError(f"tensor {name!r}: MXFP4 values overflow fp32 (scale bytes up to {int(scales.max())})")
    return out.reshape(*blocks.shape[:-2], -1)


def mxfp4_weight(blocks: np.ndarray, scales: np.ndarray, name: str = "tensor", cols=slice(None)) -> np.ndarray:
    """The weight transformers holds for gpt-oss's `X_blocks` [E, out, G, 16] / `X_scales` [E, out, G]: the fp32
    dequantization transposed to [E, G * 32, out] (integrations/mxfp4.py), its input columns `cols` of G * 32. Filled
    one expert at a time: the result and one expert's [out, G * 32] are all the fp32 held."""
    if blocks.ndim != 4:
        raise HFImportError(f"tensor {name!r}: MXFP4 blocks are [E, out, in / 32, 16] (gpt-oss's experts), got "
                            f"{list(blocks.shape)}")
    out = None
    for e in range(blocks.shape[0]):
        w = dequantize_mxfp4(blocks[e], scales[e], name)[:, cols]
        if out is None:
            out = np.empty((blocks.shape[0], *w.shape[::-1]), np.float32)
        out[e] = w.T
    return out
