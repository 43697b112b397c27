"""Opening a run for reading: what export, generation and every analysis use (never the trainer's lock)."""

import dataclasses
import functools
from pathlib import Path

import tokenizers

from plumbing.errors import ConfigError, UserError, warn
from rundir import checkpoints, compile_cache, metrics
from rundir.config_layout import up_to_date
from rundir.layout import RunDir
from rundir.run_config import RunConfig

# What a reader's user can do about an unwritable cache directory (the reading commands take no config flags).
READER_FIX = ("set JAX_COMPILATION_CACHE_DIR to a writable directory, or JAX_ENABLE_COMPILATION_CACHE=false to read "
              "without the cache and this note")


@dataclasses.dataclass
class Run:
    """One checkpoint of a run: its model (params + routing biases), run config and tokenizer."""

    workdir: Path
    step: int
    model: object  # moe.Transformer
    config: RunConfig
    meta: dict  # the checkpoint's metadata (rundir.checkpoints)

    @property
    def tokenizer_json(self) -> str:
        return self.meta["tokenizer"]

    @functools.cached_property
    def tokenizer(self) -> tokenizers.Tokenizer:
        return tokenizers.Tokenizer.from_str(self.tokenizer_json)

    @property
    def moe_layer_ids(self) -> list[int]:
        return list(self.model.cfg.moe_layer_ids)

    def metrics(self) -> list[dict]:
        return metrics.read_rows(RunDir(self.workdir).metrics)


def open_run(workdir, step: int | None = None, log=warn) -> Run:
    """Checkpoint `step` of the run in `workdir` (default: the newest readable one). UserError if there is none."""
    root = Path(workdir)
    if not root.is_dir():
        what = "is a file, not a run directory" if root.exists() else "does not exist"
        raise UserError(f"--workdir {root} {what}; pass a run directory written by `python -m train`")
    model, meta = checkpoints.restore_model(RunDir(root).checkpoints, step, log)
    try:
        config = RunConfig.parse(up_to_date(meta["config"]))
    except (ConfigError, TypeError) as e:
        raise UserError(f"--workdir {root}: its checkpoint's run config cannot be read by this version "
                        f"({' '.join(str(e).split())}); use the moe-lm version that wrote it") from None
    # A second analysis, export or generation of the run loads its programs from the reader's cache; a run that
    # turned its cache off, or was saved before the setting existed, is read with it off.
    compile_cache.enable(compile_cache.reader_dir(config.train.compile_cache_dir), log, READER_FIX)
    return Run(root, int(meta["step"]), model, config, meta)
