"""Routing statistics for MoE layers: a streaming accumulator plus pure metric functions (numpy only).

Shape key: L MoE layers, E routed experts, K top-k, D domains, V vocabulary, T tracked tokens, N tokens, Z zero
experts.

Zero experts (LongCat-Flash: router candidates E .. E+Z-1 that return their input) are counted apart: every table
indexed by expert holds the E routed experts, and `zero_*` keys hold the zero experts' share and load. A layer's K
may differ (per-layer top-k); a layer routed by token id (DeepSeek-V4's hash layers) is marked in `hash_routed_L`:
its shares are the fixed hash table's, not a learned routing.

Usage (the CLI runs the model batch by batch and feeds each batch's routing extras):
    acc = RoutingAccumulator(n_layers, n_experts, top_k, n_domains, vocab_size, track_tokens=[13, 262])
    for batch in batches:
        acc.update(routing_per_layer, tokens_BxL, domains_BxL, valid_BxL, segment_ids_BxL)
    result = acc.finalize()            # dict of numpy arrays: np.savez(path, **result)
    json.dump(to_jsonable(result), f)  # small arrays only, NaN -> null
Only counts are kept, never activations; memory is dominated by the two L*V*E int32 token tables (top-k and
first choice; disable with track_vocab=False, which drops vocabulary specialization, the frequent-token table and
the token-identity null).

Locality is reported beside three chance levels, all exact (no sampling): the uniform router (1/E, ...), the
load-matched null (every analysed token's top-k set dealt at random to the analysed positions: each expert keeps
its load) and the token-identity null (the sets dealt at random among the occurrences of the same token id: token
identity kept, everything beyond it destroyed). Both nulls are expectations over the permutation, computed from
count tables: `load_matched_locality`, `token_null_locality`.
"""

import math
import re

import numpy as np

from analysis.routing.nulls import PairCounts, grown, load_matched_locality, token_null_locality
from moe import router
from rundir.metrics import read_rows


def locality_baseline(n_experts, top_k):
    """Random-router expectations: (P[same first choice] = 1/E,
    P[two independent top-k sets overlap] = 1 - C(E-K, K) / C(E, K), E[|A & B|] / K = K/E)."""
    any_overlap = 1.0 - math.comb(n_experts - top_k, top_k) / math.comb(n_experts, top_k)
    return 1.0 / n_experts, any_overlap, top_k / n_experts


def domain_share(counts_LxDxE, n_tokens_D):
    """share[l, d, e] = #tokens of domain d with expert e in their top-k / #tokens of domain d.

    Counting every top-k choice, a row sums to K and the uniform value is K/E. Pass top-1 counts to get the
    OLMoE k=1 specialization (sums to 1), or divide by K for the per-k normalized version (sums to 1,
    uniform 1/E). Domains with no tokens give NaN."""
    n_1xDx1 = np.asarray(n_tokens_D, np.float64)[None, :, None]
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(n_1xDx1 > 0, counts_LxDxE / np.maximum(n_1xDx1, 1), np.nan)


def dead_experts(counts_LxE):
    """Per layer, the sorted list of experts that received zero assignments."""
    return [np.flatnonzero(np.asarray(c) == 0).tolist() for c in counts_LxE]


def coactivation(pairs_LxExE, counts_LxE):
    """coact[l, i, j] = N(e_i, e_j) / N(e_i): among tokens that chose e_i (anywhere in their top-k), the share
    that also chose e_j. N counts all ordered pairs of distinct experts in each token's top-k, so rows sum to
    K-1 (the diagonal is 0); rows of unused experts are 0."""
    n_LxEx1 = np.asarray(counts_LxE, np.float64)[..., None]
    return np.asarray(pairs_LxExE, np.float64) / np.maximum(n_LxEx1, 1)


