"""Two models on the same tokens, every comparison at once (what `python -m analysis.compare` writes).

    result = compare_pair(run_a.model, run_b.model, run_a.config, run_a.tokenizer, max_tokens=2048)
    result["layers"]["layer 1"]["jaccard"], ["load_matched_chance"], ["entropy_change_D"]
    result["swap_b_into_a"]["delta_A"]     # A's experts with B's routers (and swap_a_into_b the other way)

The tokens are `config`'s split (A's data; collect.batches), routed by each model; the gate swap scores
`config`'s validation rows. Shape key as in overlap.py.
"""

import numpy as np

from analysis import hf_rows
from analysis.compare import overlap, record, swap
from plumbing.errors import UserError


def check_comparable(model_a, model_b) -> None:
    """UserError unless both route into the same experts: the same MoE layers, candidates and top-k."""
    ca, cb = model_a.cfg, model_b.cfg
    for name in ("moe_layer_ids", "n_candidates", "top_k"):
        if getattr(ca, name) != getattr(cb, name):
            raise UserError(f"the two models differ in {name} ({getattr(ca, name)} vs {getattr(cb, name)}); "
                            "expert sets can only be compared between models of one architecture")


def compare_pair(model_a, model_b, config, tokenizer, split=None, max_tokens=2048, batch_size=None,
                 shuffles: int = 20, rows_per_domain=None, gate_swap: bool = True, seed: int = 0, log=None,
                 rows=None, routing_rows=None) -> dict:
    """Per MoE layer overlap.compare_layer of A and B on the same tokens, and (gate_swap) the swap both ways.
    A HF directory has no run data: `routing_rows` (analysis.hf_rows.Rows) are then the routed tokens and `rows`
    the gate swap's."""
    check_comparable(model_a, model_b)
    if routing_rows is None:
        rec_a = record.route_entropy(model_a, config, split, max_tokens, batch_size)
        rec_b = record.route_entropy(model_b, config, split, max_tokens, batch_size)
    else:
        batches = hf_rows.routing_batches(routing_rows)
        rec_a, rec_b = (record.route_batches(m, batches, routing_rows.domain_names) for m in (model_a, model_b))
    if not rec_a.batches or not sum(int(b["valid"].sum()) for b in rec_a.batches):
        raise UserError(f"no tokens to analyse in split {split or config.data.eval_split!r}; check --split")
    domains_N = record.flat_domains(rec_a)
    rng = np.random.default_rng(seed)
    layer_ids = list(model_a.cfg.moe_layer_ids)
    layers = {}
    for i, layer in enumerate(layer_ids):
        layers[f"layer {layer}"] = overlap.compare_layer(
            record.flat(rec_a, "ids", i), record.flat(rec_b, "ids", i), record.flat(rec_a, "entropy", i),
            record.flat(rec_b, "entropy", i), domains_N, len(rec_a.domain_names), rec_a.n_experts, rng, shuffles)
    out = {"layer_ids": layer_ids, "domain_names": rec_a.domain_names, "n_tokens": len(domains_N),
           "n_tokens_D": np.bincount(domains_N, minlength=len(rec_a.domain_names)), "n_experts": rec_a.n_experts,
           "top_k": rec_a.top_k, "shuffles": shuffles, "layers": layers}
    if gate_swap:
        rows = rows or hf_rows.run_rows(config, rows_per_domain)
        for key, into, other in (("swap_b_into_a", model_a, model_b), ("swap_a_into_b", model_b, model_a)):
            out[key] = swap.gate_swap(into, other, config, tokenizer, seed=seed, log=log,
                                      scorer=hf_rows.RowsScorer(into, rows, tokenizer))
    return out
