"""The jitted train and eval steps: one implementation for every mesh, with gradient accumulation.

Loss = next-token cross-entropy over loss-masked targets (mean over the GLOBAL batch's masked tokens, so
accumulation and sharding don't change it) + alpha * sequence-wise balance loss, + with model.mtp_depth = D > 0
lambda / D * the D multi-token prediction losses (each normalized by the same target count; moe/mtp.py). After the
optimizer update, the routing biases (the MTP modules' included) follow the expert load of the whole global batch:
b += gamma * sign(mean_load - load).
"""

import functools

import jax
import jax.numpy as jnp
import optax

from moe import Execution, router
from moe.model import merge_model


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


def make_train_step(graphdef, tx, lr_schedule, t, ex: Execution, forward_fn=train_forward):
    """forward_fn(graphdef, params, bias, batch, ex) -> (masked ce [B, T], aux): `train_forward` for the decoder-only
    model; experiments.encdec.task.forward for the encoder-decoder of the 2x2 study, trained by this same step. It
    differentiates `objective`."""
    gamma_stop = int(t.bias_update_stop * t.steps)

    def train_step(state, batch):
        n_targets = jnp.maximum(batch["loss_mask"].sum(), 1.0)
        lam = mtp_weight(t, state["step"])

        def loss_fn(params, bias, mb):
            ce_BxL, aux = forward_fn(graphdef, params, bias, mb, ex)
            balance = t.balance_loss_weight * aux.balance_loss
            mtp = aux.mtp.total() if aux.mtp is not None else 0.0
            loss = (objective(ce_BxL, aux) + lam * mtp) / n_targets + balance / t.grad_accum
            stats = {"ce": ce_BxL.sum(), "balance": balance, "load": aux.expert_load, "drop": aux.dropped_frac}
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
        # state["bias"] holds the MoE layers' RoutingBias leaves in layer order, the rows of load_MxE.
        bias = jax.tree.unflatten(jax.tree.structure(state["bias"]), [
            router.update_bias(b, load_E, gamma)
            for b, load_E in zip(jax.tree.leaves(state["bias"]), load_MxE, strict=True)])
        biases = jax.tree.leaves(bias)

        metrics = {
            "loss": ce_sum / n_targets,
            "balance_loss": bal / t.grad_accum,
            "grad_norm": optax.tree.norm(grads),  # as train.optim clips by (optax.global_norm is deprecated)
            "param_norm": optax.tree.norm(params),  # non-finite params must never reach a checkpoint
            "lr": lr_schedule(state["step"]),
            "targets": n_targets,
            "maxvio": router.max_violation(load_MxE),
            "dead_experts": (load_MxE == 0).sum(-1),
            "dropped_frac": dropped_M / t.grad_accum,  # per MoE layer; 0 unless a capacity bound drops
            "bias_range": jnp.stack([b.max() - b.min() for b in biases]) if biases else jnp.zeros((0,)),
        }
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
        return {
            "ce_sum": jax.ops.segment_sum(ce_BxL.reshape(-1), ids, n_domains),
            "count": jax.ops.segment_sum(mask_BxL.reshape(-1), ids, n_domains),
            "load": aux.expert_load,
        }

    return eval_step
