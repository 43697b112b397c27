"""Route a data split through a checkpoint, streaming the top-k assignments into the routing accumulators.

    run = open_run(workdir, step=None)                 # rundir: model + config + tokenizer, or UserError
    data = analyse(run, split="validation", max_tokens=20_000, tokens=[" the", "."])
    data.result                                        # RoutingAccumulator.finalize() + layer_ids_L
    data.saturation                                    # with compare_run=: SaturationAccumulator.finalize()

Rows: per domain, that domain's documents of the split packed into rows of the run's seq_len (as
train.inputs.eval_rows does), or one document per row for the prefix task; `max_tokens` caps the tokens
counted per domain. Rows stream through one jitted forward (compiled once: fixed batch shape, the last batch
padded with segment-0 rows), and only counts are kept on the host.
"""

import dataclasses
import math
import time

import jax
import numpy as np
from flax import nnx
from tqdm import tqdm  # text bar: tqdm.auto warns in a notebook without ipywidgets

from analysis.routing import DEFAULT_TOKENS
from analysis.routing.stats import RoutingAccumulator, SaturationAccumulator
from moe.dispatch.execution import Execution
from moe.model import DEFAULT_EXECUTION
from plumbing.errors import UserError
from rundir import Run
from train import inputs


@dataclasses.dataclass
class Analysis:
    result: dict  # RoutingAccumulator.finalize() plus layer_ids_L
    domain_names: list
    token_text: dict  # token id -> decoded text, for every tracked and frequent id
    samples: list  # [(domain name, [token text], first-choice expert per MoE layer [M][N])]
    token_notes: list  # one line per requested text that is not a single token
    saturation: dict | None
    n_tokens: int
    seconds: float


def check_layer(run: Run, layer):
    """Model layer index -> MoE-layer index (None -> the last MoE layer); UserError if it is not an MoE layer."""
    ids = run.moe_layer_ids
    if layer is None:
        return len(ids) - 1
    if layer not in ids:
        raise UserError(f"--layer {layer} is not an MoE layer of this model ({run.model.cfg.n_layers} layers); "
                        f"valid MoE layers: {ids}")
    return ids.index(layer)


def resolve_tokens(tokenizer, texts):
    """Texts -> (token ids to track, notes). A text that encodes to several tokens is tracked as its pieces
    (the note says which); one that encodes to none is a UserError."""
    ids, notes = [], []
    for text in texts:
        enc = tokenizer.encode(text, add_special_tokens=False)
        if not enc.ids:
            raise UserError(f"--token {text!r} encodes to no token; pass a non-empty text")
        if len(enc.ids) > 1:
            pieces = [tokenizer.decode([i]) for i in enc.ids]
            notes.append(f"--token {text!r} is {len(enc.ids)} tokens, {pieces} (ids {enc.ids}); tracking each piece")
        ids += [i for i in enc.ids if i not in ids]
    return ids, notes


def layer_routing(mcfg, layer_ids) -> dict:
    """RoutingAccumulator's arguments that describe a model's routers: each MoE layer's K and how it routes
    (top_k, or hash: by token id), and the zero experts."""
    return {"top_k": [mcfg.moe_top_k(i) for i in layer_ids], "n_zero_experts": mcfg.n_zero_experts,
            "routed_by": ["hash" if mcfg.layer_router(i) == "hash" else "top_k" for i in layer_ids]}


def make_route_fn(graphdef, prefix: bool, execution: Execution = DEFAULT_EXECUTION):
    """jit(state, batch) -> per MoE layer (expert_ids [B,L,K], gates [B,L,K]); logits are never materialized
    on the host (and XLA drops the LM head since nothing uses it). `execution`: fp32, dropless, the platform's
    kernels by default."""

    @jax.jit
    def route(state, tokens_BxL, positions_BxL, segment_ids_BxL, prefix_len_B):
        model = nnx.merge(graphdef, state)
        _, aux = model.inspect(tokens_BxL, execution=execution, positions_BxL=positions_BxL,
                               segment_ids_BxL=segment_ids_BxL, prefix_len_B=prefix_len_B if prefix else None)
        return [(r.expert_ids, r.gates) for r in aux.routing]

    return route


def domain_rows(config, split, max_tokens, cache=None):
    """Yields (domain id, sampler rows function, n_rows) per domain of `split` (or of `cache`, a ready TokenCache,
    e.g. analysis.hf_source's), plus the domain names."""
    d = config.data
    try:
        cache = inputs.token_cache_for(d, split) if cache is None else cache
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001 - a bad split name surfaces as a TFDS / file error
        raise UserError(f"cannot read split {split!r} of data set {d.name!r} ({type(e).__name__}: "
                        f"{str(e)[:100]}); check --split") from e
    plans = []
    for dom in np.unique(cache.domains):
        sampler, available = inputs.domain_sampler(d, inputs.domain_subset(cache, int(dom)), inputs.targets(config))
        n = available if max_tokens is None else min(available, math.ceil(max_tokens / d.seq_len))
        plans.append((int(dom), sampler.rows, n))
    return plans, list(cache.domain_names)


