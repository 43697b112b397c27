"""A HuggingFace checkpoint run one block at a time: forward passes over a model larger than host memory.

    stream = LayerStream("path/to/hf_dir")        # headers, the config and every check of the import; nothing read
    logits_BxLxV, routing = inspect(stream, tokens_BxL)     # = load_hf_moe(DIR)[0].inspect(tokens_BxL)

Only one block's weights are in memory at a time: `stream.block(i)` reads layer i through the import's own mapping
(moe.hf.weights.plan: the same tensors, shapes and checks) into the model's own `moe.model.Block`, each tensor read
in the checkpoint's dtype (BF16 / F16 bytes as stored; FP8 and MXFP4 dequantized as they are read,
moe/hf/quant.py) and held in fp32, the dtype the block computes in, one tensor converted at a time (keep_dtype: held
as stored, half the bytes, but XLA:CPU then makes an fp32 copy of every weight inside the computation: more at the
peak). The caller drops the block before reading the next. The ends of the model (embedding; final norm and
LM head) are read when they are needed (`ends`) into `Ends`, which runs Transformer's own methods. So the streamed
forward is the in-memory one reordered, not a second implementation: every layer of every row, then the next
layer; attention over each row as it is (no KV cache). MTP layers are never read (transformers' forward runs
none of them, and neither does `Transformer.inspect`).

Equal to the in-memory path (tests/test_hf_stream.py, every family): the same expert ids, gates, scores and
logits. The weights' values are the import's; the computation is the same jitted block on the same rows, its
parameters cast to the activations' dtype inside it as the model always does (a BF16 weight cast to fp32 is the fp32
weight the import holds).

Memory: the largest block's weights as held (`held_bytes`) plus the computation's temporaries (on CPU the slab
kernel's gathered expert weights, the attention scores of a batch) plus the rows' hidden states;
analysis/hf_memory.py estimates it and benchmarks/streamed_analysis.py measures it (docs/hf_import.md).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from moe.hf.load import open_checkpoint
from moe.hf.weights import held, plan, read_step
from moe.model import DEFAULT_EXECUTION, Block, DualBlock, Transformer
from moe.nn import RMSNorm

ENDS = ("embed", "final_norm.scale", "lm_head")


class Ends(Transformer):
    """The model without its blocks: some of the embedding, the final norm and the LM head, and Transformer's own
    methods over them (so embedding, block inputs and logits are computed by the model's code; only those that need
    no block may be called)."""

    def __init__(self, cfg, variables: dict):
        self.cfg = cfg
        if "embed" in variables:
            self.embed = nnx.Param(variables["embed"])
        if "final_norm.scale" in variables:
            with nnx.use_eager_sharding(False):  # as Transformer builds it: unsharded
                self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps, cfg.norm_offset)
            self.final_norm.scale = nnx.Param(variables["final_norm.scale"])
        if "lm_head" in variables:
            self.lm_head = nnx.Param(variables["lm_head"])


class LayerStream:
    """A HF directory read one block at a time. `cfg`: the imported ModelConfig without MTP modules. keep_dtype: hold
    BF16 / F16 weights as stored (default: fp32, converted as each tensor is read)."""

    def __init__(self, path_dir: str, keep_dtype: bool = False):
        ck = open_checkpoint(path_dir, keep_dtype=keep_dtype)
        self.keep_dtype = keep_dtype
        self.cfg = dataclasses.replace(ck.cfg, mtp_depth=0)  # MTP layers: never read
        self.files, self.where = ck.files, ck.where
        self.groups: dict[str, list] = {}
        for step in plan(self.cfg, ck.layout, ck.files.shapes, ck.where):
            self.groups.setdefault(step.group, []).append(step)
        # the embedding, final norm and head by our name (a tied checkpoint's head is the embedding)
        self._ends = self.groups.pop("ends")[0].pieces

    def _tensors(self, group: str, ends=()) -> list[str]:
        pieces = [p for s in self.groups.get(group, []) for p in s.pieces.values()] + [self._ends[k] for k in ends]
        return [n for p in pieces for n in p.names]

    def disk_bytes(self, group: str = "", ends=()) -> int:
        """Bytes on disk of block `group` ("blocks.i") or of the `ends` named (our names, ENDS)."""
        return sum(self.files.stored_bytes(n) for n in self._tensors(group, ends))

    def held_bytes(self, group: str = "", ends=()) -> int:
        """Bytes in memory once read (fp32; with keep_dtype BF16 / F16 as stored)."""
        return sum(self.files.held_bytes(n) for n in self._tensors(group, ends))

    def block(self, i: int, on_read=lambda n_bytes: None) -> Block:
        """Block i with the checkpoint's weights, read a step at a time (a step's arrays become device arrays before
        the next is read); on_read(bytes) after each step."""
        prefix, arrays = f"blocks.{i}.", {}
        for step in self.groups[f"blocks.{i}"]:
            before = self.files.bytes_read.total()
            for k, arr in read_step(step, self.files, self.where).items():
                arrays[k[len(prefix):]] = jnp.asarray(held(arr, keep=self.keep_dtype))
                del arr
            on_read(self.files.bytes_read.total() - before)
        return build_block(self.cfg, i, arrays)

    def ends(self, *names: str) -> Ends:
        """Ends holding the variables `names` (of ENDS that the model has); a tied model's head is its embedding."""
        return Ends(self.cfg, {k: jnp.asarray(held(self._ends[k].read(self.files), keep=self.keep_dtype))
                               for k in names if k in self._ends})

    def head_names(self) -> tuple[str, ...]:
        """What the logits need: the final norm and the head (the embedding when tied)."""
        return ("final_norm.scale", "embed" if self.cfg.tie_embeddings else "lm_head")


