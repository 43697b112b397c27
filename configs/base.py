"""Shared defaults for every config (not a config to run by itself: use default.py, tiny.py or gpu_1b.py).

Every key of a run config at its default: rundir/run_config.py declares each one, with its checks and what it
means (`python -m train --help` prints them). Any key can be overridden on the command line, e.g.
`--config.train.steps=500`.
"""

import ml_collections

from rundir.run_config import RunConfig


def base_config() -> ml_collections.ConfigDict:
    return ml_collections.ConfigDict(RunConfig().to_dict())
