"""DeepSeek-V3.2 (`deepseek_v32`) and GLM-5 (`glm_moe_dsa`): DeepSeek-V3's MLA and MoE plus DeepSeek Sparse
Attention, whose lightning indexer keeps the index_topk best keys of each query. A query that sees at most
index_topk keys keeps every one of them, and the model is then exactly dense MLA (transformers' V3.2 with index_topk
>= the length gives the logits of DeepseekV3 on the same weights): imported as deepseek_v3 / glm4_moe_lite's MLA
with model.max_keys = index_topk, which refuses longer inputs (and longer KV caches) in one line until an indexer
exists. The indexer's tensors (`self_attn.indexer.*`) are skipped, not read: up to index_topk keys they change
nothing.

As transformers 5.25 computes them: MLA RoPE always on interleaved pairs (a rope_interleave false is refused), a
query latent always (q_lora_rank required), dense layers where mlp_layer_types says "dense" (default: the first
first_k_dense_replace), eps 1e-6 on the latent norms, YaRN with DeepSeek's softmax-scale correction (V3.2's Hub
config) or plain RoPE (GLM-5). Missing fields take DeepseekV32Config's / GlmMoeDsaConfig's defaults (DEFAULTS). MTP
layers become our MTP modules as DeepSeek-V3's do.
"""

import dataclasses

from moe.config import ModelConfig
from moe.hf import deepseek
from moe.hf.common import field, refuse
from moe.hf.weights import Layout

MODEL_TYPES = ("deepseek_v32", "glm_moe_dsa")
# transformers' class defaults for the fields that change the math
DEFAULTS = {
    "deepseek_v32": dict(first_k_dense_replace=3, n_shared_experts=1, routed_scaling_factor=2.5, n_group=8,
                         topk_group=4, norm_topk_prob=True, index_topk=2048),
    "glm_moe_dsa": dict(first_k_dense_replace=3, n_shared_experts=1, routed_scaling_factor=2.5, n_group=1,
                        topk_group=1, norm_topk_prob=True, index_topk=2048),
}
# What only the indexer reads (the sparse selection); the rest is DeepSeek-V3's MLA and MoE.
INDEXER_ONLY = ("index_topk", "index_n_heads", "index_head_dim", "indexer_types", "index_topk_pattern",
                "indexer_rope_interleave", "layer_types")


def model_config(c: dict, where: str) -> ModelConfig:
    kind, d = c["model_type"], DEFAULTS[c["model_type"]]
    top = int(field(c, "index_topk", default=d["index_topk"]))
    if top < 1:
        refuse(where, "index_topk", top, "the indexer keeps at least one key per query")
    if not c.get("q_lora_rank"):
        refuse(where, "q_lora_rank", c.get("q_lora_rank"), f"transformers' {kind} always has a query latent")
    if c.get("rope_interleave") is False:
        refuse(where, "rope_interleave", False, f"transformers' {kind} always rotates interleaved pairs")
    n = c["num_hidden_layers"]
    k = int(field(c, "first_k_dense_replace", default=d["first_k_dense_replace"]))
    types = c.get("mlp_layer_types") or ["dense"] * min(k, n) + ["sparse"] * (n - min(k, n))
    # The MLA and MoE as glm4_moe_lite's: mlp_layer_types decides the dense layers, head_dim is the rope dims.
    mla = {name: v for name, v in c.items() if name not in INDEXER_ONLY + ("head_dim", "first_k_dense_replace")}
    mla.update({name: field(c, name, default=v) for name, v in d.items() if name not in ("index_topk",
                                                                                         "first_k_dense_replace")})
    mla.update(model_type="glm4_moe_lite", rope_interleave=True, mlp_layer_types=types)
    return dataclasses.replace(deepseek.model_config(mla, where), max_keys=top)


def layout(c: dict) -> Layout:
    base = deepseek.layout(dict(c, model_type="deepseek_v3"))
    n = c["num_hidden_layers"] + field(c, "num_nextn_predict_layers", "num_mtp_layers", default=0)
    return dataclasses.replace(base, ignored=tuple(f"model.layers.{i}.self_attn.indexer." for i in range(n)))