def build_block(cfg, i: int, arrays: dict) -> Block:
    """moe.model.Block (DualBlock for dual_sublayers) i of `cfg` holding `arrays` (its variables by their path inside the block); each must have the
    block's shape (ValueError naming it otherwise), in any float dtype the computation casts from."""
    layer = DualBlock if cfg.dual_sublayers else Block  # as Transformer picks its blocks
    with nnx.use_eager_sharding(False):  # as Transformer builds its blocks: unsharded
        graphdef, state = nnx.split(nnx.eval_shape(lambda: layer(cfg, i, nnx.Rngs(0))))
    filled = []
    for path, var in nnx.to_flat_state(state):
        k = ".".join(map(str, path))
        arr = arrays.pop(k)
        if tuple(arr.shape) != tuple(var.get_value().shape):
            raise ValueError(f"block {i}: {k} is {list(arr.shape)}, the block needs {list(var.get_value().shape)}")
        filled.append((path, var.replace(arr)))
    if arrays:
        raise ValueError(f"block {i}: unexpected variables {sorted(arrays)[:4]}")
    return nnx.merge(graphdef, nnx.from_flat_state(filled))


@functools.partial(jax.jit, static_argnums=(0, 3))
def _embed(graphdef, state, tokens_BxL, ex):
    return nnx.merge(graphdef, state).embed_tokens(tokens_BxL, ex)


@functools.partial(jax.jit, static_argnums=(0, 4))
def _block(graphdef, state, x_BxLxD, inputs, ex):
    return nnx.merge(graphdef, state)(x_BxLxD, inputs, ex)


@functools.partial(jax.jit, static_argnums=(0, 3))
def _unembed(graphdef, state, x_BxLxD, ex):
    return nnx.merge(graphdef, state).unembed(x_BxLxD, ex)


def embed(ends: Ends, tokens_BxL, ex):
    """The residual stream entering block 0 (Transformer.embed_tokens), jitted. `ex`: a resolved Execution."""
    return _embed(*nnx.split(ends), tokens_BxL, ex)


def run_block(block: Block, x_BxLxD, inputs, ex):
    """block(x, inputs, ex) jitted (compiled once per block structure and shapes): a moe.model.BlockOutput."""
    return _block(*nnx.split(block), x_BxLxD, inputs, ex)


def unembed(ends: Ends, x_BxLxD, ex):
    """Final norm + LM head: logits [B, L, V] in fp32 (Transformer.unembed), jitted."""
    return _unembed(*nnx.split(ends), x_BxLxD, ex)


def inspect(stream: LayerStream, tokens_BxL, *, execution=DEFAULT_EXECUTION, positions_BxL=None, segment_ids_BxL=None,
            prefix_len_B=None):
    """(logits [B, L, V] fp32, every MoE layer's moe.router.Routing): Transformer.inspect's, one block in memory at
    a time."""
    ex = execution.resolved()
    ends = stream.ends("embed")
    inputs = ends.block_inputs(tokens_BxL, positions_BxL=positions_BxL, segment_ids_BxL=segment_ids_BxL,
                               prefix_len_B=prefix_len_B)
    x_BxLxD = embed(ends, tokens_BxL, ex)
    del ends
    routing = []
    for i in range(stream.cfg.n_layers):
        out = run_block(stream.block(i), x_BxLxD, inputs, ex)  # the block is dropped with the call
        x_BxLxD = out.x
        if out.routing is not None:
            routing.append(out.routing)
    return unembed(stream.ends(*stream.head_names()), x_BxLxD, ex), routing
