"""Routing computed elsewhere, counted as `collect.analyse` counts it: the layer-streamed analysis (streamed.py)
and the analysis on a device mesh (sharded.py) route the same batches as `collect.analyse` and hand each batch's
routing here, which fills the same accumulators in the same order and returns the same `collect.Analysis`
(tests/test_routing_streamed.py: equal outputs)."""

import numpy as np

from analysis.routing import collect
from analysis.routing.stats import RoutingAccumulator


def rows(run, split, max_tokens, cache, n_samples):
    """(the batches collect.analyse routes, as a list; the domain names): the run's eval batch size and seq_len."""
    config = run.config
    plans, domain_names = collect.domain_rows(config, split, max_tokens, cache)
    return (list(collect._batches(plans, config.eval.batch_size, config.data.seq_len, max_tokens, n_samples)),
            domain_names)


def accumulate(run, batches, domain_names, routing_of, tokens=collect.DEFAULT_TOKENS, n_samples=2, sample_len=160,
               n_frequent=20, seconds=0.0) -> collect.Analysis:
    """collect.Analysis of `batches` (from `rows`), routing_of(b) giving batch b's routing: per MoE layer, in order,
    (expert_ids [B, L, K], gates [B, L, K]) as NumPy."""
    mcfg = run.model.cfg
    track_ids, notes = collect.resolve_tokens(run.tokenizer, tokens)
    acc = RoutingAccumulator(len(run.moe_layer_ids), mcfg.n_routed_experts, n_domains=len(domain_names),
                             vocab_size=mcfg.vocab_size, track_tokens=track_ids, n_frequent=n_frequent,
                             **collect.layer_routing(mcfg, run.moe_layer_ids))
    samples = []
    for b, batch in enumerate(batches):
        layers = [{"expert_ids": ids, "gates": gates} for ids, gates in routing_of(b)]
        acc.update(layers, batch["tokens"], batch["domains"], batch["valid"], batch["segment_ids"])
        for row in np.flatnonzero(batch["sample_row"]):
            keep = batch["valid"][row][:sample_len]
            ids = batch["tokens"][row][:sample_len][keep]
            first_LxN = [layer["expert_ids"][row, :sample_len, 0][keep].tolist() for layer in layers]
            samples.append((domain_names[int(batch["domains"][row, 0])],
                            [run.tokenizer.decode([int(i)]) for i in ids], first_LxN))
    result = acc.finalize()
    result["layer_ids_L"] = np.asarray(run.moe_layer_ids)
    shown = {int(i) for i in result["track_ids_T"]} | {int(i) for i in result.get("freq_ids_N", [])}
    token_text = {i: run.tokenizer.decode([i]) for i in sorted(shown)}
    return collect.Analysis(result, domain_names, token_text, samples, notes, None, int(result["n_tokens"]), seconds)
