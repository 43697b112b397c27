"""Model hyper-parameters: one frozen dataclass, validated on construction.

`moe/` never imports ml_collections: `configs/*.py` build this object (see `train/config.py`).
"""

import dataclasses
import math
from typing import Literal

MaskMode = Literal["causal", "prefix", "bidirectional", "mixed"]
MASK_MODES = ("causal", "prefix", "bidirectional", "mixed")
DISPATCH_MODES = ("dropless", "capacity", "expert_parallel", "reference")
DTYPES = ("float32", "bfloat16", "float16")
ATTENTION_IMPLS = ("einsum", "xla", "cudnn")
GROUPED_MATMULS = ("auto", "ragged_dot", "blocked")


class ConfigError(ValueError):
    """A model config value that is not allowed; the message names the field and what is allowed."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    # Stack.
    vocab_size: int = 8192
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 4  # < n_heads: grouped-query attention
    head_dim: int = 64
    d_ff: int = 1024  # width of the dense SwiGLU in the first `first_k_dense` layers
    first_k_dense: int = 1
    tie_embeddings: bool = False
    norm_eps: float = 1e-6
    # Attention.
    mask: str = "causal"  # causal | prefix | bidirectional | mixed (see moe/masks.py)
    rope: bool = True  # False: no position encoding (NoPE)
    rope_theta: float = 10000.0
    # einsum: explicit einsums + fp32 softmax (the reference; always used with a KV cache or for attention maps).
    # xla / cudnn: jax.nn.dot_product_attention(implementation=...); cudnn is fused flash attention on NVIDIA
    # GPUs (bf16/fp16, head_dim a multiple of 8 and <= 128 before Hopper / 256 from Hopper on).
    attention_impl: str = "einsum"
    # MoE (DeepSeek-V3).
    n_routed_experts: int = 16
    n_shared_experts: int = 1
    top_k: int = 2
    moe_d_ff: int = 256  # width of one (routed or shared) expert
    n_group: int = 1  # group-limited routing: experts form n_group groups ...
    topk_group: int = 1  # ... and only the best topk_group groups are eligible
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True
    balance_loss_weight: float = 1e-4  # alpha of the sequence-wise balance loss; 0 turns it off
    # dropless: sort + grouped matmul (grouped_matmul below), never drops; on a mesh with expert > 1 it runs expert-parallel (all_to_all)
    # with a no-drop bound. capacity: GShard einsums, at most C = ceil(capacity_factor * L * K / E) tokens per
    # expert and sequence. expert_parallel: all_to_all with ceil(capacity_factor * N / expert) rows per device
    # pair. reference: loop over experts (tests). See moe/moe_layer.py and moe/expert_parallel.py.
    dispatch: str = "dropless"
    capacity_factor: float = 1.25  # capacity / expert_parallel only; copies past the capacity are dropped
    # The grouped matmul of dropless / expert_parallel: ragged_dot (jax.lax.ragged_dot), blocked (rows padded to
    # 64-row blocks, batched matmuls), auto (blocked on CPU, where XLA lowers ragged_dot densely; else ragged_dot).
    grouped_matmul: str = "auto"
    # Numerics: params are always fp32; activations/matmuls run in `dtype`.
    dtype: str = "float32"
    remat: bool = False  # recompute each block in the backward pass (activation memory: O(1) blocks, not O(depth))
    init_std: float = 0.02

    def __post_init__(self):
        validate(self)

    @property
    def n_moe_layers(self) -> int:
        return self.n_layers - self.first_k_dense

    def is_moe_layer(self, i: int) -> bool:
        return i >= self.first_k_dense

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)


def validate(c: ModelConfig) -> None:
    """Raise ConfigError naming the first bad field and what is allowed."""

    def fail(field, msg):
        raise ConfigError(f"model.{field}: {msg}")

    for field in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "d_ff",
                  "n_routed_experts", "top_k", "moe_d_ff", "n_group", "topk_group"):
        v = getattr(c, field)
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            fail(field, f"must be a positive integer, got {v!r}")
    for field in ("n_shared_experts", "first_k_dense"):
        v = getattr(c, field)
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            fail(field, f"must be a non-negative integer, got {v!r}")
    for field in ("tie_embeddings", "rope", "norm_topk_prob", "remat"):
        if not isinstance(getattr(c, field), bool):
            fail(field, f"must be true or false, got {getattr(c, field)!r}")
    for field in ("norm_eps", "rope_theta", "routed_scaling_factor", "balance_loss_weight", "capacity_factor",
                  "init_std"):
        v = getattr(c, field)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            fail(field, f"must be a finite number, got {v!r}")
    if c.first_k_dense > c.n_layers:
        fail("first_k_dense", f"must be <= n_layers ({c.n_layers}), got {c.first_k_dense}")
    if c.n_heads % c.n_kv_heads:
        fail("n_kv_heads", f"n_heads ({c.n_heads}) must be divisible by n_kv_heads ({c.n_kv_heads})")
    if c.head_dim % 2 and c.rope:
        fail("head_dim", f"must be even for RoPE, got {c.head_dim}")
    if c.mask not in MASK_MODES:
        fail("mask", f"unknown mask mode {c.mask!r}; allowed: {', '.join(MASK_MODES)}")
    if c.mask == "mixed" and c.n_heads % 2:
        fail("n_heads", f"mask 'mixed' splits heads in two halves, so n_heads must be even, got {c.n_heads}")
    if c.top_k > c.n_routed_experts:
        fail("top_k", f"must be <= n_routed_experts ({c.n_routed_experts}), got {c.top_k}")
    if c.n_routed_experts % c.n_group:
        fail("n_group", f"n_routed_experts ({c.n_routed_experts}) must be divisible by n_group ({c.n_group})")
    if c.n_group > 1 and c.n_routed_experts // c.n_group < 2:
        fail("n_group", "each group needs >= 2 experts (a group's score is the sum of its two best)")
    if c.topk_group > c.n_group:
        fail("topk_group", f"must be <= n_group ({c.n_group}), got {c.topk_group}")
    if c.n_group > 1 and c.topk_group * (c.n_routed_experts // c.n_group) < c.top_k:
        fail("topk_group", f"the {c.topk_group} eligible groups hold fewer than top_k ({c.top_k}) experts")
    if c.dispatch not in DISPATCH_MODES:
        fail("dispatch", f"unknown dispatch {c.dispatch!r}; allowed: {', '.join(DISPATCH_MODES)}")
    if isinstance(c.capacity_factor, bool) or not isinstance(c.capacity_factor, (int, float)) \
            or not c.capacity_factor > 0:
        fail("capacity_factor", f"must be a number > 0 (1.25: 25% headroom over a perfectly even load), "
                                f"got {c.capacity_factor!r}")
    if c.grouped_matmul not in GROUPED_MATMULS:
        fail("grouped_matmul", f"unknown grouped matmul {c.grouped_matmul!r}; allowed: "
                               f"{', '.join(GROUPED_MATMULS)}")
    if c.dtype not in DTYPES:
        fail("dtype", f"unknown dtype {c.dtype!r}; allowed: {', '.join(DTYPES)}")
    if c.attention_impl not in ATTENTION_IMPLS:
        fail("attention_impl", f"unknown attention implementation {c.attention_impl!r}; allowed: "
                               f"{', '.join(ATTENTION_IMPLS)}")
    if c.attention_impl == "cudnn" and c.dtype == "float32":
        fail("attention_impl", "cudnn attention runs in bfloat16 or float16; set model.dtype=bfloat16 or use "
                               "attention_impl=xla")
    if c.attention_impl == "cudnn" and (c.head_dim % 8 or c.head_dim > 256):
        fail("attention_impl", f"cudnn attention needs head_dim a multiple of 8 and <= 256, got {c.head_dim}")
    if not c.routed_scaling_factor > 0:
        fail("routed_scaling_factor", f"must be > 0, got {c.routed_scaling_factor}")
    if c.balance_loss_weight < 0:
        fail("balance_loss_weight", f"must be >= 0 (0 turns it off), got {c.balance_loss_weight}")
    if not c.norm_eps > 0 or not c.rope_theta > 0 or not c.init_std > 0:
        fail("norm_eps/rope_theta/init_std", "must be > 0")
