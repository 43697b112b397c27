"""Reading a HuggingFace directory's safetensors, one tensor at a time, as fp32 NumPy.

Opening reads only the headers (safetensors validates each: offsets inside the file, sizes matching shapes); every
file resolves inside the directory (moe.hf.paths) and is a regular file. A tensor is then read from its own byte
range (the offsets in its file's header) into a fresh array: nothing is unpickled, no shard is mapped whole, and a
caller streaming layer by layer keeps no more than the tensors it holds. F32, F16 and BF16 are held exactly by
fp32; F8_E4M3 weights are dequantized with their `_scale_inv` scales (moe/hf/quant.py) when config.json declares
FP8 (block or per-tensor scales), and gpt-oss's MXFP4 experts (`X_blocks` + `X_scales`, U8) when it declares mxfp4:
those are listed and read as the weight `X` transformers holds ([E, in, out] fp32). Any other dtype is refused
naming the tensor: nothing is cast silently.

`read_block(name, index)` reads a box of a tensor (a slice per axis) from the byte ranges its rows occupy, never
the rest: a device's shard in the sharded import (moe/hf/sharded.py), the up half of a fused gate_up_proj. An FP8
box is widened to whole tiles of its scale grid, dequantized by the same rule, and cut back (DeepSeek's tiles start
at the tensor's origin, not the box's); an MXFP4 box reads the blocks of its rows and 32-column groups. `bytes_read`
counts what was read from disk, per stored tensor.
"""

import collections
import hashlib
import itertools
import json
import math
import os
import struct

import ml_dtypes
import numpy as np
from safetensors import safe_open

from moe.hf.common import HFImportError, inside, read_json
from moe.hf.quant import (
    SCALE_SUFFIX,
    Fp8Blocks,
    Fp8Scaled,
    Mxfp4,
    dequantize_fp8,
    dequantize_fp8_scaled,
    mxfp4_weight,
    scale_grid,
    scaled_fp8_fits,
)

FLOAT_DTYPES = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype(ml_dtypes.bfloat16)}
FP8 = "F8_E4M3"
STORED = {**FLOAT_DTYPES, FP8: np.dtype(ml_dtypes.float8_e4m3fn), "U8": np.dtype(np.uint8)}
BLOCKS, SCALES = "_blocks", "_scales"  # gpt-oss's MXFP4 pair beside the weight's name
INDEX = "model.safetensors.index.json"


