"""Model hyper-parameters: one frozen dataclass, validated on construction.

`moe/` never imports ml_collections: `configs/*.py` build this object (see `train/config.py`).
"""

import dataclasses
import math

from moe.router import GROUP_SCORES, ROUTERS
from plumbing.errors import ConfigError

MASK_MODES = ("causal", "prefix", "bidirectional", "mixed")
QK_NORMS = ("none", "head", "full")
ATTENTIONS = ("gqa", "mla")
MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
# YaRN's fields and their defaults: any other value needs rope_scaling_factor > 1.
YARN_DEFAULTS = {"rope_original_max_position": 0, "yarn_beta_fast": 32.0, "yarn_beta_slow": 1.0, "yarn_mscale": 0.0,
                 "yarn_mscale_all_dim": 0.0}


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
    mask: str = "causal"  # causal | prefix | bidirectional | mixed (see moe/attention.py)
    rope: bool = True  # False: no position encoding (NoPE)
    rope_theta: float = 10000.0
    rope_fraction: float = 1.0  # rotate the leading fraction of head_dim, rotate-half within it (GLM-4.5: 0.5)
    qkv_bias: bool = False  # biases on the q/k/v projections (Qwen2-MoE, GLM-4.5 attention_bias)
    attn_out_bias: bool = False  # bias on the output projection (OLMoE / Qwen3-MoE attention_bias)
    # RMSNorm of q and k before RoPE: none | head (over each head's Dh: Qwen3-MoE, GLM use_qk_norm) |
    # full (over the whole H*Dh projection: OLMoE).
    qk_norm: str = "none"
    # gqa: the fields above. mla: DeepSeek-V2/V3 multi-head latent attention (moe/mla.py), n_heads heads of the
    # MLA fields below (n_kv_heads, head_dim, rope_fraction, qk_norm and the attention biases unused).
    attention: str = "gqa"
    q_lora_rank: int = 0  # mla: width of the query latent (0: a full-rank query projection, DeepSeek-V2-Lite)
    kv_lora_rank: int = 0  # mla: width of the key/value latent, the cached part (> 0)
    qk_nope_head_dim: int = 0  # mla: per-head query/key dims without position encoding (> 0)
    qk_rope_head_dim: int = 0  # mla: per-head roped query dims and the one roped key all heads share (> 0, even)
    v_head_dim: int = 0  # mla: per-head value dims (> 0)
    rope_interleave: bool = False  # mla: RoPE on pairs (2i, 2i+1), DeepSeek checkpoints' layout; False: rotate-half
    # mla: eps of the query and kv latent RMSNorms; 0: norm_eps. DeepSeek's and transformers' code fix it at 1e-6
    # whatever rms_norm_eps is (Moonlight, GLM-4.7-Flash: 1e-5), so imports set it.
    latent_norm_eps: float = 0.0
    # YaRN context extension (rope_scaling_factor > 1; 1.0: off): frequencies interpolated by the factor below
    # beta_slow rotations over rope_original_max_position, kept above beta_fast; cos/sin scaled by HF's
    # attention_factor from yarn_mscale / yarn_mscale_all_dim (0: unset, as HF's missing keys), and with mla the
    # softmax scale by mscale(factor, yarn_mscale_all_dim)^2 (DeepSeek-V3, Moonlight). See moe/attention.py.
    rope_scaling_factor: float = 1.0
    rope_original_max_position: int = 0
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_mscale: float = 0.0
    yarn_mscale_all_dim: float = 0.0
    # MoE (DeepSeek-V3).
    n_routed_experts: int = 16
    n_shared_experts: int = 1
    top_k: int = 2
    moe_d_ff: int = 256  # width of one (routed or shared) expert
    n_group: int = 1  # group-limited routing: experts form n_group groups ...
    topk_group: int = 1  # ... and only the best topk_group groups are eligible
    # The router: a name in moe/router.py's ROUTERS (sigmoid: DeepSeek-V3's affinities; softmax: over all routed
    # experts, then top-k, as Mixtral, Qwen-MoE, OLMoE and DeepSeek-V2 route; the table lists the rest and the fields
    # each reads).
    router: str = "sigmoid"
    # A group's score: top2_sum, the sum of its two best (score + bias) (DeepSeek-V3); max, its best score
    # (DeepSeek-V2's group_limited_greedy).
    router_group_score: str = "top2_sum"
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True
    shared_d_ff: int = 0  # width of the shared-expert SwiGLU; 0: moe_d_ff * n_shared_experts
    shared_expert_gate: bool = False  # Qwen2-MoE: shared output scaled by sigmoid(u . w_gate), per token
    # Multi-token prediction (DeepSeek-V3 section 2.2, moe/mtp.py): mtp_depth modules after the main model, module
    # k predicting the token k + 1 ahead; each is one more Block (layer n_layers + k - 1: MoE when that index is),
    # sharing the embedding and LM head. Training only; 0: none.
    mtp_depth: int = 0
    init_std: float = 0.02

    def __post_init__(self):
        validate(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        """From a saved dict (checkpoint metadata, config.json). Fields that were once part of the model config
        but say how it runs (LEGACY_EXECUTION_FIELDS, now moe.Execution / the training loss) are ignored, and
        renamed fields (RENAMED_FIELDS) read under their name now, so checkpoints written earlier still load."""
        d = {RENAMED_FIELDS.get(k, k): v for k, v in d.items() if k not in LEGACY_EXECUTION_FIELDS}
        return cls(**d)

    @property
    def moe_layer_ids(self) -> tuple[int, ...]:
        """Indices of the MoE layers, in order (the layer axis of expert_load and of the routing biases)."""
        return tuple(i for i in range(self.n_layers) if self.is_moe_layer(i))

    @property
    def n_moe_layers(self) -> int:
        return len(self.moe_layer_ids)

    @property
    def mtp_moe_layer_ids(self) -> tuple[int, ...]:
        """Layer indices of the MoE blocks of the MTP modules (module k is layer n_layers + k - 1)."""
        return tuple(i for i in range(self.n_layers, self.n_layers + self.mtp_depth) if self.is_moe_layer(i))

    @property
    def train_load_layer_ids(self) -> tuple[int, ...]:
        """The rows of the train step's expert load and routing biases: the MoE layers, then the MTP modules'."""
        return self.moe_layer_ids + self.mtp_moe_layer_ids

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
    def out_init_std(self) -> float:
        """Init std of the projections that write into the residual stream (attention out, FFN down): scaled by
        1/sqrt(2 * n_layers) so the residual variance does not grow with depth (GPT-2)."""
        return self.init_std / (2 * self.n_layers) ** 0.5

    @property
    def rope_dim(self) -> int:
        """Leading head dims that RoPE rotates (HF: int(head_dim * partial_rotary_factor))."""
        return int(self.head_dim * self.rope_fraction)

    @property
    def qk_head_dim(self) -> int:
        """Dims of one query/key dot product: head_dim (gqa) or qk_nope_head_dim + qk_rope_head_dim (mla)."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim if self.attention == "mla" else self.head_dim

    @property
    def value_head_dim(self) -> int:
        return self.v_head_dim if self.attention == "mla" else self.head_dim

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)


# Execution and loss settings the model config held before moe.Execution existed (checkpoints written then
# still carry them under "model").
LEGACY_EXECUTION_FIELDS = ("dispatch", "capacity_factor", "grouped_matmul", "attention_impl", "dtype", "remat",
                           "balance_loss_weight")


# Fields saved under an earlier name: old name -> name now.
RENAMED_FIELDS = {"router_score": "router"}


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
    for field in ("tie_embeddings", "rope", "norm_topk_prob", "qkv_bias", "attn_out_bias",
                  "shared_expert_gate"):
        if not isinstance(getattr(c, field), bool):
            fail(field, f"must be true or false, got {getattr(c, field)!r}")
    for field in ("norm_eps", "rope_theta", "routed_scaling_factor", "init_std", "rope_fraction"):
        v = getattr(c, field)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            fail(field, f"must be a finite number, got {v!r}")
    if c.first_k_dense > c.n_layers:
        fail("first_k_dense", f"must be <= n_layers ({c.n_layers}), got {c.first_k_dense}")
    gqa = c.attention != "mla"  # n_kv_heads and head_dim are grouped-query attention's
    if gqa and c.n_heads % c.n_kv_heads:
        fail("n_kv_heads", f"n_heads ({c.n_heads}) must be divisible by n_kv_heads ({c.n_kv_heads})")
    if gqa and c.head_dim % 2 and c.rope:
        fail("head_dim", f"must be even for RoPE, got {c.head_dim}")
    if not 0 < c.rope_fraction <= 1:
        fail("rope_fraction", f"must be in (0, 1], got {c.rope_fraction}")
    if gqa and c.rope and (c.rope_dim < 2 or c.rope_dim % 2):
        fail("rope_fraction", f"int(head_dim * rope_fraction) = {c.rope_dim} rotated dims must be even and >= 2")
    if c.qk_norm not in QK_NORMS:
        fail("qk_norm", f"unknown q/k norm {c.qk_norm!r}; allowed: {', '.join(QK_NORMS)}")
    _validate_mla(c, fail)
    _validate_yarn(c, fail)
    if c.router not in ROUTERS:
        fail("router", f"unknown router {c.router!r}; allowed: {', '.join(ROUTERS)} (moe/router.py)")
    if c.router_group_score not in GROUP_SCORES:
        fail("router_group_score", f"unknown group score {c.router_group_score!r}; allowed: "
                                   f"{', '.join(GROUP_SCORES)}")
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
    if c.mtp_depth < 0:
        fail("mtp_depth", f"must be >= 0 (0: no multi-token prediction), got {c.mtp_depth}")
    if c.mtp_depth and c.mask != "causal":
        fail("mtp_depth", f"multi-token prediction needs mask 'causal' (a non-causal position would see the tokens "
                          f"it predicts), got mask {c.mask!r}; set model.mtp_depth=0 or model.mask='causal'")
    if c.mask == "mixed" and c.n_heads % 2:
        fail("n_heads", f"mask 'mixed' splits heads in two halves, so n_heads must be even, got {c.n_heads}")
    if c.top_k > c.n_routed_experts:
        fail("top_k", f"must be <= n_routed_experts ({c.n_routed_experts}), got {c.top_k}")
    if c.n_routed_experts % c.n_group:
        fail("n_group", f"n_routed_experts ({c.n_routed_experts}) must be divisible by n_group ({c.n_group})")
    if c.n_group > 1 and c.n_routed_experts // c.n_group < 2 and c.router_group_score == "top2_sum":
        fail("n_group", "each group needs >= 2 experts (a group's score is the sum of its two best)")
    if c.topk_group > c.n_group:
        fail("topk_group", f"must be <= n_group ({c.n_group}), got {c.topk_group}")
    if c.n_group > 1 and c.topk_group * (c.n_routed_experts // c.n_group) < c.top_k:
        fail("topk_group", f"the {c.topk_group} eligible groups hold fewer than top_k ({c.top_k}) experts")
    if not c.routed_scaling_factor > 0:
        fail("routed_scaling_factor", f"must be > 0, got {c.routed_scaling_factor}")
    if not c.norm_eps > 0 or not c.rope_theta > 0 or not c.init_std > 0:
        fail("norm_eps/rope_theta/init_std", "must be > 0")


def _validate_mla(c: ModelConfig, fail) -> None:
    if c.attention not in ATTENTIONS:
        fail("attention", f"unknown attention {c.attention!r}; allowed: {', '.join(ATTENTIONS)}")
    for field in MLA_FIELDS:
        v = getattr(c, field)
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            fail(field, f"must be a non-negative integer, got {v!r}")
    if not isinstance(c.rope_interleave, bool):
        fail("rope_interleave", f"must be true or false, got {c.rope_interleave!r}")
    v = c.latent_norm_eps
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        fail("latent_norm_eps", f"must be a finite number >= 0 (0: norm_eps), got {v!r}")
    if c.attention == "gqa":
        for field in MLA_FIELDS + ("rope_interleave", "latent_norm_eps"):
            if getattr(c, field):
                fail(field, f"is a multi-head latent attention field; set model.attention='mla' or leave it at "
                            f"{getattr(ModelConfig, field)!r}")
        return
    for field in MLA_FIELDS[1:]:
        if getattr(c, field) <= 0:
            fail(field, f"attention 'mla' needs a positive {field}, got {getattr(c, field)}")
    if c.qk_rope_head_dim % 2:
        fail("qk_rope_head_dim", f"RoPE rotates pairs, so it must be even, got {c.qk_rope_head_dim}")
    if not c.rope:
        fail("rope", "attention 'mla' needs RoPE (its decoupled rotary key); NoPE MLA is not implemented")
    for field, gqa_only in (("rope_fraction", 1.0), ("qk_norm", "none"), ("qkv_bias", False),
                            ("attn_out_bias", False)):
        if getattr(c, field) != gqa_only:
            fail(field, f"applies to attention 'gqa' only; with 'mla' leave it at {gqa_only!r}")


def _validate_yarn(c: ModelConfig, fail) -> None:
    for field in ("rope_scaling_factor", "yarn_beta_fast", "yarn_beta_slow", "yarn_mscale", "yarn_mscale_all_dim"):
        v = getattr(c, field)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            fail(field, f"must be a finite number, got {v!r}")
    v = c.rope_original_max_position
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        fail("rope_original_max_position", f"must be a non-negative integer, got {v!r}")
    if c.rope_scaling_factor < 1:
        fail("rope_scaling_factor", f"must be >= 1 (1.0: no YaRN scaling), got {c.rope_scaling_factor}")
    if c.rope_scaling_factor == 1:
        for field, default in YARN_DEFAULTS.items():
            if getattr(c, field) != default:
                fail(field, f"is a YaRN field; set model.rope_scaling_factor > 1 or leave it at {default!r}")
        return
    if not c.rope:
        fail("rope_scaling_factor", "YaRN scales RoPE; it needs model.rope=true")
    if c.rope_original_max_position <= 0:
        fail("rope_original_max_position", "YaRN needs the context length the model was trained on (> 0)")
    if not c.yarn_beta_fast > c.yarn_beta_slow > 0:
        fail("yarn_beta_fast", f"must exceed yarn_beta_slow, and both be > 0; got {c.yarn_beta_fast} and "
                               f"{c.yarn_beta_slow}")
    if c.yarn_mscale < 0 or c.yarn_mscale_all_dim < 0:
        fail("yarn_mscale", f"yarn_mscale and yarn_mscale_all_dim must be >= 0, got {c.yarn_mscale} and "
                            f"{c.yarn_mscale_all_dim}")