def _batches(plans, batch_size, seq_len, max_tokens, n_samples):
    """Fixed-size batches across domains; `valid` marks real tokens within each domain's max_tokens cap."""
    buf = []
    for _dom, rows_fn, n in plans:
        for start in range(0, n, batch_size):
            rows = rows_fn(start, min(batch_size, n - start))
            idx_BxL = (start + np.arange(len(rows["tokens"])))[:, None] * seq_len + np.arange(seq_len)[None]
            rows["valid"] = rows["segment_ids"] > 0
            if max_tokens is not None:
                rows["valid"] &= idx_BxL < max_tokens
            rows["sample_row"] = start + np.arange(len(rows["tokens"])) < n_samples
            buf.append(rows)
            if sum(len(r["tokens"]) for r in buf) >= batch_size:
                batch = {k: np.concatenate([r[k] for r in buf]) for k in buf[0]}
                yield {k: v[:batch_size] for k, v in batch.items()}
                rest = {k: v[batch_size:] for k, v in batch.items()}
                buf = [rest] if len(rest["tokens"]) else []
    if buf:
        batch = {k: np.concatenate([r[k] for r in buf]) for k in buf[0]}
        pad = batch_size - len(batch["tokens"])
        # Padding rows: segment 0 (invalid for the model and the accumulators).
        yield {k: np.concatenate([v, np.zeros((pad,) + v.shape[1:], v.dtype)]) for k, v in batch.items()}


def batches(config, split=None, max_tokens=None, batch_size=None, n_samples=0):
    """(iterator over the fixed-size batches `analyse` routes, domain names): every domain of `split` (default
    the run's eval split), `max_tokens` per domain; each batch has tokens, positions, segment_ids, domains,
    valid [B,L] (and prefix_len for the prefix task). The same config gives the same batches, so several
    checkpoints or models see the same tokens."""
    plans, domain_names = domain_rows(config, split or config.data.eval_split, max_tokens)
    return (_batches(plans, batch_size or config.eval.batch_size, config.data.seq_len, max_tokens, n_samples),
            domain_names)


def route_args(batch, batch_size):
    """The arguments of a `make_route_fn` function after the state, for one batch of `batches`."""
    return (batch["tokens"], batch["positions"], batch["segment_ids"],
            batch.get("prefix_len", np.zeros(batch_size, np.int32)))


def analyse(run: Run, split=None, max_tokens=None, tokens=DEFAULT_TOKENS, compare_run: Run | None = None,
            batch_size=None, n_samples=2, sample_len=160, n_frequent=20, progress=True, cache=None) -> Analysis:
    """Streams every domain of `split` (default the run's eval split) through the model; see module docstring.
    `cache`: route this TokenCache's domains instead of the run's data (analysis.hf_source)."""
    config, mcfg = run.config, run.model.cfg
    split = split or config.data.eval_split
    batch_size = batch_size or config.eval.batch_size
    track_ids, notes = resolve_tokens(run.tokenizer, tokens)
    plans, domain_names = domain_rows(config, split, max_tokens, cache)
    n_moe = len(run.moe_layer_ids)
    acc = RoutingAccumulator(n_moe, mcfg.n_routed_experts, n_domains=len(domain_names), vocab_size=mcfg.vocab_size,
                             track_tokens=track_ids, n_frequent=n_frequent, **layer_routing(mcfg, run.moe_layer_ids))
    sat = SaturationAccumulator(n_moe) if compare_run is not None else None
    prefix = config.data.task == "prefix"
    graphdef, state = nnx.split(run.model)
    route = make_route_fn(graphdef, prefix)
    other_state = nnx.split(compare_run.model)[1] if compare_run is not None else None
    samples, start = [], time.perf_counter()
    n_rows = sum(n for _, _, n in plans)
    bar = tqdm(total=n_rows, unit="row", desc=f"routing {split}", disable=None if progress else True)
    for batch in _batches(plans, batch_size, config.data.seq_len, max_tokens, n_samples):
        args = (batch["tokens"], batch["positions"], batch["segment_ids"],
                batch.get("prefix_len", np.zeros(batch_size, np.int32)))
        routing = jax.device_get(route(state, *args))
        layers = [{"expert_ids": ids, "gates": gates} for ids, gates in routing]
        acc.update(layers, batch["tokens"], batch["domains"], batch["valid"], batch["segment_ids"])
        if sat is not None:
            early = [ids for ids, _ in jax.device_get(route(other_state, *args))]
            sat.update(early, [ids for ids, _ in routing], batch["valid"])
        for b in np.flatnonzero(batch["sample_row"]):
            keep = batch["valid"][b][:sample_len]
            ids = batch["tokens"][b][:sample_len][keep]
            first_LxN = [layer["expert_ids"][b, :sample_len, 0][keep].tolist() for layer in layers]
            samples.append((domain_names[int(batch["domains"][b, 0])], [run.tokenizer.decode([int(i)]) for i in ids],
                            first_LxN))
        bar.update(int((batch["segment_ids"] > 0).any(-1).sum()))
    bar.close()
    seconds = time.perf_counter() - start
    result = acc.finalize()
    result["layer_ids_L"] = np.asarray(run.moe_layer_ids)
    shown = {int(i) for i in result["track_ids_T"]} | {int(i) for i in result.get("freq_ids_N", [])}
    token_text = {i: run.tokenizer.decode([i]) for i in sorted(shown)}
    return Analysis(result, domain_names, token_text, samples, notes,
                    sat.finalize() if sat is not None else None, int(result["n_tokens"]), seconds)