def vocab_specialization(tok_counts_LxVxE, tok_n_V, top_k, min_count=10):
    """OLMoE vocabulary specialization over top-k assignments (top_k: one K, or one per layer).

    For a token id v seen n_v >= min_count times: spec[l, v] = max_e count[l, v, e] / (K * n_v), the share of
    its K * n_v assignments that go to its most frequent expert (1/K = in every top-k, uniform = 1/E).
    Returns (spec_LxE, mean_L, n_eligible): spec_LxE[l, e] is the mean spec over eligible tokens whose most
    frequent expert is e (NaN if none); mean_L is the unweighted mean over eligible tokens."""
    eligible_V = np.asarray(tok_n_V) >= min_count
    n_elig = int(eligible_V.sum())
    n_layers, _, n_experts = tok_counts_LxVxE.shape
    spec_LxE = np.full((n_layers, n_experts), np.nan)
    mean_L = np.full(n_layers, np.nan)
    if n_elig == 0:
        return spec_LxE, mean_L, 0
    counts_LxVxE = tok_counts_LxVxE[:, eligible_V]
    k_Lx1 = np.broadcast_to(np.asarray(top_k, np.float64), (n_layers,))[:, None]
    spec_LxV = counts_LxVxE.max(-1) / (k_Lx1 * np.asarray(tok_n_V)[eligible_V][None])
    best_LxV = counts_LxVxE.argmax(-1)
    for layer in range(n_layers):
        n_E = np.bincount(best_LxV[layer], minlength=n_experts)
        sum_E = np.bincount(best_LxV[layer], weights=spec_LxV[layer], minlength=n_experts)
        with np.errstate(invalid="ignore"):
            spec_LxE[layer] = np.where(n_E > 0, sum_E / np.maximum(n_E, 1), np.nan)
    mean_L[:] = spec_LxV.mean(-1)
    return spec_LxE, mean_L, n_elig


def favourite_agreement(counts_a_LxVxE, counts_b_LxVxE, tok_n_V, min_count=10):
    """Do two routers (e.g. trained and step 0) send a token to the same favourite expert?

    For every token id seen >= min_count times, its favourite expert under each router (most top-k assignments;
    ties to the lowest id). Returns (agree_L, chance_L, n_eligible): the share of eligible ids whose favourites
    agree, and the share expected if the two favourites were independent with the same marginals
    (sum_e p_a(e) p_b(e) over the ids' favourites; 1/E when both spread evenly). Agreement at chance means the
    token -> expert mapping was re-learned, whatever the degree of vocabulary specialization."""
    eligible_V = np.asarray(tok_n_V) >= min_count
    n_layers, _, n_experts = counts_a_LxVxE.shape
    n_elig = int(eligible_V.sum())
    if n_elig == 0:
        return np.full(n_layers, np.nan), np.full(n_layers, np.nan), 0
    fav_a_LxV = np.asarray(counts_a_LxVxE)[:, eligible_V].argmax(-1)
    fav_b_LxV = np.asarray(counts_b_LxVxE)[:, eligible_V].argmax(-1)
    agree_L = (fav_a_LxV == fav_b_LxV).mean(-1)
    chance_L = np.array([np.bincount(fav_a_LxV[layer], minlength=n_experts) @
                         np.bincount(fav_b_LxV[layer], minlength=n_experts) / n_elig ** 2
                         for layer in range(n_layers)])
    return agree_L, chance_L, n_elig


def saturation(early_ids_NxK, final_ids_NxK):
    """OLMoE router saturation for one layer: mean over tokens of |topk_early & topk_final| / K."""
    early, final = np.asarray(early_ids_NxK), np.asarray(final_ids_NxK)
    if early.shape[0] == 0:
        return float("nan")
    return float(_overlap_count(early, final).mean() / final.shape[-1])


def _overlap_count(a_NxK, b_NxK):
    # Top-k ids are distinct within a token, so matching pairs count the set intersection exactly.
    return (a_NxK[:, :, None] == b_NxK[:, None, :]).sum((1, 2))


def _ids_of(routing):
    ids = routing["expert_ids"] if isinstance(routing, dict) else routing
    return np.asarray(ids)


