"""One of our variables as a view of HF tensors: which tensor (or which E per-expert tensors), which rows of it, how
it is transposed and reshaped into our layout. Read whole (the import, moe/hf/weights.py) or one rectangular slice
of our layout (a device's shard, moe/hf/sharded.py), reading only the stored elements the slice needs.

Our layouts are HF's with axes permuted and then split (a Linear weight [out, in] becomes [in ..., out ...]; E
expert tensors [out, in] become [E, in, out]), so a slice of ours is, per HF axis, a set of indices: a contiguous
range whenever the split axes inside it are whole (a head range of [D, H, Dh] is a row range of q_proj). The reader
reads the bounding box of those indices (tensors.SafetensorsFiles.read_block: only its byte ranges) and picks the
indices inside it. Reading moves bytes, never computes: a slice equals the same slice of the whole variable, bit
for bit (tests/test_hf_sharded.py), FP8 dequantization included (read_block dequantizes whole tiles).
"""

import dataclasses
import math

import numpy as np


@dataclasses.dataclass(frozen=True)
class Piece:
    names: tuple[str, ...]  # one HF tensor, or (stacked) one per expert along a new leading axis; () for zeros
    hf_shape: tuple[int, ...]  # the HF array the variable is a view of: the stored tensor (stacked: [E, ...])
    #                            from row `rows` of axis -2 on, as many rows as hf_shape[-2]
    shape: tuple[int, ...]  # ours: hf_shape transposed by `perm`, then reshaped
    perm: tuple[int, ...] | None = None  # None: no transpose
    rows: int = 0  # the first row (axis -2) of the stored tensor (fused gate_up_proj: the up half starts at F)
    cols: int = 0  # the first column (axis -1) likewise (Llama 4's [E, D, 2F] gate_up_proj: up from column F)
    step: int = 1  # ... and every step-th column from there (gpt-oss's interleaved gate / up columns: 2)
    stacked: bool = False

    def read(self, src) -> np.ndarray:
        """The whole variable in our layout, in the dtype `src` reads (fp32, or the stored one)."""
        if not self.names:
            return np.zeros(self.shape, np.float32)
        if self.stacked:  # filled one expert at a time: one HF tensor alive beside the result
            first = src.read(self.names[0])
            out = np.empty((len(self.names), *first.shape[::-1]), first.dtype)
            out[0] = first.T
            del first
            for e, name in enumerate(self.names[1:], 1):
                out[e] = src.read(name).T
            return out.reshape(self.shape)
        if self.rows or self.cols or tuple(src.shapes[self.names[0]]) != self.hf_shape:  # part of the rows / columns
            rows = slice(self.rows, self.rows + self.hf_shape[-2])
            cols = slice(self.cols, self.cols + self.step * (self.hf_shape[-1] - 1) + 1, self.step)
            arr = src.read_block(self.names[0], (slice(None),) * (len(self.hf_shape) - 2) + (rows, cols))
        else:
            arr = src.read(self.names[0])
        return (arr.transpose(self.perm) if self.perm else arr).reshape(self.shape)

    def read_slice(self, src, index) -> np.ndarray:
        """ours[index] (a tuple of unit-step slices, one per axis of `shape`), reading only the bounding box of the
        stored elements it needs (src.read_block)."""
        ranges = [range(*s.indices(n)) for s, n in zip(tuple(index) + (slice(None),) * len(self.shape), self.shape)]
        out_shape = tuple(len(r) for r in ranges)
        if not self.names:
            return np.zeros(out_shape, np.float32)
        perm = self.perm or tuple(range(len(self.hf_shape)))
        t_shape = tuple(self.hf_shape[p] for p in perm)
        hf_idx = [None] * len(self.hf_shape)
        for j, dims in enumerate(_split_axes(t_shape, self.shape)):
            hf_idx[perm[j]] = _flat_indices([ranges[d] for d in dims], [self.shape[d] for d in dims])
        if self.cols or self.step > 1:  # stored columns of the view's
            hf_idx[-1] = self.cols + self.step * hf_idx[-1]
        box = [(int(i.min()), int(i.max()) + 1) for i in hf_idx]
        if self.stacked:  # axis 0 picks the experts, each read as its own [out, in] box
            inner = tuple(slice(a, b) for a, b in box[1:])
            arr = np.stack([src.read_block(self.names[e], inner) for e in range(*box[0])])
        else:
            at = [slice(a, b) for a, b in box]
            if self.rows:  # the view starts at row `rows` of the stored tensor
                at[-2] = slice(box[-2][0] + self.rows, box[-2][1] + self.rows)
            arr = src.read_block(self.names[0], tuple(at))
        if any(len(i) != b - a for i, (a, b) in zip(hf_idx, box)):  # not a range: pick the indices in the box
            arr = arr[np.ix_(*[i - a for i, (a, _) in zip(hf_idx, box)])]
        return arr.transpose(perm).reshape(out_shape)

    @property
    def nbytes_fp32(self) -> int:
        return 4 * math.prod(self.shape)


def _split_axes(t_shape, shape) -> list[tuple[int, ...]]:
    """For each axis of t_shape, the axes of `shape` it splits into (a reshape that only splits axes; axes of size
    1 belong to whichever group they fall in, and a t axis of size 1 to none)."""
    groups, k = [], 0
    for t in t_shape:
        group, size = [], 1
        while size < t:
            group.append(k)
            size *= shape[k]
            k += 1
        if size != t:
            raise ValueError(f"{tuple(shape)} does not split the axes of {tuple(t_shape)}")
        groups.append(tuple(group))
    return groups


def _flat_indices(ranges, sizes) -> np.ndarray:
    """The row-major flat indices of the grid ranges[0] x ranges[1] x ... in an array of `sizes` ([0]: no axes)."""
    if not ranges:
        return np.zeros(1, np.int64)
    if len(ranges) == 1:
        return np.arange(ranges[0].start, ranges[0].stop, dtype=np.int64)
    grid = np.meshgrid(*[np.arange(r.start, r.stop, dtype=np.int64) for r in ranges], indexing="ij")
    return np.ravel_multi_index(grid, sizes).reshape(-1)
