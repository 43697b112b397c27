"""The jitted train and eval steps: one implementation for every mesh, with gradient accumulation.

Loss = next-token cross-entropy over loss-masked targets (mean over the GLOBAL batch's masked tokens, so
accumulation and sharding don't change it) + alpha * balance loss + beta * router z-loss (train.router_z_loss_weight),
+ with model.mtp_depth = D > 0 lambda / D * the D multi-token prediction losses (each normalized by the same target
count; moe/mtp.py). After the optimizer update, the routing biases (the MTP modules' included) follow the expert
load of the whole global batch: b += gamma * sign(mean_load - load), whatever the score function (the bias shifts
the ranking); a hash-routed layer's bias stays 0 (its selection is the token ids', nothing to steer).

The balance loss sum_i f_i P_i (moe.router.balance_loss; both factors counted over the same tokens), summed over the
MoE layers, by train.balance_loss_scope:
  sequence      each row's tokens, averaged over the rows (DeepSeek-V3's sequence-wise loss)
  micro_batch   each data-parallel shard's rows of the micro-batch (mesh data x fsdp shards), averaged over the shards
  global_batch  every row of the micro-batch, on every device (Qwen's global-batch loss)
With gradient accumulation (train.grad_accum = n) each micro-batch is one forward pass: every scope is computed per
micro-batch and the step's loss is the mean of the n micro-batches' losses. So global_batch covers the B / n rows
of one micro-batch across all devices, not the whole step's B rows (f_i is not accumulated across micro-batches);
with n = 1 it is the whole global batch. The router z-loss is the mean over each layer's valid tokens, summed over
layers, averaged over the micro-batches the same way.
"""

import functools
import math

import jax
import jax.numpy as jnp
import optax

from moe import Execution, router
from moe.model import merge_model
from moe.sharding import logical_to_spec


def forward(graphdef, params, bias, batch, ex: Execution, fused_loss: bool = False, mtp: bool = False):
    """(masked ce [B, L], aux). fused_loss (the train step's, `train_forward`): the model computes the LM head's
    gradient in its forward pass (moe/lm_loss.py) and returns aux.objective = sum(loss_mask * ce),
    differentiable, and the ce are values only -- differentiate `objective`, never the ce. False: the per-token ce,
    differentiable as they are (evaluation, and the reference: benchmarks.train_step --loss plain). mtp: run the
    multi-token prediction modules too (training; validation scores the main head alone)."""
    model = merge_model(graphdef, params, bias)
    ce_BxL, aux = model.token_losses(batch["tokens"], batch["targets"], execution=ex,
                                     loss_weights_BxL=batch["loss_mask"] if fused_loss else None, mtp=mtp,
                                     positions_BxL=batch["positions"],
                                     segment_ids_BxL=batch["segment_ids"], prefix_len_B=batch.get("prefix_len"))
    return ce_BxL * batch["loss_mask"], aux


train_forward = functools.partial(forward, fused_loss=True, mtp=True)


def mtp_weight(t, step):
    """lambda of the multi-token prediction loss at `step`: train.mtp_weight, then train.mtp_weight_late from the
    train.mtp_weight_switch fraction of the run on."""
    return jnp.where(step < int(t.mtp_weight_switch * t.steps), t.mtp_weight, t.mtp_weight_late)


def objective(ce_BxL, aux):
    """What a forward_fn's caller differentiates: aux.objective when the forward gives one (the masked ce's sum
    with a gradient of its own: `forward`'s fused loss, whose ce are values only), else the masked ce's sum."""
    return aux.objective if aux.objective is not None else ce_BxL.sum()