class RoutingAccumulator:
    """Streams per-batch routing into count tables; `finalize` turns them into metrics (keys listed there).

    A token counts if valid; its "previous token" for locality must be valid and in the same segment
    (document) of the same row. track_tokens: token ids whose expert distribution is always reported;
    n_frequent: how many most frequent token ids to report (needs track_vocab).
    top_k: every layer's K, or one K per layer; with one K, a layer whose ids carry another (a model with
    per-layer top-k) is counted with its own, recorded in top_k_L. n_zero_experts: ids E .. E+Z-1 are zero
    experts (None: any id >= E is one, Z the largest seen). routed_by: per layer "top_k" or "hash" (by token id;
    default every layer top_k)."""

    def __init__(self, n_layers, n_experts, top_k, n_domains, vocab_size, track_tokens=(),
                 track_vocab=True, n_frequent=20, vocab_min_count=10, n_zero_experts=None, routed_by=None):
        self.L, self.E, self.D, self.V = n_layers, n_experts, n_domains, vocab_size
        self.K = int(max(top_k, default=0)) if np.ndim(top_k) else int(top_k)  # the headline K (largest per layer)
        self.K_L = np.asarray(top_k if np.ndim(top_k) else [top_k] * n_layers, np.int64)
        self.fixed_K = bool(np.ndim(top_k))
        self.seen_K = [False] * n_layers
        self.Z_max = n_zero_experts  # None: grows with the largest zero-expert id seen
        self.routed_by_L = list(routed_by) if routed_by is not None else ["top_k"] * n_layers
        if len(self.K_L) != n_layers or len(self.routed_by_L) != n_layers:
            raise ValueError(f"top_k and routed_by need one entry per layer ({n_layers})")
        self.track_ids_T = np.asarray(track_tokens, np.int64).reshape(-1)
        self.track_vocab, self.n_frequent, self.vocab_min_count = track_vocab, n_frequent, vocab_min_count
        L, E, D = n_layers, n_experts, n_domains
        self.n_tokens_D = np.zeros(D, np.int64)
        self.counts_LxDxE = np.zeros((L, D, E), np.int64)
        self.first_LxDxE = np.zeros((L, D, E), np.int64)
        self.gate_LxDxE = np.zeros((L, D, E), np.float64)
        self.pairs_LxExE = np.zeros((L, E, E), np.int64)
        self.zero_LxDxZ = np.zeros((L, D, n_zero_experts or 0), np.int64)
        self.zero_first_LxD = np.zeros((L, D), np.int64)
        self.zero_gate_LxD = np.zeros((L, D), np.float64)
        self.loc_first_L = np.zeros(L, np.int64)
        self.loc_any_L = np.zeros(L, np.int64)
        self.loc_overlap_L = np.zeros(L, np.int64)  # sum of |A & B| over pairs; / (K * pairs) at the end
        self.n_pairs = 0
        # Every candidate's first-choice and top-k load (zero experts included): the load-matched null.
        self.cand_first_LxC = np.zeros((L, E + (n_zero_experts or 0)), np.int64)
        self.cand_load_LxC = np.zeros((L, E + (n_zero_experts or 0)), np.int64)
        self.track_n_T = np.zeros(len(self.track_ids_T), np.int64)
        self.track_LxTxE = np.zeros((L, len(self.track_ids_T), E), np.int64)
        if track_vocab:  # int32: L*V*E entries is the one large table
            self.tok_n_V = np.zeros(vocab_size, np.int64)
            self.tok_LxVxE = np.zeros((L, vocab_size, E), np.int32)
            self.tok_first_LxVxE = np.zeros((L, vocab_size, E), np.int32)
            self.bigrams = PairCounts()  # (previous id, id) of every locality pair: the token-identity null
            self.tok_dom_VxD = np.zeros((vocab_size, n_domains), np.int64)  # occurrences per id and domain

    def _layer_k(self, layer, k):
        if not self.seen_K[layer] and not self.fixed_K:
            self.K_L[layer] = k
        if k != self.K_L[layer]:
            raise ValueError(f"layer {layer}: expert_ids has top-k {k}, expected {self.K_L[layer]}")
        self.seen_K[layer] = True

    def _zero_ids(self, layer, ids_NxK):
        """Checks the ids' range; grows the zero-expert tables when their size is inferred."""
        if not ids_NxK.size:
            return
        top = int(ids_NxK.max())
        if ids_NxK.min() < 0 or (self.Z_max is not None and top >= self.E + self.Z_max):
            raise ValueError(f"layer {layer}: expert_ids must be in [0, {self.E + (self.Z_max or 0)}); check "
                             "n_experts and n_zero_experts")
        if top >= self.E + self.zero_LxDxZ.shape[-1]:
            grow = top - self.E + 1 - self.zero_LxDxZ.shape[-1]
            self.zero_LxDxZ = np.concatenate([self.zero_LxDxZ, np.zeros((self.L, self.D, grow), np.int64)], -1)

    def update(self, layer_routing, tokens, domains, valid=None, segment_ids=None):
        """layer_routing: per MoE layer a dict with `expert_ids` [B,L,K] (first = highest score) and optionally
        `gates` [B,L,K] (or just the ids array). tokens/domains/valid/segment_ids: [B,L]."""
        if len(layer_routing) != self.L:
            raise ValueError(f"got routing for {len(layer_routing)} layers, accumulator has n_layers={self.L}")
        tokens, domains = np.asarray(tokens), np.asarray(domains)
        valid_BxS = np.ones(tokens.shape, bool) if valid is None else np.asarray(valid, bool)
        seg_BxS = np.zeros(tokens.shape, np.int64) if segment_ids is None else np.asarray(segment_ids)
        dom_N, tok_N = domains[valid_BxS].astype(np.int64), tokens[valid_BxS].astype(np.int64)
        if dom_N.size and (dom_N.min() < 0 or dom_N.max() >= self.D):
            raise ValueError(f"domain ids must be in [0, {self.D}); got {dom_N.min()}..{dom_N.max()}")
        if tok_N.size and (tok_N.min() < 0 or tok_N.max() >= self.V):
            raise ValueError(f"token ids must be in [0, {self.V}); got {tok_N.min()}..{tok_N.max()}")
        # Locality pairs: (t-1, t) both valid and in the same document of the same row.
        pair_BxS1 = valid_BxS[:, 1:] & valid_BxS[:, :-1] & (seg_BxS[:, 1:] == seg_BxS[:, :-1])
        self.n_pairs += int(pair_BxS1.sum())
        if self.track_vocab:
            self.bigrams.add(tokens[:, :-1][pair_BxS1].astype(np.int64) * self.V + tokens[:, 1:][pair_BxS1])
        self.n_tokens_D += np.bincount(dom_N, minlength=self.D)
        track_hit_NxT = tok_N[:, None] == self.track_ids_T[None, :]
        self.track_n_T += track_hit_NxT.sum(0)
        if self.track_vocab:
            self.tok_n_V += np.bincount(tok_N, minlength=self.V)
            self.tok_dom_VxD += np.bincount(tok_N * self.D + dom_N, minlength=self.V * self.D).reshape(self.V, self.D)
        E, D = self.E, self.D
        for layer, routing in enumerate(layer_routing):
            ids_BxSxK = _ids_of(routing).astype(np.int64)
            K = ids_BxSxK.shape[-1]
            self._layer_k(layer, K)
            ids_NxK = ids_BxSxK[valid_BxS]
            self._zero_ids(layer, ids_NxK)
            real_NxK = ids_NxK < E
            n_cand = E + self.zero_LxDxZ.shape[-1]
            self.cand_first_LxC, self.cand_load_LxC = (grown(t, n_cand) for t in (self.cand_first_LxC,
                                                                                  self.cand_load_LxC))
            self.cand_first_LxC[layer] += np.bincount(ids_NxK[:, 0], minlength=n_cand)
            self.cand_load_LxC[layer] += np.bincount(ids_NxK.reshape(-1), minlength=n_cand)
            dom_NxK = np.broadcast_to(dom_N[:, None], ids_NxK.shape)
            de_M = (dom_NxK * E + ids_NxK)[real_NxK]  # the routed experts' copies only
            self.counts_LxDxE[layer] += np.bincount(de_M, minlength=D * E).reshape(D, E)
            first_real_N = real_NxK[:, 0]
            self.first_LxDxE[layer] += np.bincount((dom_N * E + ids_NxK[:, 0])[first_real_N],
                                                   minlength=D * E).reshape(D, E)
            Z = self.zero_LxDxZ.shape[-1]
            if Z:
                dz_M = (dom_NxK * Z + ids_NxK - E)[~real_NxK]
                self.zero_LxDxZ[layer] += np.bincount(dz_M, minlength=D * Z).reshape(D, Z)
                self.zero_first_LxD[layer] += np.bincount(dom_N[~first_real_N], minlength=D)
            if isinstance(routing, dict) and routing.get("gates") is not None:
                gates_NxK = np.asarray(routing["gates"], np.float64)[valid_BxS]
                self.gate_LxDxE[layer] += np.bincount(de_M, weights=gates_NxK[real_NxK], minlength=D * E).reshape(D, E)
                self.zero_gate_LxD[layer] += np.bincount(dom_NxK[~real_NxK], weights=gates_NxK[~real_NxK],
                                                         minlength=D)
            for i in range(K):
                for j in range(K):
                    both_N = real_NxK[:, i] & real_NxK[:, j]
                    if i != j and both_N.any():
                        ij_N = (ids_NxK[:, i] * E + ids_NxK[:, j])[both_N]
                        self.pairs_LxExE[layer] += np.bincount(ij_N, minlength=E * E).reshape(E, E)
            # Locality compares the candidates a token chose, zero experts included.
            prev_PxK, cur_PxK = ids_BxSxK[:, :-1][pair_BxS1], ids_BxSxK[:, 1:][pair_BxS1]
            overlap_P = _overlap_count(prev_PxK, cur_PxK)
            self.loc_first_L[layer] += int((prev_PxK[:, 0] == cur_PxK[:, 0]).sum())
            self.loc_any_L[layer] += int((overlap_P > 0).sum())
            self.loc_overlap_L[layer] += int(overlap_P.sum())
            for t in range(len(self.track_ids_T)):
                hit_NxK = track_hit_NxT[:, t][:, None] & real_NxK
                self.track_LxTxE[layer, t] += np.bincount(ids_NxK[hit_NxK], minlength=E)
            if self.track_vocab:
                np.add.at(self.tok_LxVxE[layer].reshape(-1), (tok_N[:, None] * E + ids_NxK)[real_NxK], 1)
                np.add.at(self.tok_first_LxVxE[layer].reshape(-1), (tok_N * E + ids_NxK[:, 0])[first_real_N], 1)

    def finalize(self):
        """Metrics as a flat dict of numpy arrays (scalars as 0-d arrays), ready for np.savez.

        Shares (see `domain_share`): share_LxDxE (top-k, sums to K), share_top1_LxDxE (first choice, sums
        to 1), share_norm_LxDxE (top-k / K, sums to 1), gate_share_LxDxE (sum of gate weights / #tokens;
        0 if no gates were given). Routed experts only: with zero experts each row sums to K (1) minus the zero
        experts' zero_share_LxD (zero_first_LxD), and zero_load_LxZ, zero_gate_share_LxD hold theirs.
        Load: load_LxE (top-k assignments), maxvio_L, dead_LxE (bool), over the routed experts. Locality:
        loc_first_L, loc_any_L, loc_overlap_L (mean |A & B| / K), n_pairs; the uniform router's
        baseline_first/_any/_overlap (for top_k and every candidate; per layer: baseline_*_L); the load-matched
        null loadmatched_first_L, loadmatched_overlap_L; with track_vocab and no zero experts the token-identity
        null tokennull_first_L, tokennull_overlap_L (no exact null of any-overlap: it needs the joint
        distribution of the sets). Domain shares' nulls: loadmatched_share_LxE / _top1_LxE (each expert's share
        over all domains) and, as the token-identity null, tokennull_share_LxDxE / _top1_LxDxE (the share a
        domain's token mix alone predicts). coact_LxExE. Per layer: top_k_L, hash_routed_L.
        Tokens: track_ids_T, track_n_T, track_share_TxLxE (share of occurrences with e in top-k);
        with track_vocab also freq_ids_N, freq_n_N, freq_share_NxLxE, vocab_spec_LxE, vocab_spec_L,
        vocab_n_eligible, vocab_min_count, tok_n_V, tok_counts_LxVxE."""
        load_LxE = self.counts_LxDxE.sum(1)
        Z = self.zero_LxDxZ.shape[-1]
        base = locality_baseline(self.E + Z, self.K)
        base_L = np.asarray([locality_baseline(self.E + Z, int(k)) for k in self.K_L]).reshape(self.L, 3)
        k_Lx1x1 = self.K_L[:, None, None].astype(np.float64)
        with np.errstate(invalid="ignore", divide="ignore"):
            pairs = self.n_pairs or np.nan  # no pairs -> NaN locality rather than 0
            track_share_TxLxE = self.track_LxTxE.transpose(1, 0, 2) / self.track_n_T[:, None, None]
            per_token = lambda c_LxD: np.where(self.n_tokens_D > 0, c_LxD / np.maximum(self.n_tokens_D, 1), np.nan)
        out = dict(
            n_layers=self.L, n_experts=self.E, top_k=self.K, n_domains=self.D,
            top_k_L=self.K_L, hash_routed_L=np.asarray([r == "hash" for r in self.routed_by_L]), n_zero_experts=Z,
            n_tokens_D=self.n_tokens_D, n_tokens=self.n_tokens_D.sum(),
            counts_LxDxE=self.counts_LxDxE, first_LxDxE=self.first_LxDxE,
            share_LxDxE=domain_share(self.counts_LxDxE, self.n_tokens_D),
            share_top1_LxDxE=domain_share(self.first_LxDxE, self.n_tokens_D),
            share_norm_LxDxE=domain_share(self.counts_LxDxE, self.n_tokens_D) / k_Lx1x1,
            gate_share_LxDxE=domain_share(self.gate_LxDxE, self.n_tokens_D),
            load_LxE=load_LxE, maxvio_L=np.asarray(router.max_violation(load_LxE), np.float64), dead_LxE=load_LxE == 0,
            loc_first_L=self.loc_first_L / pairs, loc_any_L=self.loc_any_L / pairs,
            loc_overlap_L=self.loc_overlap_L / (pairs * self.K_L), n_pairs=self.n_pairs,
            baseline_first=base[0], baseline_any=base[1], baseline_overlap=base[2],
            baseline_first_L=base_L[:, 0], baseline_any_L=base_L[:, 1], baseline_overlap_L=base_L[:, 2],
            coact_LxExE=coactivation(self.pairs_LxExE, load_LxE),
            track_ids_T=self.track_ids_T, track_n_T=self.track_n_T, track_share_TxLxE=track_share_TxLxE,
        )
        n_all = max(int(self.n_tokens_D.sum()), 1)
        out.update(loadmatched_share_LxE=load_LxE / n_all, loadmatched_share_top1_LxE=self.cand_first_LxC[:, :self.E] / n_all)
        loadmatched = [load_matched_locality(first_C, load_C, k)
                       for first_C, load_C, k in zip(self.cand_first_LxC, self.cand_load_LxC, self.K_L)]
        out.update(loadmatched_first_L=np.asarray([m[0] for m in loadmatched]).reshape(self.L),
                   loadmatched_overlap_L=np.asarray([m[1] for m in loadmatched]).reshape(self.L))
        if self.track_vocab and not Z:  # the token tables count routed experts only
            keys_P, counts_P = self.bigrams.merge()
            null = [token_null_locality(self.tok_first_LxVxE[i], self.tok_LxVxE[i], self.tok_n_V, keys_P, counts_P,
                                        self.V, int(self.K_L[i])) for i in range(self.L)]
            out.update(tokennull_first_L=np.asarray([m[0] for m in null]).reshape(self.L),
                       tokennull_overlap_L=np.asarray([m[1] for m in null]).reshape(self.L),
                       tokennull_share_LxDxE=self._token_null_share(self.tok_LxVxE),
                       tokennull_share_top1_LxDxE=self._token_null_share(self.tok_first_LxVxE))
        if Z:
            out.update(zero_share_LxD=per_token(self.zero_LxDxZ.sum(-1)), zero_first_LxD=per_token(self.zero_first_LxD),
                       zero_gate_share_LxD=per_token(self.zero_gate_LxD), zero_load_LxZ=self.zero_LxDxZ.sum(1),
                       zero_frac_L=self.zero_LxDxZ.sum((1, 2)) / np.maximum(self.n_tokens_D.sum() * self.K_L, 1))
        if self.track_vocab:
            freq_ids_N = np.argsort(-self.tok_n_V, kind="stable")[: self.n_frequent]
            freq_ids_N = freq_ids_N[self.tok_n_V[freq_ids_N] > 0]
            freq_n_N = self.tok_n_V[freq_ids_N]
            spec_LxE, spec_L, n_elig = vocab_specialization(
                self.tok_LxVxE, self.tok_n_V, self.K_L, self.vocab_min_count)
            out.update(
                freq_ids_N=freq_ids_N, freq_n_N=freq_n_N,
                freq_share_NxLxE=self.tok_LxVxE[:, freq_ids_N].transpose(1, 0, 2)
                / np.maximum(freq_n_N, 1)[:, None, None],
                vocab_spec_LxE=spec_LxE, vocab_spec_L=spec_L, vocab_n_eligible=n_elig,
                vocab_min_count=self.vocab_min_count,
                tok_n_V=self.tok_n_V, tok_counts_LxVxE=self.tok_LxVxE)
        return {k: np.asarray(v) for k, v in out.items()}


    def _token_null_share(self, tok_LxVxE):
        """share[l, d, e] expected when the sets are permuted among each token id's occurrences: every token of
        domain d routed as its id is over all domains, sum_v n(v, d) c(l, v, e) / n(v) / n(d)."""
        seen_V = np.flatnonzero(self.tok_n_V)
        mix_VxD = self.tok_dom_VxD[seen_V] / self.tok_n_V[seen_V, None]
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.stack([mix_VxD.T @ tok_LxVxE[layer][seen_V].astype(np.float64) for layer in range(self.L)]) \
                / np.where(self.n_tokens_D > 0, self.n_tokens_D, np.nan)[None, :, None]