class SafetensorsFiles:
    """The tensors of DIR's model.safetensors or of the shards in model.safetensors.index.json.

    `shapes`: name -> shape of every tensor the model may use (a quantized weight's `_scale_inv` is folded into the
    weight, not listed; an MXFP4 pair is listed as its weight, in transformers' shape). `read(name)` returns one
    tensor as fp32 NumPy (with `keep_dtype`, F16 and BF16 tensors as stored; FP8 and MXFP4 are always dequantized to
    fp32). `quant` (moe.hf.quant.quantization of config.json) allows F8_E4M3 weights (Fp8Blocks, Fp8Scaled) or
    MXFP4 pairs (Mxfp4); `rename(stored name)` gives the name a family reads (None: not part of the model, skipped;
    e.g. Kimi-K2.5's vision tower)."""

    def __init__(self, path_dir: str, quant: Fp8Blocks | Fp8Scaled | Mxfp4 | None = None, rename=None,
                 keep_dtype: bool = False):
        self.quant = quant
        self.keep_dtype = keep_dtype
        self.bytes_read: collections.Counter = collections.Counter()  # tensor name -> bytes read from disk
        self.shapes: dict[str, tuple[int, ...]] = {}
        self._at: dict[str, tuple] = {}  # name -> (path, dtype, shape, offset, nbytes)
        for name in _files(path_dir):
            path = inside(path_dir, name, f"{INDEX} weight_map entry")
            if not os.path.isfile(path):
                raise HFImportError(f"{os.path.join(path_dir, name)}: missing (named by {INDEX}); re-download "
                                    "the checkpoint")
            for k, entry in _header(path, os.path.join(path_dir, name)).items():
                k = rename(k) if rename else k
                if k is None:
                    continue
                if k in self._at:
                    raise HFImportError(f"{path_dir}: tensor {k!r} is stored twice ({self._at[k][0]} and {path})")
                self._at[k] = entry
        scales = set()
        self._mxfp4: dict[str, tuple[int, ...]] = {}  # weight name -> its shape as transformers holds it
        for k, (path, dtype, shape, _, _) in self._at.items():
            if dtype == FP8:
                scales.add(self._check_fp8(k, shape, path))
            elif dtype == "U8" and k.endswith(BLOCKS) and isinstance(quant, Mxfp4):
                scales.update(self._check_mxfp4(k[:-len(BLOCKS)], shape, path))
            elif dtype == "U8" and k.endswith(SCALES) and isinstance(quant, Mxfp4) and k[:-len(SCALES)] + BLOCKS in self._at:
                continue  # checked with its blocks
            elif dtype not in FLOAT_DTYPES:
                raise HFImportError(f"{path}: tensor {k!r} is {dtype}; only {', '.join(FLOAT_DTYPES)} weights (and "
                                    f"{FP8} with config.json's FP8 quantization_config, U8 {BLOCKS} / {SCALES} with "
                                    "its mxfp4 one) are read exactly (convert quantized, integer or float64 weights "
                                    "to bf16/fp32 first)")
        self.shapes = {k: at[2] for k, at in self._at.items() if k not in scales}
        self.shapes.update(self._mxfp4)

    def _check_fp8(self, k: str, shape, path: str) -> str:
        """The `_scale_inv` of the F8_E4M3 weight k, checked (HFImportError naming the tensor otherwise)."""
        scale = k + SCALE_SUFFIX
        if not isinstance(self.quant, (Fp8Blocks, Fp8Scaled)):
            raise HFImportError(f"{path}: tensor {k!r} is {FP8} but config.json has no quantization_config of FP8 (the "
                                "layout of its scales is unknown); add the checkpoint's quantization_config")
        if scale not in self._at:
            raise HFImportError(f"{path}: tensor {k!r} is {FP8} without its scales {scale!r}; re-download the "
                                "checkpoint")
        _, dtype, got, _, _ = self._at[scale]
        if isinstance(self.quant, Fp8Scaled):
            if dtype != "F32" or len(shape) < 2 or not scaled_fp8_fits(shape, got):
                raise HFImportError(f"{path}: tensor {scale!r} is {dtype}{list(got)}; {FP8} {k!r} {list(shape)} with "
                                    "quantization_config.weight_block_size null needs one F32 value ([] or [1]) or "
                                    "one per output row ([out, 1])")
            return scale
        want = scale_grid(shape, self.quant) if len(shape) >= 2 else None
        if dtype != "F32" or tuple(got) != want:
            raise HFImportError(f"{path}: tensor {scale!r} is {dtype}{list(got)}; {FP8} {k!r} {list(shape)} in "
                                f"blocks of {[self.quant.rows, self.quant.cols]} (quantization_config."
                                f"weight_block_size) needs F32{list(want or [])}")
        return scale

    def _check_mxfp4(self, k: str, shape, path: str) -> tuple[str, str]:
        """The MXFP4 pair of weight k checked, and k listed in transformers' shape (HFImportError naming it)."""
        blocks, scales = k + BLOCKS, k + SCALES
        module = k.rpartition(".")[0]
        if not self.quant.converts(module):
            raise HFImportError(f"{path}: tensor {blocks!r} is MXFP4 but quantization_config.modules_to_not_convert "
                                f"lists {module!r}; the config and the weights disagree")
        if k in self._at:
            raise HFImportError(f"{path}: tensor {k!r} is stored both plain and as MXFP4 ({blocks!r})")
        if scales not in self._at:
            raise HFImportError(f"{path}: tensor {blocks!r} is MXFP4 without its scales {scales!r}; re-download the "
                                "checkpoint")
        _, dtype, got, _, _ = self._at[scales]
        if len(shape) != 4 or shape[-1] != 16 or dtype != "U8" or tuple(got) != tuple(shape[:-1]):
            raise HFImportError(f"{path}: MXFP4 tensors {blocks!r} U8{list(shape)} and {scales!r} {dtype}{list(got)} "
                                "do not fit (gpt-oss's experts: U8 [E, out, in / 32, 16] and U8 [E, out, in / 32])")
        E, out, groups, _ = shape
        self._mxfp4[k] = (E, 32 * groups, out)
        return blocks, scales

    def read(self, name: str) -> np.ndarray:
        if name in self._mxfp4:
            return mxfp4_weight(self._stored(name + BLOCKS), self._stored(name + SCALES), name)
        arr = self._stored(name)
        if arr.dtype == STORED[FP8] and isinstance(self.quant, Fp8Scaled):
            return dequantize_fp8_scaled(arr, self._stored(name + SCALE_SUFFIX), name)
        if arr.dtype == STORED[FP8]:
            return dequantize_fp8(arr, self._stored(name + SCALE_SUFFIX), self.quant, name)
        return self._as_read(arr)

    def read_block(self, name: str, index) -> np.ndarray:
        """tensor[index] for a tuple of slices (one per axis; missing trailing ones are whole; positive steps), read
        from the byte ranges of the box the slices span only, as `read` returns tensors (FP8, MXFP4 dequantized;
        MXFP4 only the rows its last axis's step takes)."""
        shape = self._mxfp4.get(name) or self._at[name][2]
        box, steps = [], []
        for s, n in zip(tuple(index) + (slice(None),) * len(shape), shape):
            a, b, step = s.indices(n)
            if step < 1:
                raise ValueError(f"read_block({name!r}): step {step}; only positive steps")
            box.append((a, max(a, a + step * (len(range(a, b, step)) - 1) + 1)))
            steps.append(slice(None, None, step))
        if name in self._mxfp4:
            return self._mxfp4_block(name, box, steps[-1].step)
        return self._read_box(name, box)[tuple(steps)]

    def _read_box(self, name: str, box) -> np.ndarray:
        """tensor[a0:b0, a1:b1, ...] for box [(a0, b0), ...], as `read` returns tensors."""
        path, dtype, shape, offset, _ = self._at[name]
        if dtype != FP8:
            return self._as_read(self._box(name, path, STORED[dtype], shape, offset, box))
        if isinstance(self.quant, Fp8Scaled):
            s_path, _, s_shape, s_offset, s_bytes = self._at[name + SCALE_SUFFIX]
            s = _read(s_path, name + SCALE_SUFFIX, STORED["F32"], s_shape, s_offset, s_bytes)  # a value per row at most
            self.bytes_read[name + SCALE_SUFFIX] += s_bytes
            if len(s_shape) == len(shape):  # [..., 1 or out, 1]: the box's matrices and rows of it
                s = s[tuple(slice(a, b) for a, b in box[:-2])
                      + ((slice(*box[-2]),) if s_shape[-2] > 1 else (slice(None),)) + (slice(None),)]
            return dequantize_fp8_scaled(self._box(name, path, STORED[FP8], shape, offset, box), s, name)
        # DeepSeek's rule indexes tiles from the tensor's origin: read whole tiles, dequantize, cut back to the box
        sizes = (self.quant.rows, self.quant.cols)
        tiles = [(a // t, -(-b // t)) for (a, b), t in zip(box[-2:], sizes)]
        wide = box[:-2] + [(a * t, min(b * t, n)) for (a, b), t, n in zip(tiles, sizes, shape[-2:])]
        q = self._box(name, path, STORED[FP8], shape, offset, wide)
        s_path, _, s_shape, s_offset, _ = self._at[name + SCALE_SUFFIX]
        s = self._box(name + SCALE_SUFFIX, s_path, STORED["F32"], s_shape, s_offset, box[:-2] + tiles)
        w = dequantize_fp8(q, s, self.quant, name)
        return w[(...,) + tuple(slice(a - w0, b - w0) for (a, b), (w0, _) in zip(box[-2:], wide[-2:]))]

    def _mxfp4_block(self, name: str, box, step: int = 1) -> np.ndarray:
        """weight[box] of an MXFP4 weight ([E, in, out]), every step-th output of it: the blocks and scales of its
        experts, output rows and 32-column groups of input, those rows dequantized and cut back to the box."""
        (e0, e1), (i0, i1), (o0, o1) = box
        g0, g1 = i0 // 32, -(-i1 // 32)
        b_path, _, b_shape, b_offset, _ = self._at[name + BLOCKS]
        s_path, _, s_shape, s_offset, _ = self._at[name + SCALES]
        blocks = self._box(name + BLOCKS, b_path, STORED["U8"], b_shape, b_offset, [(e0, e1), (o0, o1), (g0, g1),
                                                                                      (0, 16)])
        scales = self._box(name + SCALES, s_path, STORED["U8"], s_shape, s_offset, [(e0, e1), (o0, o1), (g0, g1)])
        return mxfp4_weight(blocks[:, ::step], scales[:, ::step], name, slice(i0 - 32 * g0, i1 - 32 * g0))

    def fingerprint(self) -> str:
        """A hash of what the headers say (every tensor's file, dtype, shape and byte range) and of each file's size:
        what a resumed computation checks it is reading the same checkpoint by, without reading any tensor."""
        h = hashlib.sha256()
        for k in sorted(self._at):
            path, dtype, shape, offset, nbytes = self._at[k]
            h.update(json.dumps([k, os.path.basename(path), os.path.getsize(path), dtype, list(shape), offset,
                                 nbytes]).encode())
        return h.hexdigest()[:32]

    def stored_bytes(self, name: str) -> int:
        """The tensor's bytes on disk (an FP8 weight's scales included; an MXFP4 weight's blocks and scales)."""
        if name in self._mxfp4:
            return self._at[name + BLOCKS][4] + self._at[name + SCALES][4]
        scale = self._at.get(name + SCALE_SUFFIX) if self._at[name][1] == FP8 else None
        return self._at[name][4] + (scale[4] if scale else 0)

    def held_bytes(self, name: str) -> int:
        """What `read` returns for it: fp32, or with keep_dtype F16 / BF16 as stored (FP8, MXFP4: dequantized
        fp32)."""
        if name in self._mxfp4:
            return 4 * math.prod(self._mxfp4[name])
        _, dtype, shape, _, nbytes = self._at[name]
        return nbytes if self.keep_dtype and dtype in ("F16", "BF16", "F32") else 4 * math.prod(shape)

    def _as_read(self, arr: np.ndarray) -> np.ndarray:
        return arr if arr.dtype == np.float32 or self.keep_dtype else arr.astype(np.float32)

    def _stored(self, name: str) -> np.ndarray:
        path, dtype, shape, offset, nbytes = self._at[name]
        self.bytes_read[name] += nbytes
        return _read(path, name, STORED[dtype], shape, offset, nbytes)

    def _box(self, name, path, dtype, shape, offset, box) -> np.ndarray:
        out = _read_box(path, name, dtype, shape, offset, box)
        self.bytes_read[name] += out.nbytes
        return out

    def release(self) -> None:
        """Nothing to release: each read opens, reads its byte range and closes (kept for the streaming callers)."""


def read_tensors(path_dir: str, quant: Fp8Blocks | Fp8Scaled | Mxfp4 | None = None, rename=None
                 ) -> dict[str, np.ndarray]:
    """All tensors of DIR at once, as fp32 NumPy (SafetensorsFiles' checks); the loader streams them instead."""
    files = SafetensorsFiles(path_dir, quant, rename)
    return {k: files.read(k) for k in files.shapes}


def _files(path_dir: str) -> list[str]:
    if os.path.isfile(os.path.join(path_dir, INDEX)):
        weight_map = read_json(path_dir, INDEX).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise HFImportError(f"{os.path.join(path_dir, INDEX)}: no weight_map; re-download the checkpoint")
        return sorted({str(v) for v in weight_map.values()})
    if os.path.isfile(os.path.join(path_dir, "model.safetensors")):
        return ["model.safetensors"]
    raise HFImportError(f"{path_dir}: no model.safetensors or {INDEX} (.bin checkpoints are not read; convert them "
                        "to safetensors)")


def _header(path: str, shown: str) -> dict[str, tuple]:
    """name -> (path, dtype, shape, absolute offset, nbytes) from the file's header, after safetensors has
    validated it (every offset inside the file, the data contiguous)."""
    try:
        with safe_open(path, framework="flax"):
            pass
    except Exception as e:  # safetensors raises its own error type on a damaged header
        raise HFImportError(f"{shown}: not a valid safetensors file ({str(e)[:100]}); re-download it") from None
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
    out = {}
    for k, info in header.items():
        if k == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        shape = tuple(int(d) for d in info["shape"])
        item = STORED[info["dtype"]].itemsize if info["dtype"] in STORED else None
        if item is not None and end - begin != math.prod(shape) * item:
            raise HFImportError(f"{shown}: tensor {k!r} holds {end - begin} bytes, its shape {list(shape)} needs "
                                f"{math.prod(shape) * item}; re-download the checkpoint")
        out[k] = (path, info["dtype"], shape, 8 + n + begin, end - begin)
    return out


def _read_box(path: str, name: str, dtype: np.dtype, shape, offset: int, box) -> np.ndarray:
    """tensor[a0:b0, a1:b1, ...] (box: (a, b) per axis) of the tensor at `offset`, read run by run: a run is the box's
    part of one row of the last axis that is not whole (with every later axis whole: one contiguous range), read
    straight into the result (os.preadv), so nothing outside the box is read or held."""
    out = np.empty([b - a for a, b in box], dtype)
    if not out.size:
        return out
    cut = max((d for d, (a, b) in enumerate(box) if (a, b) != (0, shape[d])), default=0)
    strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]  # elements
    run = (box[cut][1] - box[cut][0]) * strides[cut] * dtype.itemsize
    view = memoryview(out.reshape(-1).view(np.uint8))
    with open(path, "rb", buffering=0) as f:
        fd = f.fileno()
        for n, lead in enumerate(itertools.product(*[range(a, b) for a, b in box[:cut]])):
            at = offset + dtype.itemsize * (sum(i * s for i, s in zip(lead, strides)) + box[cut][0] * strides[cut])
            got = 0
            while got < run:
                k = os.preadv(fd, [view[n * run + got:(n + 1) * run]], at + got)
                if not k:
                    raise HFImportError(f"{path}: ends inside tensor {name!r}; re-download the checkpoint")
                got += k
    return out


def _read(path: str, name: str, dtype: np.dtype, shape, offset: int, nbytes: int) -> np.ndarray:
    """The tensor's bytes at `offset`, read straight into a new array (no mapping of the rest of the file)."""
    out = np.empty(shape, dtype)
    view = memoryview(out.reshape(-1).view(np.uint8))
    with open(path, "rb", buffering=0) as f:
        f.seek(offset)
        got = 0
        while got < nbytes:
            n = f.readinto(view[got:])
            if not n:
                raise HFImportError(f"{path}: ends inside tensor {name!r}; re-download the checkpoint")
            got += n
    return out
