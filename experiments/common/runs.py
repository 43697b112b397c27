"""What the study runners read from and write about a run: the fingerprint that names a finished run's config
(a cached result.json is reused only under the same fingerprint) and the metrics a run logged."""

import hashlib
import json
from pathlib import Path

from rundir import RunDir
from rundir.config_layout import pre_split_layout
from rundir.metrics import read_rows


def fingerprint(config) -> str:
    """Hash of everything that changes a run's result (progress bars and TensorBoard do not)."""
    d = config.to_dict()
    # How the loss is chunked changes float rounding, not the function (tests/test_lm_loss.py): runs cached with
    # all logits at once (every run before 2026-11-26) stay valid under the chunked default.
    d.get("execution", {}).pop("loss_chunks", None)
    d.get("execution", {}).pop("scan_layers", None)  # likewise: the unrolled loop's function (tests/test_layer_scan.py)
    d.get("execution", {}).pop("permute_grad", None)  # likewise: how rows move backward (tests/test_model.py)
    # In the layout before the model/execution split, so results cached before it keep their fingerprint.
    d = pre_split_layout(d)
    d["log"] = {k: v for k, v in d["log"].items() if k not in ("progress", "tensorboard")}
    if not d["eval"].get("output_only", True):  # added later with this default: old caches stay valid
        del d["eval"]["output_only"]
    if not d["train"].get("equal_targets", True):  # likewise
        del d["train"]["equal_targets"]
    d["train"].pop("compile_cache_dir", None)  # where compiled programs are cached, not what they compute
    if d["model"].get("attention_impl") == "blockwise":  # the default since 2026-11-26: einsum's function, by
        d["model"]["attention_impl"] = "einsum"          # query blocks (tests/test_attention_impl.py)
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


def read_metrics(workdir) -> tuple[dict, dict]:
    """(train loss by step, eval row by step) from metrics.jsonl (rundir.metrics: torn lines skipped); if a
    step appears twice the last row wins."""
    train, evals = {}, {}
    for row in read_rows(RunDir(Path(workdir)).metrics):
        if "loss" in row:
            train[row["step"]] = row["loss"]
        if "val/loss" in row:
            evals[row["step"]] = {k: v for k, v in row.items() if k.startswith("val/")}
    return train, evals
