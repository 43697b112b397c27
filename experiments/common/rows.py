"""The validation windows a study scores, and the loss over them as the trainer computes it."""

import copy

import numpy as np

from train.inputs import eval_rows


def all_rows(config) -> dict:
    """Every validation window (eval.rows_per_domain only sizes the in-training curve)."""
    c = copy.deepcopy(config)
    c.eval.rows_per_domain = 1 << 30
    return eval_rows(c)


def first_rows_per_domain(rows, n: int) -> dict:
    """The first n rows of every domain (rows are grouped by domain in eval_rows)."""
    dom = rows["domains"][:, 0]
    keep = np.concatenate([np.nonzero(dom == d)[0][:n] for d in np.unique(dom)])
    return {k: v[keep] for k, v in rows.items()}


def token_weighted(row_loss, rows) -> tuple[float, dict]:
    """(loss over all scored tokens, {domain id: loss}) from per-row mean losses: the trainer's val/loss."""
    n = rows["loss_mask"].sum(-1)
    ok = n > 0
    ce, dom = np.where(ok, row_loss, 0.0) * n, rows["domains"][:, 0]
    return float(ce.sum() / n.sum()), {int(d): float(ce[dom == d].sum() / n[dom == d].sum()) for d in np.unique(dom)}
