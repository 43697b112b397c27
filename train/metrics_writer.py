"""Metrics sinks: one JSON object per line in WORKDIR/metrics.jsonl, TensorBoard events, a progress bar.

Only process 0 writes. Per-layer arrays become scalar keys such as `moe/layer_3/maxvio` (model layer index).
"""

import json
import math
from pathlib import Path

import jax
import numpy as np


def flatten(metrics: dict, moe_layer_ids: list[int]) -> dict:
    """Host metrics -> flat {name: float}; per-MoE-layer vectors are split into one key per layer."""
    out = {}
    for key, value in metrics.items():
        value = np.asarray(value)
        if value.ndim == 0:
            out[key] = float(value)
        elif value.ndim == 1 and len(value) == len(moe_layer_ids):
            for layer, v in zip(moe_layer_ids, value):
                out[f"moe/layer_{layer}/{key}"] = float(v)
        else:
            out[key] = value.tolist()
    return out


class MetricsWriter:
    def __init__(self, workdir, tensorboard: bool = True, purge_step: int | None = None):
        self.active = jax.process_index() == 0
        self.file = self.tb = None
        if not self.active:
            return
        Path(workdir).mkdir(parents=True, exist_ok=True)
        self.file = open(Path(workdir) / "metrics.jsonl", "a", encoding="utf-8")  # noqa: SIM115 - closed in close()
        if tensorboard:
            # Imported only here: with torch installed, tensorboardX imports it (seconds of start-up).
            from tensorboardX import SummaryWriter

            # purge_step: on resume, TensorBoard drops the events the stopped run logged after its checkpoint.
            self.tb = SummaryWriter(str(Path(workdir) / "tensorboard"), purge_step=purge_step)

    def write(self, step: int, scalars: dict) -> None:
        if not self.active:
            return
        row = {"step": int(step), **{k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                                     for k, v in scalars.items()}}
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        if self.tb is not None:
            for k, v in scalars.items():
                if isinstance(v, float) and math.isfinite(v):
                    self.tb.add_scalar(k, v, step)

    def close(self) -> None:
        if self.file:
            self.file.close()
        if self.tb is not None:
            self.tb.close()
