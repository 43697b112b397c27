"""What a specialization metric would read without specialization: two nulls (permutations of the trained
routing) and the untrained router.

    record = route_record(run.model, run.config, max_tokens=4096)   # every analysed token's top-k, per layer
    trained = headline(accumulate(record))                         # {metric: value per MoE layer}
    chance = headline(accumulate(record, rng=np.random.default_rng(0)))   # one load-matched random router
    null = headline(accumulate(record, rng=np.random.default_rng(0), within_tokens=True))   # token-identity null
    model, source = untrained(run)                                 # step-0 checkpoint, or the initialization
    step0 = headline(accumulate(route_record(model, run.config, max_tokens=4096)))

Load-matched null (the random router with the same load): each layer's top-k sets (ids with their gates)
permuted across every analysed token. Each expert keeps exactly its load (MaxVio and dead experts unchanged)
and each set of experts its frequency (co-activation unchanged), but which token, domain or neighbour gets
which set is now chance. What a metric still reads under it is what the load imbalance and the finite sample
produce alone: a domain's favourite expert gets at least the busiest expert's load, and a token seen ten
times has a favourite expert by luck.

Token-identity null: the sets permuted among the occurrences of the same token id only. Each token keeps its
distribution over experts (vocabulary specialization and the load are unchanged by construction), and each
domain its token frequencies; what routing carries beyond the token id (context, position, domain) is gone.
A metric above this null is specialization the token ids do not explain; a router that is a function of the
token id reads exactly its null (tests/test_routing_nulls.py).

Step 0 (`analysis.routing.step0.untrained`): the run's step-0 checkpoint if it has one, else the model
training started from, rebuilt with the trainer's initializer and the run's seed (the trainer saves no step-0
checkpoint). It answers a different question: how much of the structure (e.g. routing by token identity, which
a random router embedding already gives) is there before any training.

Shape key: L MoE layers, E experts, K top-k, D domains, N analysed tokens.
"""

import dataclasses

import jax
import numpy as np
from flax import nnx

from analysis.routing import collect
from analysis.routing.stats import RoutingAccumulator
from analysis.routing.step0 import init_model, untrained

__all__ = ["HEADLINE", "RoutingRecord", "accumulate", "headline", "init_model", "random_router", "route_record",
           "token_null", "untrained"]

# name -> what it measures (the plots' panel titles and the docs use these words).
HEADLINE = {
    "top1_max_share": "share of a domain's tokens whose first choice is its favourite expert (mean over domains)",
    "domain_mi_bits": "mutual information I(domain; first-choice expert), bits",
    "vocab_spec": "vocabulary specialization (OLMoE; tokens seen >= 10 times; 1/E uniform .. 1/K always chosen)",
    "loc_first": "same first choice as the previous token (Mixtral locality)",
    "maxvio": "MaxVio on the analysed tokens (load imbalance)",
}


@dataclasses.dataclass
class RoutingRecord:
    """Every batch of one routing pass, kept on the host: per batch tokens/domains/valid/segment_ids [B,L] and
    per MoE layer ids [B,L,K] (int16) and gates [B,L,K] (float32)."""

    batches: list
    domain_names: list
    n_experts: int
    top_k: int
    vocab_size: int


def route_record(model, config, split=None, max_tokens=None, batch_size=None) -> RoutingRecord:
    """Routes every domain of `split` (collect.batches: the same tokens for any model of this config)."""
    batch_size = batch_size or config.eval.batch_size
    it, names = collect.batches(config, split, max_tokens, batch_size)
    graphdef, state = nnx.split(model)
    route = collect.make_route_fn(graphdef, config.data.task == "prefix")
    kept = []
    for batch in it:
        layers = jax.device_get(route(state, *collect.route_args(batch, batch_size)))
        kept.append({"tokens": batch["tokens"], "domains": batch["domains"], "valid": batch["valid"],
                     "segment_ids": batch["segment_ids"],
                     "ids": [np.asarray(ids, np.int16) for ids, _ in layers],
                     "gates": [np.asarray(g, np.float32) for _, g in layers]})
    cfg = model.cfg
    return RoutingRecord(kept, names, cfg.n_routed_experts, cfg.top_k, cfg.vocab_size)


