"""Does an expert matter to the output? Remove it and measure the validation loss change.

    result = ablate(run.model, run.config, run.tokenizer, layers=[3], experts=None)              # rerouting
    result = ablate(run.model, run.config, run.tokenizer, layers=[3], experts=None, mode="zero")  # zeroed output
    result["delta_AxD"]          # loss change per ablation (layer, expert) and domain, nats per token

Two ways to remove an expert (`edited`), whose difference says what rerouting buys:
  reroute  the expert's routing bias is set to MASK_BIAS. The bias steers the top-k selection only (DeepSeek-V3;
           moe/router.py), so the expert leaves every token's top-k, the next choice takes its place, and the
           gates are the unbiased scores renormalized over the new set: the model is unchanged otherwise, and the
           shared expert and the other layers still run. With group-limited routing (n_group > 1) a group's score
           is the sum of its two best (score + bias): the masked expert drops out of that sum (its group now
           scores by its next two experts), and a group of only two experts scores about MASK_BIAS, so it ranks
           last and is chosen only if topk_group covers every group: both its experts are then removed.
  zero     the expert's down projection is set to 0: routing and every gate are unchanged, the expert's share of
           each token's output is lost and nothing takes its place.
The controls beside them (controls.py) zero every routed expert, or the shared expert, at once.

Loss: the trainer's own evaluation (train.inputs.eval_batches: eval.rows_per_domain rows of every domain of
the validation split; train.step.make_eval_step: masked next-token cross-entropy summed per segment). The
segment ids passed as "domains" are row x token class, so one pass gives the loss per row and class: the
per-domain and per-class changes, and a standard error over rows (the rows are the units that vary).
A token's class is the class of its target token's text (TOKEN_CLASSES).

Shape key: A ablations (layer, expert), D domains, C token classes, R rows, L MoE layers, E experts.
"""

import contextlib
import dataclasses
import re
import time

import jax
import numpy as np
from flax import nnx

from analysis.ablate import MODES
from analysis.routing import collect
from analysis.routing.stats import RoutingAccumulator
from moe import Execution
from moe.model import split_model
from train import inputs
from train.step import make_eval_step

MASK_BIAS = -1e9  # far below any score + bias (scores are in (0, 1), trained biases are O(1))
TOKEN_CLASSES = ("word start", "word piece", "number", "punctuation", "whitespace")


def token_class(text: str) -> int:
    """Index into TOKEN_CLASSES of a token's decoded text."""
    if not text.strip():
        return 4
    if re.fullmatch(r"\s+[^\W\d_].*", text):
        return 0
    if re.fullmatch(r"[^\W\d_].*", text):
        return 1
    if any(ch.isdigit() for ch in text):
        return 2
    return 3


def class_table(tokenizer, vocab_size):
    """Class index per token id [V] (ids past the tokenizer's vocabulary: punctuation, never seen)."""
    n = tokenizer.get_vocab_size()
    return np.array([token_class(tokenizer.decode([i])) if i < n else 3 for i in range(vocab_size)], np.int32)


def eval_batches(config, rows_per_domain=None):
    """The trainer's validation batches (rows_per_domain overrides eval.rows_per_domain)."""
    if rows_per_domain is not None:
        config = dataclasses.replace(config, eval=dataclasses.replace(config.eval, rows_per_domain=rows_per_domain))
    return inputs.eval_batches(config)


def _segment_batches(batches, class_V, n_classes):
    """Each batch with "domains" replaced by row * C + class of the target: the eval step's segments."""
    out, row0 = [], 0
    for b in batches:
        n_rows = len(b["tokens"])
        row_BxL = np.broadcast_to((row0 + np.arange(n_rows))[:, None], b["targets"].shape)
        out.append(dict(b, domains=(row_BxL * n_classes + class_V[b["targets"]]).astype(np.int32)))
        row0 += n_rows
    return out, row0


def sample_by_share(share_E, n):
    """n expert ids spread over the routing share: by rank, from the least to the most used, evenly between
    (a sample that spans the x axis of the importance plot)."""
    order_E = np.argsort(np.asarray(share_E), kind="stable")
    picks = np.unique(np.round(np.linspace(0, len(order_E) - 1, min(n, len(order_E)))).astype(int))
    return sorted(int(order_E[i]) for i in picks)


