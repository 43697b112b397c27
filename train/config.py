"""From an ml_collections config to what the code uses: moe.ModelConfig, checked train/mesh/data values."""

import dataclasses
import json

import ml_collections

from moe import ConfigError, ModelConfig
from train.errors import UserError


def model_config(c: ml_collections.ConfigDict) -> ModelConfig:
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(c.model.keys()) - fields)
    if unknown:
        raise UserError(f"unknown config key model.{unknown[0]}; model keys are: {', '.join(sorted(fields))}")
    try:
        return ModelConfig(**c.model.to_dict())
    except (ConfigError, TypeError) as e:
        raise UserError(str(e)) from None


def check(c: ml_collections.ConfigDict) -> ModelConfig:
    """Validate the whole config; returns the model config. Raises UserError naming the bad key."""
    mcfg = model_config(c)
    t = c.train
    for key in ("steps", "batch_size", "grad_accum"):
        if int(t[key]) <= 0:
            raise UserError(f"train.{key} must be a positive integer, got {t[key]}")
    if t.batch_size % t.grad_accum:
        raise UserError(f"train.batch_size ({t.batch_size}) must be divisible by train.grad_accum ({t.grad_accum})")
    if t.schedule not in ("cosine", "wsd"):
        raise UserError(f"train.schedule must be 'cosine' or 'wsd', got {t.schedule!r}")
    if not 0 <= t.bias_update_stop <= 1:
        raise UserError(f"train.bias_update_stop is a fraction of the run in [0, 1], got {t.bias_update_stop}")
    if c.data.task not in ("lm", "prefix"):
        raise UserError(f"data.task must be 'lm' or 'prefix', got {c.data.task!r}")
    if c.data.task == "prefix" and mcfg.mask == "bidirectional":
        raise UserError("data.task='prefix' trains next-token prediction: use model.mask causal, prefix or mixed")
    if mcfg.mask in ("prefix", "mixed") and c.data.task != "prefix":
        raise UserError(f"model.mask={mcfg.mask!r} needs a per-row prefix: set data.task='prefix'")
    if int(c.data.seq_len) <= 1:
        raise UserError(f"data.seq_len must be > 1, got {c.data.seq_len}")
    if mcfg.attention_impl == "cudnn" and int(c.data.seq_len) % 2:
        raise UserError(f"model.attention_impl='cudnn' trains only even sequence lengths (a cuDNN limit with a "
                        f"mask), got data.seq_len={c.data.seq_len}; use an even length or attention_impl='xla'")
    for key in ("every", "keep"):
        if int(c.checkpoint[key]) <= 0:
            raise UserError(f"checkpoint.{key} must be a positive integer, got {c.checkpoint[key]}")
    if int(c.log.every) <= 0 or int(c.eval.every) <= 0:
        raise UserError("log.every and eval.every must be positive integers")
    for key in ("data", "fsdp", "expert", "tensor"):
        if int(c.mesh[key]) == 0 or int(c.mesh[key]) < -1:
            raise UserError(f"mesh.{key} must be a positive integer or -1 (the remaining devices), got {c.mesh[key]}")
    return mcfg


def to_json(c: ml_collections.ConfigDict) -> str:
    return json.dumps(c.to_dict(), sort_keys=True, indent=1)
