"""Route the same tokens through a model, keeping per token and MoE layer the chosen experts and the routing
entropy (the only per-token quantities the comparison reads; scores never reach the host).

    rec = route_entropy(run.model, run.config, max_tokens=2048)    # collect.batches: same config, same tokens
    rec.batches[i]["ids"][layer]        # [B, L, K] int16, the bias-steered choice (the experts that run)
    rec.batches[i]["entropy"][layer]    # [B, L] bits of p_i = s_i / sum_j s_j over every router candidate

Routing entropy is of the router's distribution over candidates, p = s / sum(s) (the softmax for a softmax
router, the normalized sigmoid affinities for DeepSeek-V3's): log2(E) for a router that prefers no expert.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from analysis.routing import collect


@dataclasses.dataclass
class EntropyRecord:
    """Every batch of one routing pass on the host: tokens / domains / valid [B,L], per MoE layer ids [B,L,K]
    and entropy [B,L]."""

    batches: list
    domain_names: list
    n_experts: int  # router candidates
    top_k: int


def entropy_bits(scores_xE):
    """H(s / sum s) in bits over the last axis, fp32 (0 log 0 = 0)."""
    s = scores_xE.astype(jnp.float32)
    p = s / jnp.maximum(s.sum(-1, keepdims=True), 1e-30)
    return -jnp.where(p > 0, p * jnp.log2(jnp.where(p > 0, p, 1.0)), 0.0).sum(-1)


def make_route_fn(graphdef, prefix: bool):
    """jit(state, tokens, positions, segment_ids, prefix_len) -> per MoE layer (expert_ids [B,L,K], entropy
    [B,L])."""

    @jax.jit
    def route(state, tokens_BxL, positions_BxL, segment_ids_BxL, prefix_len_B):
        model = nnx.merge(graphdef, state)
        _, aux = model.inspect(tokens_BxL, positions_BxL=positions_BxL, segment_ids_BxL=segment_ids_BxL,
                               prefix_len_B=prefix_len_B if prefix else None)
        return [(r.expert_ids, entropy_bits(r.scores)) for r in aux.routing]

    return route


def route_entropy(model, config, split=None, max_tokens=None, batch_size=None) -> EntropyRecord:
    """Routes every domain of `split` (default the config's eval split) through `model`: the same batches for
    any model given the same config (collect.batches)."""
    batch_size = batch_size or config.eval.batch_size
    it, names = collect.batches(config, split, max_tokens, batch_size)
    return route_batches(model, it, names, config.data.task == "prefix")


def route_batches(model, batches, domain_names, prefix: bool = False) -> EntropyRecord:
    """Routes the given batches (tokens, positions, segment_ids, domains, valid [B, L]; analysis.hf_rows'
    routing_batches for a HF directory)."""
    graphdef, state = nnx.split(model)
    route = make_route_fn(graphdef, prefix)
    kept = []
    for batch in batches:
        layers = jax.device_get(route(state, *collect.route_args(batch, len(batch["tokens"]))))
        kept.append({"tokens": batch["tokens"], "domains": batch["domains"], "valid": batch["valid"],
                     "ids": [np.asarray(ids, np.int16) for ids, _ in layers],
                     "entropy": [np.asarray(h, np.float32) for _, h in layers]})
    return EntropyRecord(kept, list(domain_names), model.cfg.n_candidates, model.cfg.top_k)


def flat(record: EntropyRecord, key: str, layer: int) -> np.ndarray:
    """The valid tokens' values of one MoE layer, batches concatenated: ids [N,K] or entropy [N]."""
    return np.concatenate([b[key][layer][b["valid"]] for b in record.batches])


def flat_domains(record: EntropyRecord) -> np.ndarray:
    """Domain id [N] of each valid token, in `flat`'s order."""
    return np.concatenate([b["domains"][b["valid"]] for b in record.batches]).astype(np.int64)