class SaturationAccumulator:
    """Streams OLMoE router saturation: for the same valid tokens, the share of the final checkpoint's top-k
    set that an earlier checkpoint also selects, per layer (1 = routing already final, 0 = disjoint)."""

    def __init__(self, n_layers):
        self.match_L = np.zeros(n_layers, np.int64)
        self.n_assign_L = np.zeros(n_layers, np.int64)

    def update(self, early_routing, final_routing, valid=None):
        """early_routing / final_routing: per layer a routing dict or expert_ids [B,L,K]; valid [B,L]."""
        for layer, (early, final) in enumerate(zip(early_routing, final_routing, strict=True)):
            early_BxSxK, final_BxSxK = _ids_of(early), _ids_of(final)
            mask_BxS = np.ones(final_BxSxK.shape[:-1], bool) if valid is None else np.asarray(valid, bool)
            self.match_L[layer] += int(_overlap_count(early_BxSxK[mask_BxS], final_BxSxK[mask_BxS]).sum())
            self.n_assign_L[layer] += int(mask_BxS.sum()) * final_BxSxK.shape[-1]

    def finalize(self):
        with np.errstate(invalid="ignore", divide="ignore"):
            return {"saturation_L": self.match_L / self.n_assign_L, "n_tokens": self.n_assign_L}


