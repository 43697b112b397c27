"""optax AdamW with warmup + cosine (or warmup-stable-decay), clipping, and no decay on norms."""

import jax
import optax


def schedule(t) -> optax.Schedule:
    peak, floor = t.lr, t.lr * t.min_lr_ratio
    warmup = max(int(t.warmup_steps), 1)
    if t.schedule == "cosine":
        return optax.warmup_cosine_decay_schedule(0.0, peak, warmup, max(int(t.steps), warmup + 1), floor)
    # WSD: warmup, constant, then linear decay over the last decay_frac of the run.
    decay = max(int(t.steps * t.decay_frac), 1)
    stable = max(int(t.steps) - warmup - decay, 0)
    return optax.join_schedules(
        [optax.linear_schedule(0.0, peak, warmup), optax.constant_schedule(peak),
         optax.linear_schedule(peak, floor, decay)], [warmup, warmup + stable])


def decay_mask(params):
    """Weight decay on matrices only: norms' scales (1-D) are exempt; routing biases are not params at all."""
    return jax.tree.map(lambda p: p.ndim >= 2, params)


def optimizer(t) -> optax.GradientTransformation:
    return optax.chain(
        optax.clip_by_global_norm(t.grad_clip),
        optax.adamw(schedule(t), b1=t.b1, b2=t.b2, eps=t.eps, weight_decay=t.weight_decay, mask=decay_mask),
    )