class Scorer:
    """The trainer's validation loss of a model's current weights and biases, per row and token class: one jitted
    pass over the validation batches, compiled once and reused for every edit of the same model."""

    def __init__(self, model, config, tokenizer, rows_per_domain=None):
        self.batches = eval_batches(config, rows_per_domain)
        self.domain_names = list(inputs.token_cache_for(config.data, config.data.eval_split).domain_names)
        self.domain_R = np.concatenate([b["domains"][:, 0] for b in self.batches]).astype(np.int64)
        self.n_classes = len(TOKEN_CLASSES)
        self.seg_batches, n_rows = _segment_batches(self.batches, class_table(tokenizer, model.cfg.vocab_size),
                                                    self.n_classes)
        self.shape_RxC = (n_rows, self.n_classes)
        graphdef = split_model(model)[0]
        self.step = jax.jit(make_eval_step(graphdef, n_rows * self.n_classes, Execution()))  # fp32, dropless

    def __call__(self, model):
        """(summed cross-entropy [R,C], scored tokens [R,C]) of `model` as it is now."""
        _, params, bias = split_model(model)
        ce, n = 0.0, 0.0
        for b in self.seg_batches:
            out = jax.device_get(self.step({"params": params, "bias": bias}, b))
            ce, n = ce + out["ce_sum"], n + out["count"]
        return np.asarray(ce, np.float64).reshape(self.shape_RxC), np.asarray(n, np.float64).reshape(self.shape_RxC)

    def summaries(self, delta_ce_ARxC, base_ce_RxC, n_RxC):
        return _summaries(np.asarray(delta_ce_ARxC), base_ce_RxC, n_RxC, self.domain_R, len(self.domain_names))


@contextlib.contextmanager
def edited(model, edits):
    """The model with `edits` applied inside the block, restored on exit (also on an exception). An edit is
    (kind, model layer id, expert id or None): "reroute" and "zero" remove one expert (module docstring),
    "zero_routed" zeroes every routed expert's down projection in the layer, "zero_shared" the shared expert's."""
    blocks = list(model.blocks)
    saved = []
    try:
        for kind, layer, e in edits:
            ffn = blocks[layer].ffn
            var = {"reroute": ffn.bias, "zero": ffn.w_down, "zero_routed": ffn.w_down}.get(kind)
            if kind == "zero_shared":
                if ffn.shared is None:
                    raise ValueError(f"layer {layer} has no shared expert")
                var = ffn.shared.w_down
            if var is None:
                raise ValueError(f"unknown edit {kind!r}")
            old = var[...]
            saved.append((var, old))
            if kind == "reroute":
                var.set_value(old.at[e].set(MASK_BIAS))
            elif kind == "zero":
                var.set_value(old.at[e].set(0))
            else:
                var.set_value(jax.numpy.zeros_like(old))
        yield model
    finally:
        for var, old in reversed(saved):
            var.set_value(old)


