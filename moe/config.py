"""What the model is: one frozen dataclass, each field with its checks and a one-line description (what
`python -m train --help` prints), validated on construction. `moe/` never imports ml_collections: the run
config's `model` section builds this object (rundir/run_config.py).
"""

import dataclasses
import functools

from moe.router import GROUP_SCORES, ROUTERS
from plumbing.errors import ConfigError
from plumbing.fields import at_least, between, check_fields, field, non_negative, one_of, positive

# Far above any released model (DeepSeek-V3: 61 layers): the per-layer checks and the accounting stay instant.
MAX_LAYERS = 4096

MASK_MODES = ("causal", "prefix", "bidirectional", "mixed")
QK_NORMS = ("none", "head", "full", "weightless")
ATTENTIONS = ("gqa", "mla")
MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
# YaRN's fields and their defaults: any other value needs rope_scaling_factor > 1.
YARN_DEFAULTS = {"rope_original_max_position": 0, "yarn_beta_fast": 32.0, "yarn_beta_slow": 1.0, "yarn_mscale": 0.0,
                 "yarn_mscale_all_dim": 0.0, "yarn_truncate": True}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    # Stack.
    vocab_size: int = field(8192, positive, doc="rows of the embedding and columns of the LM head")
    d_model: int = field(256, positive, doc="width of the residual stream")
    n_layers: int = field(4, between(1, MAX_LAYERS), doc="Transformer blocks")
    n_heads: int = field(4, positive, doc="query heads")
    n_kv_heads: int = field(4, positive, doc="key/value heads (< n_heads: grouped-query attention)")
    head_dim: int = field(64, positive, doc="dims of one head")
    d_ff: int = field(1024, positive, doc="width of the dense SwiGLU of the dense layers")
    first_k_dense: int = field(1, non_negative, doc="leading dense layers before the MoE layers")
    moe_layer_step: int = field(1, positive, doc="layer i >= first_k_dense is MoE iff (i + 1) % moe_layer_step == 0 "
                                                 "and i is not in dense_layers (Qwen-MoE's decoder_sparse_step)")
    dense_layers: str = field("", doc="comma-separated indices of further dense layers, e.g. '0,5' (Qwen-MoE's "
                                      "mlp_only_layers)")
    tie_embeddings: bool = field(False, doc="the LM head is the embedding's transpose")
    norm_eps: float = field(1e-6, positive, doc="RMSNorm epsilon")
    # Attention.
    mask: str = field("causal", one_of(*MASK_MODES), doc="causal | prefix | bidirectional | mixed "
                                                         "(moe/attention.py)")
    rope: bool = field(True, doc="rotary position embedding (false: no position encoding, NoPE)")
    rope_theta: float = field(10000.0, positive, doc="RoPE base")
    rope_fraction: float = field(1.0, between(0, 1, low_open=True),
                                 doc="the leading fraction of head_dim RoPE rotates, rotate-half within it (GLM-4.5: 0.5)")
    qkv_bias: bool = field(False, doc="biases on the q/k/v projections (Qwen2-MoE, GLM-4.5 attention_bias)")
    attn_out_bias: bool = field(False, doc="bias on the output projection (OLMoE / Qwen3-MoE attention_bias)")
    qk_norm: str = field("none", one_of(*QK_NORMS), doc="RMSNorm of q and k before RoPE: none | head (each head's "
                                                        "dims: Qwen3-MoE, GLM) | full (the whole projection: OLMoE) | "
                                                        "weightless (each head's, no scale: Llama 4); not on "
                                                        "nope_layers")
    qk_norm_after_rope: bool = field(False, doc="the q/k RMSNorm after RoPE instead of before (Hunyuan-A13B); the "
                                                "cache holds the normed keys")
    nope_layers: str = field("", doc="comma-separated layers without RoPE, q/k norm or chunking, whose query takes "
                                     "the query scale instead (Llama 4's no_rope_layers zeros); '' = none")
    attention_chunk: int = field(0, non_negative, doc="the other layers attend only within aligned chunks of this "
                                                      "many positions (Llama 4's attention_chunk_size; 0: off)")
    sliding_window: int = field(0, non_negative, doc="sliding_layers see only the last this many positions, "
                                                     "their own included (gpt-oss: 128; 0: off)")
    sliding_layers: str = field("", doc="comma-separated layers with that window (gpt-oss: the even ones)")
    attn_sinks: bool = field(False, doc="a learned logit per query head in every softmax's denominator, with no "
                                        "value (gpt-oss's sinks)")
    dual_sublayers: bool = field(False, doc="LongCat-Flash's layer: two (attention, dense SwiGLU) sublayers and one "
                                            "MoE fed by the first sublayer's normed input and added at the end")
    attn_output_gate: bool = field(False, doc="gqa: the query projection also emits a gate per head and channel; the "
                                              "attention output is multiplied by sigmoid(gate) before the output "
                                              "projection (Qwen3-Next's gated attention)")
    norm_offset: bool = field(False, doc="zero-centred RMSNorm x / rms(x) * (1 + w), w stored and initialised 0: the "
                                         "blocks', final and q/k norms (Qwen3-Next); not the Gated DeltaNet output norm")
    # Gated DeltaNet (moe/gdn.py): a recurrent token mixer in place of attention on linear_layers (Qwen3-Next).
    linear_layers: str = field("", doc="comma-separated layers whose token mixer is Gated DeltaNet (moe/gdn.py) "
                                       "instead of attention (Qwen3-Next's linear_attention layers); '' = none")
    gdn_key_heads: int = field(0, non_negative, doc="Gated DeltaNet: query/key heads (> 0 with linear_layers)")
    gdn_value_heads: int = field(0, non_negative, doc="Gated DeltaNet: value heads, a multiple of gdn_key_heads "
                                                      "(value head j reads key head j // (value / key heads))")
    gdn_key_dim: int = field(0, non_negative, doc="Gated DeltaNet: dims of one query/key head")
    gdn_value_dim: int = field(0, non_negative, doc="Gated DeltaNet: dims of one value head")
    gdn_conv_kernel: int = field(4, positive, doc="Gated DeltaNet: taps of the causal depthwise convolution")
    attention: str = field("gqa", one_of(*ATTENTIONS),
                           doc="gqa (the fields above) | mla: DeepSeek-V2/V3 multi-head latent attention (moe/mla.py), "
                               "n_heads heads of the MLA fields below")
    q_lora_rank: int = field(0, non_negative, doc="mla: width of the query latent (0: a full-rank query projection)")
    kv_lora_rank: int = field(0, non_negative, doc="mla: width of the key/value latent, the cached part (> 0)")
    qk_nope_head_dim: int = field(0, non_negative, doc="mla: per-head query/key dims without position encoding")
    qk_rope_head_dim: int = field(0, non_negative, doc="mla: per-head roped query dims and the one roped key all "
                                                       "heads share (even)")
    v_head_dim: int = field(0, non_negative, doc="mla: per-head value dims")
    rope_interleave: bool = field(False, doc="RoPE on pairs (2i, 2i+1): DeepSeek checkpoints' layout (mla), ERNIE "
                                             "4.5's (gqa); false: rotate-half")
    mla_lora_scale: bool = field(False, doc="mla: the query x sqrt(d_model / q_lora_rank) and the normed latent x "
                                            "sqrt(d_model / kv_lora_rank), cached so (LongCat-Flash)")
    # DeepSeek's and transformers' code fix the latent norms' eps at 1e-6 whatever rms_norm_eps is (Moonlight,
    # GLM-4.7-Flash: 1e-5), so imports set it.
    latent_norm_eps: float = field(0.0, non_negative, doc="mla: eps of the query and kv latent RMSNorms (0: norm_eps)")
    # YaRN context extension: frequencies interpolated by the factor below beta_slow rotations over
    # rope_original_max_position, kept above beta_fast; cos/sin scaled by HF's attention_factor from yarn_mscale /
    # yarn_mscale_all_dim (0: unset, as HF's missing keys), and with mla the softmax scale by
    # mscale(factor, yarn_mscale_all_dim)^2 (DeepSeek-V3, Moonlight). See moe/attention.py.
    rope_scaling_factor: float = field(1.0, at_least(1), doc="YaRN's context extension factor (1.0: off)")
    rope_scaling: str = field("yarn", one_of("yarn", "llama3"), doc="how rope_scaling_factor > 1 scales RoPE: yarn | "
                                                                    "llama3 (Llama 3.1 / Llama 4 Scout: the slow "
                                                                    "frequencies / factor, a smooth ramp between)")
    llama3_low_freq_factor: float = field(1.0, positive, doc="llama3: wavelengths past original / it are slowed")
    llama3_high_freq_factor: float = field(4.0, positive, doc="llama3: wavelengths below original / it are kept")
    rope_original_max_position: int = field(0, non_negative, doc="YaRN: the context length the model was trained on")
    yarn_beta_fast: float = field(32.0, doc="YaRN: rotations above which a frequency is kept")
    yarn_beta_slow: float = field(1.0, doc="YaRN: rotations below which a frequency is interpolated")
    yarn_mscale: float = field(0.0, non_negative, doc="YaRN: mscale (0: unset)")
    yarn_mscale_all_dim: float = field(0.0, non_negative, doc="YaRN: mscale_all_dim (0: unset)")
    yarn_truncate: bool = field(True, doc="YaRN: round the correction range to whole dims (false: gpt-oss)")
    # Llama-4's position-dependent query scale (Mistral Small 4): q *= 1 + beta * ln(1 + floor(position / period)).
    query_scale_beta: float = field(0.0, non_negative, doc="beta of Llama 4's query scale 1 + beta ln(1 + "
                                                           "floor((pos + query_scale_offset) / query_scale_period)) "
                                                           "(0: off): every mla layer's query, gqa's nope_layers'")
    query_scale_period: int = field(0, non_negative, doc="the positions per step of that scale (Mistral Small 4: "
                                                         "YaRN's original context; Llama 4: floor_scale)")
    query_scale_offset: int = field(0, non_negative, doc="added to the position in that scale (Llama 4: 1)")
    # MoE (DeepSeek-V3).
    n_routed_experts: int = field(16, positive, doc="routed experts per MoE layer")
    n_shared_experts: int = field(1, non_negative, doc="shared experts, every token through each")
    top_k: int = field(2, positive, doc="routed experts per token")
    moe_d_ff: int = field(256, positive, doc="width of one (routed or shared) expert")
    n_group: int = field(1, positive, doc="group-limited routing: the experts form n_group groups ...")
    topk_group: int = field(1, positive, doc="... and only the best topk_group groups are eligible")
    router: str = field("sigmoid", one_of(*ROUTERS), doc="the router, a name in moe/router.py's ROUTERS table "
                                                         f"({', '.join(ROUTERS)})")
    router_group_score: str = field("top2_sum", one_of(*GROUP_SCORES),
                                    doc="a group's score: top2_sum, the sum of its two best (score + bias) "
                                        "(DeepSeek-V3) | max, its best (DeepSeek-V2's group_limited_greedy)")
    routed_scaling_factor: float = field(1.0, positive, doc="the gates are multiplied by it")
    norm_topk_prob: bool = field(True, doc="the chosen experts' gates are normalized to sum 1 (before the "
                                           "scaling factor; routers sigmoid and softmax, the others fix it)")
    expert_act: str = field("swiglu", one_of("swiglu", "clamped_swiglu"),
                            doc="the routed experts' activation: swiglu | clamped_swiglu (gpt-oss: (clamp(up, "
                                "+-limit) + 1) * g sigmoid(alpha g), g = min(gate, limit), gate / up with biases)")
    swiglu_limit: float = field(7.0, positive, doc="clamped_swiglu's limit")
    swiglu_alpha: float = field(1.702, positive, doc="clamped_swiglu's alpha")
    expert_bias: bool = field(False, doc="biases on the routed experts' gate, up and down projections (gpt-oss); the "
                                         "down bias is weighted by the gate. With it or clamped_swiglu the experts "
                                         "run the plain loop over experts (dispatch 'reference'), whatever "
                                         "execution.dispatch says")
    shared_d_ff: int = field(0, non_negative, doc="width of the shared-expert SwiGLU (0: moe_d_ff x "
                                                  "n_shared_experts)")
    shared_expert_gate: bool = field(False, doc="Qwen2-MoE / Qwen3-Next: the shared output scaled by "
                                                "sigmoid(u . w_gate), per token")
    # Router options of other families (moe/router.py, docs/routers.md); each default is DeepSeek-V3's behaviour.
    n_zero_experts: int = field(0, non_negative, doc="LongCat-Flash zero-computation experts: router candidates after "
                                                     "the routed ones whose output is their input x the gate (no "
                                                     "compute)")
    router_logit_bias: bool = field(False, doc="a trainable bias on the router logits (gpt-oss's router Linear bias): "
                                               "it enters scores and gates, unlike the selection-only routing bias")
    n_hash_layers: int = field(0, non_negative, doc="the leading MoE layers that route by token id (DeepSeek-V4's "
                                                    "hash layers: router 'hash', whatever model.router is)")
    layer_top_k: str = field("", doc="comma-separated top-k of each MoE layer of the main model, in order "
                                     "(Hunyuan's moe_topk list); '' = top_k in every layer (and the MTP blocks)")
    max_keys: int = field(0, non_negative, doc="the most keys one query may attend to (0: no limit); longer inputs "
                                               "are refused. DeepSeek-V3.2 / GLM-5's index_topk: up to it their "
                                               "sparse attention keeps every key and is this dense attention")
    mtp_depth: int = field(0, between(0, MAX_LAYERS), doc="multi-token prediction modules (DeepSeek-V3, moe/mtp.py): module k "
                                                "predicts the token k + 1 ahead; training only")
    init_std: float = field(0.02, positive, doc="std of the initial weights")

    def __post_init__(self):
        validate(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        """From a saved dict (checkpoint metadata, config.json). Fields that were once part of the model config
        but say how it runs (LEGACY_EXECUTION_FIELDS, now moe.Execution / the training loss) are ignored, and
        renamed fields (RENAMED_FIELDS) read under their name now, so checkpoints written earlier still load."""
        d = {RENAMED_FIELDS.get(k, k): v for k, v in d.items() if k not in LEGACY_EXECUTION_FIELDS}
        return cls(**d)

    @functools.cached_property
    def moe_layer_ids(self) -> tuple[int, ...]:
        """Indices of the MoE layers, in order (the layer axis of expert_load and of the routing biases)."""
        return tuple(i for i in range(self.n_layers) if self.is_moe_layer(i))

    @property
    def n_moe_layers(self) -> int:
        return len(self.moe_layer_ids)

    @functools.cached_property
    def mtp_moe_layer_ids(self) -> tuple[int, ...]:
        """Layer indices of the MoE blocks of the MTP modules (module k is layer n_layers + k - 1)."""
        return tuple(i for i in range(self.n_layers, self.n_layers + self.mtp_depth) if self.is_moe_layer(i))

    @property
    def train_load_layer_ids(self) -> tuple[int, ...]:
        """The rows of the train step's expert load and routing biases: the MoE layers, then the MTP modules'."""
        return self.moe_layer_ids + self.mtp_moe_layer_ids

    @functools.cached_property
    def sliding_layer_ids(self) -> tuple[int, ...]:
        return _layer_ids(self.sliding_layers)

    @functools.cached_property
    def nope_layer_ids(self) -> tuple[int, ...]:
        return _layer_ids(self.nope_layers)

    def uses_rope(self, layer: int | None) -> bool:
        """Layer `layer` rotates q and k (None: the model's default)."""
        return self.rope and layer not in self.nope_layer_ids

    @functools.cached_property
    def linear_layer_ids(self) -> tuple[int, ...]:
        """The layers whose token mixer is Gated DeltaNet (moe/gdn.py)."""
        return _layer_ids(self.linear_layers)

    @functools.cached_property
    def dense_layer_ids(self) -> tuple[int, ...]:
        return _layer_ids(self.dense_layers)

    def is_moe_layer(self, i: int) -> bool:
        return (i >= self.first_k_dense and (i + 1) % self.moe_layer_step == 0
                and i not in self.dense_layer_ids)

    @property
    def n_candidates(self) -> int:
        """Router outputs per MoE layer: the routed experts, then the zero experts."""
        return self.n_routed_experts + self.n_zero_experts

    @functools.cached_property
    def hash_layer_ids(self) -> tuple[int, ...]:
        """The MoE layers that route by token id: the first n_hash_layers of the main model (an MTP block does not,
        as in DeepSeek-V4, whose hash layers are the layer ids below num_hash_layers), or with router 'hash' every
        MoE layer, the MTP blocks' included (these route by the token at their position in the main sequence, t_i,
        which BlockInputs carries; not by t_{i+k}, the token their embedding reads)."""
        if self.router == "hash":
            return self.train_load_layer_ids
        return self.moe_layer_ids[:self.n_hash_layers]

    def layer_router(self, layer: int | None = None) -> str:
        """The ROUTERS entry of MoE layer `layer` (None: the model's router)."""
        return "hash" if layer is not None and layer in self._hash_layers else self.router

    @functools.cached_property
    def _hash_layers(self) -> frozenset[int]:
        return frozenset(self.hash_layer_ids)

    def moe_top_k(self, layer: int | None = None) -> int:
        """K of MoE layer `layer`: its layer_top_k entry; top_k for an MTP block or layer None."""
        return self._layer_top_k.get(layer, self.top_k)

    @functools.cached_property
    def _layer_top_k(self) -> dict[int, int]:
        return dict(zip(self.moe_layer_ids, _layer_ids(self.layer_top_k)))

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
    """Raise ConfigError naming the first bad field and what is allowed: each field's type and rules
    (plumbing.fields), then what ties fields together."""

    def fail(field, msg):
        raise ConfigError(f"model.{field}: {msg}")

    check_fields(c, "model")
    if c.first_k_dense > c.n_layers:
        fail("first_k_dense", f"must be <= n_layers ({c.n_layers}), got {c.first_k_dense}")
    gqa = c.attention != "mla"  # n_kv_heads and head_dim are grouped-query attention's
    if gqa and c.n_heads % c.n_kv_heads:
        fail("n_kv_heads", f"n_heads ({c.n_heads}) must be divisible by n_kv_heads ({c.n_kv_heads})")
    if gqa and c.head_dim % 2 and c.rope:
        fail("head_dim", f"must be even for RoPE, got {c.head_dim}")
    if gqa and c.rope and (c.rope_dim < 2 or c.rope_dim % 2):
        fail("rope_fraction", f"int(head_dim * rope_fraction) = {c.rope_dim} rotated dims must be even and >= 2")
    if c.qk_norm_after_rope and c.qk_norm == "none":
        fail("qk_norm_after_rope", "needs a q/k norm (model.qk_norm 'head' or 'full')")
    if c.qk_norm_after_rope and c.rope_interleave and c.qk_norm != "weightless":  # RoPE returns pairs permuted
        fail("qk_norm_after_rope", "with a scaled q/k norm is not implemented with model.rope_interleave")
    try:
        nope = _layer_ids(c.nope_layers)
    except ValueError:
        fail("nope_layers", f"must be comma-separated layer indices like '3,7', got {c.nope_layers!r}")
    if any(not 0 <= i < c.n_layers for i in nope) or (nope and c.attention == "mla"):
        fail("nope_layers", f"indices must lie in [0, n_layers) = [0, {c.n_layers}), with attention 'gqa'; got "
                            f"{c.nope_layers!r}")
    if nope and c.qk_norm in ("head", "full"):  # every layer's attention holds the same parameters
        fail("nope_layers", f"with a scaled q/k norm (model.qk_norm={c.qk_norm!r}) is not implemented; Llama 4's is "
                            "'weightless'")
    try:
        sliding = _layer_ids(c.sliding_layers)
    except ValueError:
        fail("sliding_layers", f"must be comma-separated layer indices like '0,2', got {c.sliding_layers!r}")
    if any(not 0 <= i < c.n_layers for i in sliding) or bool(sliding) != bool(c.sliding_window):
        fail("sliding_layers", f"indices in [0, {c.n_layers}), given together with model.sliding_window; got "
                               f"{c.sliding_layers!r} and {c.sliding_window}")
    if (c.attn_sinks or sliding) and c.attention == "mla":
        fail("attn_sinks" if c.attn_sinks else "sliding_layers", "is implemented for attention 'gqa' only")
    if (c.expert_bias or c.expert_act != "swiglu") and (c.n_zero_experts or ROUTERS[c.router].gate_at == "input"):
        fail("expert_bias" if c.expert_bias else "expert_act", "is implemented with gates on the expert output and "
                                                               "no zero experts")
    if c.mla_lora_scale and (c.attention != "mla" or not c.q_lora_rank):
        fail("mla_lora_scale", "needs attention 'mla' with a query latent (q_lora_rank > 0)")
    if c.dual_sublayers and (c.mtp_depth or c.first_k_dense or c.dense_layers or c.moe_layer_step != 1):
        fail("dual_sublayers", "every layer holds a MoE and no MTP module (LongCat-Flash)")
    if c.attention_chunk and c.attention == "mla":
        fail("attention_chunk", "is implemented for attention 'gqa' only")
    if c.query_scale_beta and (c.query_scale_period < 1 or (c.attention != "mla" and not c.nope_layer_ids)):
        fail("query_scale_beta", "needs model.query_scale_period >= 1, and attention 'mla' or model.nope_layers")
    _validate_mla(c, fail)
    _validate_yarn(c, fail)
    _validate_gdn(c, fail)
    if c.shared_expert_gate and not c.n_shared_experts:
        fail("shared_expert_gate", "needs a shared expert (n_shared_experts >= 1)")
    try:
        ids = _layer_ids(c.dense_layers)
    except ValueError:
        fail("dense_layers", f"must be comma-separated layer indices like '0,3', got {c.dense_layers!r}")
    if any(not 0 <= i < c.n_layers for i in ids):
        fail("dense_layers", f"indices must lie in [0, n_layers) = [0, {c.n_layers}), got {c.dense_layers!r}")
    if c.mtp_depth and c.mask != "causal":
        fail("mtp_depth", f"multi-token prediction needs mask 'causal' (a non-causal position would see the tokens "
                          f"it predicts), got mask {c.mask!r}; set model.mtp_depth=0 or model.mask='causal'")
    if c.mask == "mixed" and c.n_heads % 2:
        fail("n_heads", f"mask 'mixed' splits heads in two halves, so n_heads must be even, got {c.n_heads}")
    _validate_routing(c, fail)


def _validate_routing(c: ModelConfig, fail) -> None:
    E, what = c.n_candidates, "n_routed_experts" + (" + n_zero_experts" if c.n_zero_experts else "")
    if c.top_k > E:
        fail("top_k", f"must be <= {what} ({E}), got {c.top_k}")
    if E % c.n_group:
        fail("n_group", f"{what} ({E}) must be divisible by n_group ({c.n_group})")
    if c.n_group > 1 and E // c.n_group < 2 and c.router_group_score == "top2_sum":
        fail("n_group", "each group needs >= 2 experts (a group's score is the sum of its two best)")
    if c.topk_group > c.n_group:
        fail("topk_group", f"must be <= n_group ({c.n_group}), got {c.topk_group}")
    try:
        ks = _layer_ids(c.layer_top_k)
    except ValueError:
        fail("layer_top_k", f"must be comma-separated integers like '2,4', got {c.layer_top_k!r}")
    if ks and len(ks) != c.n_moe_layers:
        fail("layer_top_k", f"needs one K per MoE layer ({c.n_moe_layers}: layers {list(c.moe_layer_ids)}), got "
                            f"{c.layer_top_k!r}")
    if any(not 1 <= k <= E for k in ks):
        fail("layer_top_k", f"each K must lie in [1, {what}] = [1, {E}], got {c.layer_top_k!r}")
    if c.n_hash_layers > c.n_moe_layers:
        fail("n_hash_layers", f"must be <= the MoE layers of the main model ({c.n_moe_layers}), got "
                              f"{c.n_hash_layers}")
    learned = [c.moe_top_k(i) for i in c.moe_layer_ids + c.mtp_moe_layer_ids if c.layer_router(i) != "hash"]
    if c.n_group > 1 and learned and c.topk_group * (E // c.n_group) < max(learned):
        fail("topk_group", f"the {c.topk_group} eligible groups hold fewer than top_k ({max(learned)}) experts")


def _validate_mla(c: ModelConfig, fail) -> None:
    if c.attention == "gqa":
        for field in MLA_FIELDS + ("latent_norm_eps",):
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
    llama3 = {"rope_scaling": "yarn", "llama3_low_freq_factor": 1.0, "llama3_high_freq_factor": 4.0}
    if c.rope_scaling == "llama3":
        if c.rope_scaling_factor == 1 or c.attention == "mla" or not c.rope:
            fail("rope_scaling", "llama3 needs model.rope_scaling_factor > 1, model.rope and attention 'gqa'")
        for field, default in YARN_DEFAULTS.items():
            if field != "rope_original_max_position" and getattr(c, field) != default:
                fail(field, f"is a YaRN field; with model.rope_scaling='llama3' leave it at {default!r}")
        if c.rope_original_max_position <= 0 or c.llama3_high_freq_factor <= c.llama3_low_freq_factor:
            fail("llama3_high_freq_factor", "llama3 needs rope_original_max_position > 0 and high > low freq factor")
        return
    for field, default in llama3.items():
        if getattr(c, field) != default:
            fail(field, f"is a llama3 RoPE field; set model.rope_scaling='llama3' or leave it at {default!r}")
    if c.rope_scaling_factor == 1:
        for field, default in YARN_DEFAULTS.items():
            if getattr(c, field) != default:
                fail(field, f"is a YaRN field; set model.rope_scaling_factor > 1 or leave it at {default!r}")
        return
    if not c.rope:
        fail("rope_scaling_factor", "YaRN scales RoPE; it needs model.rope=true")
    if c.rope_original_max_position <= 0:
        fail("rope_original_max_position", "YaRN needs the context length the model was trained on (> 0)")
    if not c.yarn_beta_fast >= c.yarn_beta_slow > 0:  # equal betas: a step, no ramp (Kimi-K2 ships 1 and 1)
        fail("yarn_beta_fast", f"must be >= yarn_beta_slow, and both > 0; got {c.yarn_beta_fast} and "
                               f"{c.yarn_beta_slow}")


def _validate_gdn(c: ModelConfig, fail) -> None:
    if (c.attn_output_gate or c.norm_offset or c.linear_layers) and (c.attention == "mla" or c.dual_sublayers):
        fail("attn_output_gate" if c.attn_output_gate else "norm_offset" if c.norm_offset else "linear_layers",
             "is implemented for attention 'gqa' without dual_sublayers only")
    if c.norm_offset and c.mtp_depth:
        fail("norm_offset", "is not implemented with MTP modules (their norms are plain)")
    try:
        ids = _layer_ids(c.linear_layers)
    except ValueError:
        fail("linear_layers", f"must be comma-separated layer indices like '0,1,2', got {c.linear_layers!r}")
    if any(not 0 <= i < c.n_layers for i in ids):
        fail("linear_layers", f"indices must lie in [0, n_layers) = [0, {c.n_layers}), got {c.linear_layers!r}")
    if not ids:
        return
    if c.mask != "causal":
        fail("linear_layers", f"Gated DeltaNet is a left-to-right recurrence: it needs mask 'causal', got {c.mask!r}")
    for name in ("gdn_key_heads", "gdn_value_heads", "gdn_key_dim", "gdn_value_dim"):
        if getattr(c, name) <= 0:
            fail(name, f"Gated DeltaNet layers (model.linear_layers) need a positive {name}")
    if c.gdn_value_heads % c.gdn_key_heads:
        fail("gdn_value_heads", f"must be a multiple of gdn_key_heads ({c.gdn_key_heads}), got {c.gdn_value_heads}")
