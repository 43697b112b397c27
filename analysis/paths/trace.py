"""Route the tokens and measure the paths between every pair of consecutive MoE layers.

    result = expert_paths(run.model, run.config, max_tokens=2048)
    result["pairs"]["layer 1 -> layer 2"]["mi_topk"], ["nulls"]["same token id"]["topk"]
"""

import numpy as np

from analysis import hf_rows
from analysis.compare.record import route_batches
from analysis.paths import transitions
from analysis.specialization.baselines import route_record
from plumbing.errors import UserError


def flat_record(record):
    """(tokens [N], ids per MoE layer [N, K]) of the record's valid tokens."""
    tokens_N = np.concatenate([b["tokens"][b["valid"]] for b in record.batches])
    n_layers = len(record.batches[0]["ids"])
    ids_LxNxK = [np.concatenate([b["ids"][i][b["valid"]] for b in record.batches]) for i in range(n_layers)]
    return tokens_N, ids_LxNxK


def paths_of(tokens_N, ids_LxNxK, layer_ids, n_experts: int, n_shuffles: int = 20, seed: int = 0) -> dict:
    """transitions.path_information for each pair of consecutive MoE layers, keyed "layer l -> layer m"."""
    rng = np.random.default_rng(seed)
    pairs = {}
    for i in range(len(layer_ids) - 1):
        r = transitions.path_information(ids_LxNxK[i], ids_LxNxK[i + 1], tokens_N, n_experts, rng, n_shuffles)
        r["top_paths"] = transitions.top_paths(r["pairs_topk"])
        pairs[f"layer {layer_ids[i]} -> layer {layer_ids[i + 1]}"] = r
    return pairs


def expert_paths(model, config, split=None, max_tokens=2048, batch_size=None, n_shuffles: int = 20,
                 seed: int = 0, routing_rows=None) -> dict:
    """Routes `split` (default the eval split; collect.batches) and measures every consecutive pair of MoE layers;
    `routing_rows` (analysis.hf_rows.Rows, a HF directory's) are routed instead when given. UserError for a model
    with fewer than two MoE layers (no path to follow)."""
    layer_ids = list(model.cfg.moe_layer_ids)
    if len(layer_ids) < 2:
        raise UserError(f"this model has {len(layer_ids)} MoE layer(s) ({layer_ids}); expert paths need at least two")
    if routing_rows is None:
        record = route_record(model, config, split, max_tokens, batch_size)
    else:
        record = route_batches(model, hf_rows.routing_batches(routing_rows), routing_rows.domain_names)
    tokens_N, ids = flat_record(record) if record.batches else (np.zeros(0, np.int64), [])
    if not len(tokens_N):
        raise UserError(f"no tokens to analyse in split {split or config.data.eval_split!r}; check --split")
    n_experts = model.cfg.n_candidates
    return {"layer_ids": layer_ids, "n_experts": n_experts, "top_k": model.cfg.top_k, "n_tokens": len(tokens_N),
            "shuffles": n_shuffles, "pairs": paths_of(tokens_N, ids, layer_ids, n_experts, n_shuffles, seed)}