def _micro_batches(batch, n: int):
    """[B, ...] -> [n, B/n, ...], taking rows a, a+n, ... for micro-batch a so no row changes device."""
    return jax.tree.map(lambda x: jnp.swapaxes(x.reshape(x.shape[0] // n, n, *x.shape[1:]), 0, 1), batch)


def data_shards(ex: Execution) -> int:
    """Data-parallel shards of the batch: the devices of the mesh axes the `batch` rule maps to (1 without a mesh)."""
    if ex.mesh is None:
        return 1
    axes = logical_to_spec(("batch",), ex.rules)[0] or ()
    return math.prod(ex.mesh.shape[a] for a in ((axes,) if isinstance(axes, str) else axes))


def balance_term(aux, scope: str, n_shards: int = 1):
    """The unweighted balance loss of one forward pass by train.balance_loss_scope (module docstring)."""
    if scope == "sequence" or aux.balance_rows is None:
        return aux.balance_loss
    rows = aux.balance_rows
    n_rows = rows.tokens_B.shape[-1]
    groups = 1 if scope == "global_batch" else n_shards
    if n_rows % groups:
        raise ValueError(f"balance_loss_scope={scope!r}: the {n_rows} rows of a micro-batch do not split over the "
                         f"{groups} data-parallel shards")
    return router.balance_loss(rows, groups).sum()


def steered_rows(cfg):
    """Per row of the step's expert load: whether the layer's selection is bias-steered (False: hash-routed, whose
    bias stays 0); None when every layer's is (or `cfg` is not a moe.ModelConfig)."""
    hashed = getattr(cfg, "hash_layer_ids", ())
    if not hashed:
        return None
    return jnp.asarray([i not in hashed for i in cfg.train_load_layer_ids], jnp.float32)


def make_train_step(graphdef, tx, lr_schedule, t, ex: Execution, forward_fn=train_forward):
    """forward_fn(graphdef, params, bias, batch, ex) -> (masked ce [B, T], aux): `train_forward` for the decoder-only
    model; experiments.encdec.task.forward for the encoder-decoder of the 2x2 study, trained by this same step. It
    differentiates `objective`."""
    gamma_stop = int(t.bias_update_stop * t.steps)
    n_shards = data_shards(ex)

    def train_step(state, batch):
        n_targets = jnp.maximum(batch["loss_mask"].sum(), 1.0)
        lam = mtp_weight(t, state["step"])

        def loss_fn(params, bias, mb):
            ce_BxL, aux = forward_fn(graphdef, params, bias, mb, ex)
            balance = t.balance_loss_weight * balance_term(aux, t.balance_loss_scope, n_shards)
            z_loss = aux.z_loss if aux.z_loss is not None else jnp.float32(0)
            mtp = aux.mtp.total() if aux.mtp is not None else 0.0
            loss = (objective(ce_BxL, aux) + lam * mtp) / n_targets + balance / t.grad_accum
            if t.router_z_loss_weight:  # off: the loss (and its program) exactly as without the term
                loss = loss + t.router_z_loss_weight * z_loss / t.grad_accum
            stats = {"ce": ce_BxL.sum(), "balance": balance, "z_loss": z_loss, "load": aux.expert_load,
                     "drop": aux.dropped_frac}
            if aux.mtp is not None:  # per depth: the weighted ce and its target count, for the depth's loss metric
                stats["mtp_ce"] = (aux.mtp.ce * aux.mtp.weights).sum((1, 2))
                stats["mtp_targets"] = aux.mtp.weights.sum((1, 2))
            return loss, stats

        grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
        micro = _micro_batches(batch, t.grad_accum)

        def accumulate(carry, mb):
            (_, stats), g = grad_fn(state["params"], state["bias"], mb)
            return jax.tree.map(jnp.add, carry, (g, stats)), None

        first = jax.tree.map(lambda x: x[0], micro)
        shapes = jax.eval_shape(lambda: grad_fn(state["params"], state["bias"], first))
        init = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), (shapes[1], shapes[0][1]))
        (grads, stats), _ = jax.lax.scan(accumulate, init, micro)
        ce_sum, bal, load_MxE, dropped_M = stats["ce"], stats["balance"], stats["load"], stats["drop"]

        updates, opt = tx.update(grads, state["opt"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        gamma = jnp.where(state["step"] < gamma_stop, t.bias_update_rate, 0.0)
        # The model's config, read from the graph while tracing (the encoder-decoder study's model has one too).
        cfg = getattr(merge_model(graphdef, state["params"], state["bias"]), "cfg", None)
        steered_M = steered_rows(cfg)
        gamma_M = [gamma] * load_MxE.shape[0] if steered_M is None else gamma * steered_M
        # state["bias"] holds the MoE layers' RoutingBias leaves in layer order, the rows of load_MxE.
        bias = jax.tree.unflatten(jax.tree.structure(state["bias"]), [
            router.update_bias(b, load_E, g)
            for b, load_E, g in zip(jax.tree.leaves(state["bias"]), load_MxE, gamma_M, strict=True)])
        biases = jax.tree.leaves(bias)

        # MaxVio and dead experts over the routed experts (what computes; the zero experts' share is logged apart).
        routed_MxE = load_MxE[:, :cfg.n_routed_experts] if getattr(cfg, "n_zero_experts", 0) else load_MxE
        metrics = {
            "loss": ce_sum / n_targets,
            "balance_loss": bal / t.grad_accum,
            "router_z_loss": stats["z_loss"] / t.grad_accum,  # unweighted
            "grad_norm": optax.tree.norm(grads),  # as train.optim clips by (optax.global_norm is deprecated)
            "param_norm": optax.tree.norm(params),  # non-finite params must never reach a checkpoint
            "lr": lr_schedule(state["step"]),
            "targets": n_targets,
            "maxvio": router.max_violation(routed_MxE),
            "dead_experts": (routed_MxE == 0).sum(-1),
            "dropped_frac": dropped_M / t.grad_accum,  # per MoE layer; 0 unless a capacity bound drops
            "bias_range": jnp.stack([b.max() - b.min() for b in biases]) if biases else jnp.zeros((0,)),
        }
        if getattr(cfg, "n_zero_experts", 0):  # per layer: the share of copies that went to a zero expert
            E = cfg.n_routed_experts
            metrics["zero_expert_frac"] = load_MxE[:, E:].sum(-1) / jnp.maximum(load_MxE.sum(-1), 1.0)
        if "mtp_ce" in stats:
            metrics["mtp_weight"] = lam
            for k, (ce_k, n_k) in enumerate(zip(stats["mtp_ce"], stats["mtp_targets"]), start=1):
                metrics[f"mtp/loss_{k}"] = ce_k / jnp.maximum(n_k, 1.0)
        return {"params": params, "bias": bias, "opt": opt, "step": state["step"] + 1}, metrics

    return train_step


def make_eval_step(graphdef, n_domains: int, ex: Execution, forward_fn=forward):
    def eval_step(state, batch):
        ce_BxL, aux = forward_fn(graphdef, state["params"], state["bias"], batch, ex)
        mask_BxL = batch["loss_mask"]
        ids = batch["domains"].reshape(-1)
        cfg = getattr(merge_model(graphdef, state["params"], state["bias"]), "cfg", None)
        return {
            "ce_sum": jax.ops.segment_sum(ce_BxL.reshape(-1), ids, n_domains),
            "count": jax.ops.segment_sum(mask_BxL.reshape(-1), ids, n_domains),
            # the routed experts' (MaxVio is theirs, as in training)
            "load": aux.expert_load[:, :cfg.n_routed_experts] if getattr(cfg, "n_zero_experts", 0) else aux.expert_load,
        }

    return eval_step