def ablate(model, config, tokenizer, layers=None, experts=None, rows_per_domain=None, log=None, sample=None,
           mode="reroute", scorer=None):
    """Loss change of removing each expert of each MoE layer in `layers` (model layer ids; default all), by
    rerouting (mode "reroute") or by zeroing its output (mode "zero"; see the module docstring).
    Cost: one validation pass per (layer, expert). `sample` (an int n) ablates n experts per layer instead,
    spread over their routing share (`sample_by_share`); `log` gets a line per ablation with the time spent
    and the time left. `scorer`: a Scorer of the same model and rows, to reuse its compiled pass.

    Returns a dict of numpy arrays and lists: mode, layer_ids (every MoE layer), ablations [(layer, expert)],
    domain_names, class_names, n_DxC (scored tokens), base_loss / _D / _C, delta_A / _AxD / _AxC (loss with
    the expert removed - without), se_A / se_AxD (standard error over rows), share_LxDxE / share_LxE (top-k
    routing share of the scored tokens without masking, sums to K) and top1_LxE (first choices)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    cfg = model.cfg
    moe_ids = list(cfg.moe_layer_ids)
    layers = moe_ids if layers is None else list(layers)
    experts = list(range(cfg.n_routed_experts)) if experts is None else list(experts)
    scorer = scorer or Scorer(model, config, tokenizer, rows_per_domain)
    base_ce_RxC, n_RxC = scorer(model)
    share = _shares(model, config, scorer.batches, moe_ids, len(scorer.domain_names))
    chosen = {layer: sample_by_share(share["share_LxE"][moe_ids.index(layer)], sample) if sample else experts
              for layer in layers}
    todo = [(layer, e) for layer in layers for e in chosen[layer]]
    if log:
        log(f"ablating ({mode}) {len(todo)} experts in {len(layers)} MoE layer(s): one validation pass each over "
            f"{int(n_RxC.sum()):,} scored tokens")
    ablations, delta_ce_ARxC = [], []
    start = time.perf_counter()
    for layer, e in todo:
        with edited(model, [(mode, layer, e)]):
            ce_RxC, _ = scorer(model)
        ablations.append((layer, e))
        delta_ce_ARxC.append(ce_RxC - base_ce_RxC)
        if log:
            spent = time.perf_counter() - start
            left = spent / len(ablations) * (len(todo) - len(ablations))
            log(f"[{len(ablations)}/{len(todo)}] layer {layer} expert {e}: loss change "
                f"{(ce_RxC - base_ce_RxC).sum() / n_RxC.sum():+.5f} ({spent:.0f}s spent, about {left:.0f}s left)")
    return dict(share, **scorer.summaries(delta_ce_ARxC, base_ce_RxC, n_RxC), mode=mode,
                layer_ids=moe_ids, ablations=ablations, domain_names=scorer.domain_names,
                class_names=list(TOKEN_CLASSES))


def _ratio_and_se(delta_AxR, n_R):
    """Delta = sum_r delta_r / sum_r n_r and its standard error over rows (ratio estimator, linearized)."""
    total = n_R.sum()
    if total == 0:
        nan = np.full(delta_AxR.shape[0], np.nan)
        return nan, nan
    ratio_A = delta_AxR.sum(-1) / total
    keep = n_R > 0
    m = int(keep.sum())
    resid_AxR = (delta_AxR - ratio_A[:, None] * n_R[None])[:, keep]
    se_A = np.sqrt(m / max(m - 1, 1) * (resid_AxR ** 2).sum(-1)) / total
    return ratio_A, se_A


def _summaries(delta_ARxC, base_RxC, n_RxC, domain_R, n_domains):
    dom_DxR = domain_R[None, :] == np.arange(n_domains)[:, None]
    n_DxC = dom_DxR.astype(np.float64) @ n_RxC
    base_DxC = dom_DxR.astype(np.float64) @ base_RxC
    n_R = n_RxC.sum(-1)
    delta_AxR = delta_ARxC.sum(-1) if delta_ARxC.size else np.zeros((0, len(n_R)))
    delta_A, se_A = _ratio_and_se(delta_AxR, n_R)
    delta_AxD, se_AxD = np.zeros((len(delta_A), n_domains)), np.zeros((len(delta_A), n_domains))
    for d in range(n_domains):
        delta_AxD[:, d], se_AxD[:, d] = _ratio_and_se(delta_AxR[:, dom_DxR[d]], n_R[dom_DxR[d]])
    with np.errstate(invalid="ignore", divide="ignore"):
        delta_AxC = (delta_ARxC.sum(1) / n_RxC.sum(0)) if delta_ARxC.size else np.zeros((0, n_RxC.shape[1]))
        return dict(n_DxC=n_DxC, base_loss=base_DxC.sum() / n_DxC.sum(),
                    base_loss_D=base_DxC.sum(1) / n_DxC.sum(1), base_loss_C=base_DxC.sum(0) / n_DxC.sum(0),
                    delta_A=delta_A, se_A=se_A, delta_AxD=delta_AxD, se_AxD=se_AxD, delta_AxC=delta_AxC)


def _shares(model, config, batches, moe_ids, n_domains):
    """Top-k and first-choice routing shares of the scored tokens (loss_mask > 0), unmasked model."""
    cfg = model.cfg
    graphdef, state = nnx.split(model)
    route = collect.make_route_fn(graphdef, config.data.task == "prefix")
    acc = RoutingAccumulator(len(moe_ids), cfg.n_routed_experts, cfg.top_k, n_domains, cfg.vocab_size,
                             track_vocab=False)
    for b in batches:
        layers = jax.device_get(route(state, *collect.route_args(b, len(b["tokens"]))))
        acc.update([{"expert_ids": i, "gates": g} for i, g in layers], b["tokens"], b["domains"],
                   b["loss_mask"] > 0, b["segment_ids"])
    r = acc.finalize()
    n = max(int(r["n_tokens"]), 1)
    return {"share_LxDxE": r["share_LxDxE"], "share_LxE": r["load_LxE"] / n,
            "top1_LxE": r["first_LxDxE"].sum(1) / n}
