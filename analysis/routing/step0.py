"""The untrained router of a run: its step-0 checkpoint where it has one, else the model training started from,
rebuilt (the trainer saves no step-0 checkpoint: train/loop.py saves after steps 1..N, so `init_model` is what a
run normally gets).

    model, source = untrained(run)        # source: "checkpoint step 0" or "fresh initialization, seed S ..."
    step0 = locality(run, split, max_tokens)   # {"loc_first_L": ..., "source": ...} for routing.json
"""

import dataclasses

import jax
import numpy as np
from flax import nnx

from analysis.routing import collect
from moe import Transformer
from rundir import RunDir, open_run
from rundir.checkpoints import steps_in


def init_model(run) -> Transformer:
    """The model of `run` at step 0: the same initializer and seed as training, under jit as in
    train.state.init_state (eagerly, XLA would round a few initial values differently, by one ulp)."""
    cfg, seed = run.model.cfg, run.config.train.seed
    graphdef, state = jax.jit(lambda: nnx.split(Transformer(cfg, nnx.Rngs(seed))))()
    return nnx.merge(graphdef, state)


def untrained(run) -> tuple[Transformer, str]:
    """(the run's router before training, where it comes from): its step-0 checkpoint if it has one, else
    `init_model` (bit-identical to the trainer's initialization: tests/test_baselines.py)."""
    if 0 in steps_in(RunDir(run.workdir).checkpoints):
        return open_run(run.workdir, 0).model, "checkpoint step 0"
    return init_model(run), (f"fresh initialization with the run's seed {run.config.train.seed} (no step-0 "
                             "checkpoint; the trainer's initializer, bit-identical)")


def locality(run, split=None, max_tokens=None, batch_size=None) -> dict:
    """The untrained router's locality on the same tokens `collect.analyse` routes for `run`: {"step0_loc_first_L",
    "step0_loc_any_L", "step0_loc_overlap_L": per MoE layer, "step0_source": where the router comes from}."""
    model, source = untrained(run)
    a = collect.analyse(dataclasses.replace(run, model=model, step=0), split=split, max_tokens=max_tokens, tokens=(),
                        batch_size=batch_size, n_samples=0, n_frequent=0, progress=False)
    return {f"step0_{k}": np.asarray(a.result[k]) for k in ("loc_first_L", "loc_any_L", "loc_overlap_L")} | {
        "step0_source": source}
