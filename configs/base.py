"""Shared defaults for every config (not a config to run by itself: use default.py, tiny.py or gpu_1b.py).

Every key here can be overridden on the command line, e.g. `--config.train.steps=500`.
"""

import dataclasses

import ml_collections

from moe.config import ModelConfig
from moe.dispatch.execution import execution_fields


def base_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()

    # model.*: the architecture, every field of moe.ModelConfig with its default (moe/config.py says what each
    # means): what a checkpoint must match. execution.*: how it runs (moe/dispatch/execution.py): any execution runs any
    # checkpoint.
    c.model = ml_collections.ConfigDict(dataclasses.asdict(ModelConfig()))
    c.execution = ml_collections.ConfigDict(execution_fields())

    c.data = ml_collections.ConfigDict(dict(
        name="moe_corpus",  # any TFDS text data set prepared as array_record, e.g. "lm1b"
        split="train",
        eval_split="validation",
        text_field="text",
        corpus_dir="",  # moe_corpus only; "" = the bundled corpus (train/data/corpus)
        tfds_data_dir="",  # "" = ~/.cache/moe-lm/tfds
        tokenizer="",  # "" = the bundled train/data/tokenizer.json (8,192); "tokenizer_1k.json": bundled 1,024
        token_cache_dir="",  # "" = ~/.cache/moe-lm/tokens
        seq_len=256,
        task="lm",  # lm: packed rows | prefix: one document per row, input prefix + output (loss on output)
        prefix_frac=0.5,
        windows=False,  # prefix task: cut every document into seq_len windows (all text used), not its start
    ))

    c.train = ml_collections.ConfigDict(dict(
        steps=1000,
        seed=0,
        batch_size=32,  # global, over all devices and hosts
        grad_accum=1,  # micro-batches per step (the routing load is summed over all of them)
        lr=3e-3,
        min_lr_ratio=0.1,
        warmup_steps=100,
        schedule="cosine",  # cosine | wsd (warmup-stable-decay: linear decay over the last decay_frac)
        decay_frac=0.2,
        weight_decay=0.1,  # never on norms or routing biases
        b1=0.9,
        b2=0.95,
        eps=1e-8,
        grad_clip=1.0,
        bias_update_rate=1e-3,  # gamma of aux-loss-free balancing
        bias_update_stop=1.0,  # fraction of the run after which gamma is 0 (DeepSeek-V3 stops it late)
        prefix_loss=False,  # prefix/mixed masks: whether prefix positions carry loss (UniLM: no)
        # with prefix_loss: keep a random subset of a row's targets, as many as its output part has (the
        # equal-targets control: loss on every token's *positions* but no more targets per step than output-only)
        equal_targets=False,
        balance_loss_weight=1e-4,  # alpha of the sequence-wise balance loss; 0 turns it off
        # lambda of the multi-token prediction loss (model.mtp_depth > 0): lambda / D * sum of the depths' losses;
        # mtp_weight until the mtp_weight_switch fraction of the run, mtp_weight_late after (DeepSeek-V3: 0.3, then
        # 0.1 for the last third); validation reports the main loss alone
        mtp_weight=0.3,
        mtp_weight_late=0.1,
        mtp_weight_switch=1.0,
        # JAX's persistent compilation cache (rundir/compile_cache.py): a run that builds the same programs (a
        # resume, another seed) loads them from here; "" turns it off. JAX_COMPILATION_CACHE_DIR, when set, wins.
        # The run's readers cache in the default directory (or nowhere when this is "").
        compile_cache_dir="~/.cache/moe-lm/jax",
    ))

    c.mesh = ml_collections.ConfigDict(dict(data=-1, fsdp=1, expert=1, tensor=1))  # -1: the remaining devices
    c.checkpoint = ml_collections.ConfigDict(dict(every=200, keep=3, async_save=True))
    c.log = ml_collections.ConfigDict(dict(every=10, peak_flops=0.0, tensorboard=True, progress=True))
    # peak_flops: per device, for MFU; 0 measures a large matmul on this device at start.
    # eval.dispatch: "" evaluates with execution.dispatch; "dropless" (or "capacity", one capacity per sequence)
    # makes a row's evaluation loss independent of the other rows in its batch.
    # eval.output_only: prefix task, validation scores the output part even when train.prefix_loss is set (studies)
    c.eval = ml_collections.ConfigDict(dict(every=200, rows_per_domain=8, batch_size=16, dispatch="",
                                            output_only=False))
    return c