def _permuted(record: RoutingRecord, rng, within_tokens=False):
    """Per layer, the valid tokens' (ids, gates) rows in a random order, cut back into the batches' slots; with
    within_tokens, each row moves only among the occurrences of its own token id."""
    n_layers = len(record.batches[0]["ids"]) if record.batches else 0
    out = [{"ids": [], "gates": []} for _ in record.batches]
    tok_N = np.concatenate([b["tokens"][b["valid"]] for b in record.batches]) if record.batches else np.zeros(0)
    for layer in range(n_layers):
        ids_NxK = np.concatenate([b["ids"][layer][b["valid"]] for b in record.batches])
        gates_NxK = np.concatenate([b["gates"][layer][b["valid"]] for b in record.batches])
        perm_N = _within(tok_N, rng) if within_tokens else rng.permutation(len(ids_NxK))
        ids_NxK, gates_NxK, start = ids_NxK[perm_N], gates_NxK[perm_N], 0
        for b, o in zip(record.batches, out):
            n = int(b["valid"].sum())
            ids, gates = b["ids"][layer].copy(), b["gates"][layer].copy()
            ids[b["valid"]], gates[b["valid"]] = ids_NxK[start:start + n], gates_NxK[start:start + n]
            o["ids"].append(ids)
            o["gates"].append(gates)
            start += n
    return out


def _within(tok_N, rng):
    """A permutation of 0..N-1 that maps every position to a random position holding the same token id: the
    positions sorted by id (stably) receive the same id's positions in a random order."""
    by_id_N = np.argsort(tok_N, kind="stable")
    shuffled_N = np.lexsort((rng.random(len(tok_N)), tok_N))
    perm_N = np.empty(len(tok_N), np.int64)
    perm_N[by_id_N] = shuffled_N
    return perm_N


def accumulate(record: RoutingRecord, rng=None, within_tokens=False, **acc_kwargs) -> dict:
    """RoutingAccumulator.finalize() over the record; with `rng`, of a null: the load-matched random router, or
    with within_tokens the token-identity null."""
    routed = _permuted(record, rng, within_tokens) if rng is not None else record.batches
    n_layers = len(record.batches[0]["ids"]) if record.batches else 0
    acc = RoutingAccumulator(n_layers, record.n_experts, record.top_k, len(record.domain_names),
                             record.vocab_size, **acc_kwargs)
    for b, r in zip(record.batches, routed):
        acc.update([{"expert_ids": i, "gates": g} for i, g in zip(r["ids"], r["gates"])],
                   b["tokens"], b["domains"], b["valid"], b["segment_ids"])
    return acc.finalize()


def mutual_information_bits(counts_DxE):
    """I(D; E) in bits of the joint count table (0: the expert distribution is the same in every domain)."""
    p_DxE = np.asarray(counts_DxE, np.float64)
    total = p_DxE.sum()
    if total == 0:
        return float("nan")
    p_DxE = p_DxE / total
    outer_DxE = p_DxE.sum(1, keepdims=True) * p_DxE.sum(0, keepdims=True)
    nz = p_DxE > 0
    return float((p_DxE[nz] * np.log2(p_DxE[nz] / outer_DxE[nz])).sum())


def shuffled_locality_first(first_counts_E):
    """P[two consecutive tokens share their first choice] under the permutation: two distinct tokens drawn
    without replacement from first-choice counts c_e: sum_e c_e (c_e - 1) / (N (N - 1))."""
    c_E = np.asarray(first_counts_E, np.float64)
    n = c_E.sum()
    return float((c_E * (c_E - 1)).sum() / (n * (n - 1))) if n > 1 else float("nan")


def headline(result) -> dict:
    """The HEADLINE metrics of one finalize() result, each an array over MoE layers."""
    share_LxDxE = result["share_top1_LxDxE"]
    has_tokens_D = np.asarray(result["n_tokens_D"]) > 0
    out = {
        "top1_max_share": np.nanmax(share_LxDxE[:, has_tokens_D], -1).mean(-1),
        "domain_mi_bits": np.array([mutual_information_bits(c) for c in result["first_LxDxE"]]),
        "loc_first": np.asarray(result["loc_first_L"], np.float64),
        "maxvio": np.asarray(result["maxvio_L"], np.float64),
    }
    if "vocab_spec_L" in result:
        out["vocab_spec"] = np.asarray(result["vocab_spec_L"], np.float64)
    return {k: out[k] for k in HEADLINE if k in out}


def random_router(record: RoutingRecord, n_shuffles=20, seed=0, within_tokens=False) -> dict:
    """{metric: [n_shuffles, L]} of `headline` under n_shuffles independent permutations: the load-matched null,
    or with within_tokens the token-identity null."""
    rng = np.random.default_rng(seed)
    runs = [headline(accumulate(record, rng=rng, within_tokens=within_tokens)) for _ in range(n_shuffles)]
    return {k: np.stack([r[k] for r in runs]) for k in runs[0]} if runs else {}


def token_null(record: RoutingRecord, n_shuffles=20, seed=0) -> dict:
    """{metric: [n_shuffles, L]} of `headline` under n_shuffles permutations within each token id's occurrences."""
    return random_router(record, n_shuffles, seed, within_tokens=True)