def read_maxvio_series(path, key_pattern=r"moe/layer_(\d+)/maxvio", step_key="step"):
    """Reads a metrics.jsonl (one JSON object per line) and returns {layer: (steps_N, maxvio_N)}, sorted by
    layer. The layer index is the first group of `key_pattern`; lines without a match are skipped."""
    regex, series = re.compile(key_pattern), {}
    for record in read_rows(path):  # torn or unparsable lines are skipped
        for key, value in record.items():
            match = regex.fullmatch(key)
            if match and value is not None:
                series.setdefault(int(match.group(1)), []).append((record[step_key], value))
    return {layer: tuple(np.asarray(v, np.float64) for v in zip(*series[layer])) for layer in sorted(series)}


def plain_json(x):
    """A result (dicts, lists, NumPy arrays and scalars) as plain JSON values; NaN / Inf -> null."""
    if isinstance(x, dict):
        return {str(k): plain_json(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [plain_json(v) for v in x]
    if isinstance(x, np.ndarray | np.generic):
        return plain_json(x.tolist())
    if isinstance(x, float) and not np.isfinite(x):
        return None
    return x


def to_jsonable(result, max_size=100_000):
    """Converts a `finalize` dict to plain JSON types (NaN -> None), dropping arrays larger than max_size."""
    out = {}
    for key, value in result.items():
        value = np.asarray(value)
        if value.size > max_size:
            continue
        if value.dtype.kind == "f":  # JSON has no NaN / inf
            value = np.where(np.isfinite(value), value, None)
        out[key] = value.tolist()
    return out


def _chance(result, measure, i, n_layers):
    """'uniform u, load-matched x, token null y, step 0 z' for locality `measure` of layer i (those measured)."""
    uniform = float(result.get(f"baseline_{measure}_L", [result[f"baseline_{measure}"]] * n_layers)[i])
    parts = [f"uniform {uniform:.3f}"]
    for key, name in ((f"loadmatched_{measure}_L", "load-matched"), (f"tokennull_{measure}_L", "token null"),
                      (f"step0_loc_{measure}_L", "step 0")):
        if key in result:
            parts.append(f"{name} {float(result[key][i]):.3f}")
    return ", ".join(parts)


def summary_text(result, domain_names=None, n_top=3, layer=-1):
    """A short terminal summary: per layer MaxVio, locality beside its chance levels, dead experts (with zero experts: their
    share of the choices; a hash-routed layer says so), and per domain the n_top most specialized experts
    (highest top-k share) at `layer` (default the last)."""
    L, K, E = int(result["n_layers"]), int(result["top_k"]), int(result["n_experts"])
    Z = int(result.get("n_zero_experts", 0))
    k_L = result.get("top_k_L", np.full(L, K))
    hashed = [bool(h) for h in result.get("hash_routed_L", [False] * L)]
    names = domain_names or [f"domain {d}" for d in range(int(result["n_domains"]))]
    ids = result.get("layer_ids_L")  # model-layer index of each MoE layer, when the caller added it
    name = (lambda i: f"layer {int(ids[i])}") if ids is not None else (lambda i: f"layer {i}")
    per_layer_k = len(set(np.asarray(k_L).tolist())) > 1
    head = f"top-{K}" if not per_layer_k else f"top-{'/'.join(str(int(k)) for k in k_L)} (per layer)"
    zero = f" + {Z} zero experts" if Z else ""
    uniform = "/".join(f"{int(k) / (E + Z):.3f}" for k in dict.fromkeys(np.asarray(k_L).tolist()) or [K])
    lines = [f"{int(result['n_tokens']):,} tokens, {L} MoE layer{'s' * (L != 1)}, {head} of {E} experts{zero} (uniform share "
             f"{uniform})"]
    for i in range(L):
        dead = np.flatnonzero(result["dead_LxE"][i]).tolist()
        extra = f"  zero experts {float(result['zero_frac_L'][i]):.1%} of choices" if Z else ""
        if hashed[i]:
            lines.append(f"{name(i)}: routed by hash (token id -> fixed experts: the shares below are the table's, "
                         f"not learned)  maxvio {result['maxvio_L'][i]:.2f}{extra}")
            continue
        k_note = f" top-{int(k_L[i])}" if per_layer_k else ""
        lines.append(
            f"{name(i)}:{k_note} maxvio {result['maxvio_L'][i]:.2f}  first-choice locality "
            f"{result['loc_first_L'][i]:.3f} ({_chance(result, 'first', i, L)})  any-overlap "
            f"{result['loc_any_L'][i]:.3f} ({_chance(result, 'any', i, L)})  dead {dead or 'none'}{extra}")
    layer = layer % L
    share_DxE = result["share_LxDxE"][layer]
    for d, dom in enumerate(names):
        if not np.isfinite(share_DxE[d]).any():
            continue
        top = np.argsort(-np.nan_to_num(share_DxE[d]))[:n_top]
        zero_d = f", zero experts {result['zero_share_LxD'][layer, d]:.2f} of {int(k_L[layer])}" if Z else ""
        lines.append(f"{name(layer)} {dom}: " + ", ".join(f"e{e} {share_DxE[d, e]:.2f}" for e in top) + zero_d)
    return "\n".join(lines)
