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
GROUPED_MATMULS = ("auto", "ragged_dot", "blocked", "slab", "tokamax")
ROUTER_SCORES = ("sigmoid", "softmax")
QK_NORMS = ("none", "head", "full")


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
    # Layer i >= first_k_dense is MoE iff (i + 1) % moe_layer_step == 0 and i is not in `dense_layers`
    # (comma-separated indices, e.g. "0,5"): Qwen-MoE's decoder_sparse_step / mlp_only_layers.
    moe_layer_step: int = 1
    dense_layers: str = ""
    tie_embeddings: bool = False
    norm_eps: float = 1e-6
    # Attention.
    mask: str = "causal"  # causal | prefix | bidirectional | mixed (see moe/masks.py)
    rope: bool = True  # False: no position encoding (NoPE)
    rope_theta: float = 10000.0
    rope_fraction: float = 1.0  # rotate the leading fraction of head_dim, rotate-half within it (GLM-4.5: 0.5)
    qkv_bias: bool = False  # biases on the q/k/v projections (Qwen2-MoE, GLM-4.5 attention_bias)
    attn_out_bias: bool = False  # bias on the output projection (OLMoE / Qwen3-MoE attention_bias)
    # RMSNorm of q and k before RoPE: none | head (over each head's Dh: Qwen3-MoE, GLM use_qk_norm) |
    # full (over the whole H*Dh projection: OLMoE).
    qk_norm: str = "none"
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
    # sigmoid: DeepSeek-V3 affinities. softmax: over all routed experts, then top-k (Mixtral, Qwen-MoE, OLMoE; they
    # have no selection bias: keep the routing bias at 0 and bias_update_rate 0).
    router_score: str = "sigmoid"
    shared_d_ff: int = 0  # width of the shared-expert SwiGLU; 0: moe_d_ff * n_shared_experts
    shared_expert_gate: bool = False  # Qwen2-MoE: shared output scaled by sigmoid(u . w_gate), per token
    balance_loss_weight: float = 1e-4  # alpha of the sequence-wise balance loss; 0 turns it off
    # dropless: sort + grouped matmul (grouped_matmul below), never drops; on a mesh with expert > 1 it runs expert-parallel (all_to_all)
    # with a no-drop bound. capacity: GShard einsums, at most C = ceil(capacity_factor * L * K / E) tokens per
    # expert and sequence. expert_parallel: all_to_all with ceil(capacity_factor * N / expert) rows per device
    # pair. reference: loop over experts (tests). See moe/moe_layer.py and moe/expert_parallel.py.
    dispatch: str = "dropless"
    capacity_factor: float = 1.25  # capacity / expert_parallel only; copies past the capacity are dropped
    # The grouped matmul of dropless / expert_parallel: ragged_dot (jax.lax.ragged_dot), blocked (rows padded to
    # 64-row blocks, batched matmuls), slab (per-expert slabs, padded-block fallback; moe/grouped_slab.py), tokamax
    # (Pallas kernels, optional package; moe/grouped_kernels.py), auto (slab on CPU, where XLA lowers ragged_dot
    # densely; else ragged_dot). See docs/performance.md.
    grouped_matmul: str = "auto"
    # Numerics: params are always fp32; activations/matmuls run in `dtype`.
    dtype: str = "float32"
    remat: bool = False  # recompute each block in the backward pass (activation memory: O(1) blocks, not O(depth))
    init_std: float = 0.02

    def __post_init__(self):
        validate(self)

    @property
    def n_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.n_layers))

    @property
    def dense_layer_ids(self) -> tuple[int, ...]:
        return _layer_ids(self.dense_layers)

    def is_moe_layer(self, i: int) -> bool:
        return (i >= self.first_k_dense and (i + 1) % self.moe_layer_step == 0
                and i not in self.dense_layer_ids)

    @property
    def shared_width(self) -> int:
        """Width of the one SwiGLU that holds the shared experts (0: none)."""
        if not self.n_shared_experts:
            return 0
        return self.shared_d_ff or self.moe_d_ff * self.n_shared_experts

    @property
    def rope_dim(self) -> int:
        """Leading head dims that RoPE rotates (HF: int(head_dim * partial_rotary_factor))."""
        return int(self.head_dim * self.rope_fraction)

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)


def _layer_ids(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in text.split(",") if p.strip()) if text.strip() else ()


def validate(c: ModelConfig) -> None:
    """Raise ConfigError naming the first bad field and what is allowed."""

    def fail(field, msg):
        raise ConfigError(f"model.{field}: {msg}")

    for field in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "d_ff",
                  "n_routed_experts", "top_k", "moe_d_ff", "n_group", "topk_group", "moe_layer_step"):
        v = getattr(c, field)
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            fail(field, f"must be a positive integer, got {v!r}")
    for field in ("n_shared_experts", "first_k_dense", "shared_d_ff"):
        v = getattr(c, field)
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            fail(field, f"must be a non-negative integer, got {v!r}")
    for field in ("tie_embeddings", "rope", "norm_topk_prob", "remat", "qkv_bias", "attn_out_bias",
                  "shared_expert_gate"):
        if not isinstance(getattr(c, field), bool):
            fail(field, f"must be true or false, got {getattr(c, field)!r}")
    for field in ("norm_eps", "rope_theta", "routed_scaling_factor", "balance_loss_weight", "capacity_factor",
                  "init_std", "rope_fraction"):
        v = getattr(c, field)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            fail(field, f"must be a finite number, got {v!r}")
    if c.first_k_dense > c.n_layers:
        fail("first_k_dense", f"must be <= n_layers ({c.n_layers}), got {c.first_k_dense}")
    if c.n_heads % c.n_kv_heads:
        fail("n_kv_heads", f"n_heads ({c.n_heads}) must be divisible by n_kv_heads ({c.n_kv_heads})")
    if c.head_dim % 2 and c.rope:
        fail("head_dim", f"must be even for RoPE, got {c.head_dim}")
    if not 0 < c.rope_fraction <= 1:
        fail("rope_fraction", f"must be in (0, 1], got {c.rope_fraction}")
    if c.rope and (c.rope_dim < 2 or c.rope_dim % 2):
        fail("rope_fraction", f"int(head_dim * rope_fraction) = {c.rope_dim} rotated dims must be even and >= 2")
    if c.qk_norm not in QK_NORMS:
        fail("qk_norm", f"unknown q/k norm {c.qk_norm!r}; allowed: {', '.join(QK_NORMS)}")
    if c.router_score not in ROUTER_SCORES:
        fail("router_score", f"unknown router score {c.router_score!r}; allowed: {', '.join(ROUTER_SCORES)}")
    if c.shared_expert_gate and not c.n_shared_experts:
        fail("shared_expert_gate", "needs a shared expert (n_shared_experts >= 1)")
    if not isinstance(c.dense_layers, str):
        fail("dense_layers", f"must be a string of comma-separated layer indices, got {c.dense_layers!r}")
    try:
        ids = _layer_ids(c.dense_layers)
    except ValueError:
        fail("dense_layers", f"must be comma-separated layer indices like '0,3', got {c.dense_layers!r}")
    if any(not 0 <= i < c.n_layers for i in ids):
        fail("dense_layers", f"indices must lie in [0, n_layers) = [0, {c.n_layers}), got {c.dense_layers!r}")
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
