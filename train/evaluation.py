"""Validation during training: the loss over the fixed validation batches, per domain, with each MoE layer's
global MaxVio; and the run's loss-curve figure, redrawn after every evaluation."""

import os

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from moe import router
from rundir import metrics as metrics_file
from train.loss_plot import plot_loss_curves, run_title


def to_global(batch: dict, mesh) -> dict:
    """This process's rows -> global arrays sharded over (data, fsdp) on the batch axis."""
    spec = PartitionSpec(("data", "fsdp"))
    return {k: jax.make_array_from_process_local_data(NamedSharding(mesh, spec), v) for k, v in batch.items()}


def evaluate(eval_step, state, batches, mesh, domain_names, moe_layer_ids) -> dict:
    ce, count, load = 0.0, 0.0, 0.0
    for b in batches:
        out = jax.device_get(eval_step(state, to_global(b, mesh)))
        ce, count, load = ce + out["ce_sum"], count + out["count"], load + out["load"]
    result = {"val/loss": float(np.sum(ce) / max(np.sum(count), 1.0))}
    for d, name in enumerate(domain_names):
        if count[d] > 0:
            result[f"val/loss/{name}"] = float(ce[d] / count[d])
    for layer, load_E in zip(moe_layer_ids, np.atleast_2d(load)):
        result[f"moe/layer_{layer}/maxvio_global"] = float(router.max_violation(load_E))
    return result


def draw_loss_curves(run_dir, say, references=None) -> None:
    """WORKDIR/loss_curves.png from metrics.jsonl (written beside, then renamed), with the n-gram references when
    given; a plotting problem is a warning, never the end of a run."""
    tmp = run_dir.loss_curves.with_name(f".{run_dir.loss_curves.stem}.tmp.png")
    try:
        rows = metrics_file.read_rows(run_dir.metrics)
        plot_loss_curves(rows, tmp, title=run_title(run_dir.root, rows), references=references)
        os.replace(tmp, run_dir.loss_curves)
    except Exception as e:  # noqa: BLE001
        tmp.unlink(missing_ok=True)
        say(f"warning: could not draw {run_dir.loss_curves} ({type(e).__name__}: {str(e)[:100]})")
