"""The gate swap: one model's routers put into the other, and the validation-loss change on the same tokens.

    rows = gate_swap(model_a, model_b, config, tokenizer)    # A's experts with B's routers, per layer and all
    rows["names"], rows["delta_A"], rows["se_A"]             # nats per token against A as it is

A router here is everything that decides a token's experts and gates: the router matrix W [D, E], the routing bias
b (aux-loss-free balancing) and, where the model has one, the logit bias. Swapped: all MoE layers at once, and
each MoE layer alone. Two controls bracket the result:
  self (control)    A's own routers put back into A: exactly 0 (the swap machinery changes nothing else)
  random (control)  every router replaced by a Gaussian matrix with the layer's own standard deviation and a zero
                    bias: what a router that knows nothing of these experts costs
So "B's routers cost +0.01 nats in A" reads against 0 and against the random router's cost. The loss is the
trainer's validation loss (analysis.ablate.ablation.Scorer: eval.rows_per_domain rows per domain), with a
standard error over rows.
"""

import contextlib

import jax.numpy as jnp
import numpy as np

from analysis.ablate.ablation import Scorer
from plumbing.errors import UserError


def moe_ffns(model) -> list:
    """Each MoE layer's MoE module, in layer order."""
    return [b.ffn for b in model.blocks if b.is_moe]


def routers_of(model) -> list[dict]:
    """Per MoE layer {"router": W, "bias": b[, "logit_bias": c]} as arrays (copies held by JAX)."""
    out = []
    for ffn in moe_ffns(model):
        r = {"router": ffn.router[...], "bias": ffn.bias[...]}
        if hasattr(ffn, "logit_bias"):
            r["logit_bias"] = ffn.logit_bias[...]
        out.append(r)
    return out


def check_swappable(model_a, model_b) -> None:
    """UserError unless the two models' routers have one shape per MoE layer (same MoE layers, D and E)."""
    ca, cb = model_a.cfg, model_b.cfg
    if tuple(ca.moe_layer_ids) != tuple(cb.moe_layer_ids):
        raise UserError(f"the two models' MoE layers differ ({list(ca.moe_layer_ids)} vs {list(cb.moe_layer_ids)}); "
                        "compare models of one architecture (two seeds, checkpoints or a fine-tune)")
    for ra, rb in zip(routers_of(model_a), routers_of(model_b), strict=True):
        for k in ra:
            if k not in rb or ra[k].shape != rb[k].shape:
                raise UserError(f"router {k} shapes differ ({tuple(ra[k].shape)} vs "
                                f"{tuple(rb[k].shape) if k in rb else 'absent'}); compare models of one architecture")


@contextlib.contextmanager
def routers_set(model, routers: dict):
    """`model` with routers[i] (routers_of's entries, by MoE-layer index i) in place inside the block, its own
    restored on exit (also on an exception)."""
    ffns, saved = moe_ffns(model), []
    try:
        for i, r in routers.items():
            for k, v in r.items():
                var = getattr(ffns[i], k)
                saved.append((var, var[...]))
                var.set_value(jnp.asarray(v, var[...].dtype))
        yield model
    finally:
        for var, old in reversed(saved):
            var.set_value(old)


def random_routers(model, seed: int = 0) -> list[dict]:
    """Per MoE layer a Gaussian router matrix with the layer's own standard deviation, zero biases."""
    rng = np.random.default_rng(seed)
    out = []
    for r in routers_of(model):
        w = np.asarray(r["router"], np.float32)
        new = {"router": rng.normal(0.0, float(w.std()), w.shape).astype(np.float32),
               "bias": np.zeros(r["bias"].shape, np.float32)}
        if "logit_bias" in r:
            new["logit_bias"] = np.zeros(r["logit_bias"].shape, np.float32)
        out.append(new)
    return out


def swap_edits(model_into, model_from, layer_ids, seed: int = 0) -> dict:
    """Row name -> {MoE-layer index: routers} for `gate_swap`, in report order."""
    own, other = routers_of(model_into), routers_of(model_from)
    rows = {"self (control)": dict(enumerate(own)), "other, all layers": dict(enumerate(other))}
    if len(layer_ids) > 1:
        rows.update({f"other, layer {layer}": {i: other[i]} for i, layer in enumerate(layer_ids)})
    rows["random (control)"] = dict(enumerate(random_routers(model_into, seed)))
    return rows


def gate_swap(model_into, model_from, config, tokenizer, rows_per_domain=None, scorer=None, seed: int = 0,
              log=None) -> dict:
    """Loss change of `model_into` with `model_from`'s routers (swap_edits' rows), on config's validation rows:
    names, base_loss, delta_A, se_A, delta_AxD, se_AxD, domain_names. One validation pass per row."""
    check_swappable(model_into, model_from)
    scorer = scorer or Scorer(model_into, config, tokenizer, rows_per_domain)
    base_ce_RxC, n_RxC = scorer(model_into)
    names, deltas = [], []
    for name, routers in swap_edits(model_into, model_from, list(model_into.cfg.moe_layer_ids), seed).items():
        with routers_set(model_into, routers):
            ce_RxC, _ = scorer(model_into)
        names.append(name)
        deltas.append(ce_RxC - base_ce_RxC)
        if log:
            log(f"gate swap, {name}: loss change {(ce_RxC - base_ce_RxC).sum() / n_RxC.sum():+.4f}")
    s = scorer.summaries(deltas, base_ce_RxC, n_RxC)
    return dict(names=names, base_loss=s["base_loss"], delta_A=s["delta_A"], se_A=s["se_A"],
                delta_AxD=s["delta_AxD"], se_AxD=s["se_AxD"], domain_names=scorer.domain_names)
