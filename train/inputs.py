"""Training and validation rows: packed LM rows, prefix-task rows (one document each) or masked-LM windows.

Everything below the three entry points at the end (`sampler`, `eval_rows`, `eval_batches`, which take the run
config) takes the data section (rundir.run_config.DataConfig) and the few values it needs explicitly.
"""

import dataclasses
from pathlib import Path

import numpy as np

from plumbing.errors import UserError
from train.data import packing, tfds_corpus
from train.data.tokenizer import DEFAULT_TOKENIZER, load_tokenizer


class PrefixSampler:
    """Input->output rows: the first `prefix_frac` of each document is the input, loss on the output only
    (or everywhere with `prefix_loss`). `equal_targets` (with prefix_loss): a random subset of every real target,
    as many as the row's output part has, fixed by (seed, row): the positions of prefix_loss, the count of
    output-only. Same `.batch` interface as packing.PackedSampler."""

    def __init__(self, cache, seq_len: int, seed: int, prefix_frac: float, prefix_loss: bool,
                 equal_targets: bool = False):
        self.cache, self.seq_len, self.seed = cache, seq_len, seed
        self.prefix_frac, self.prefix_loss, self.equal_targets = prefix_frac, prefix_loss, equal_targets

    def rows(self, start: int, count: int) -> dict:
        rows = packing.prefix_rows(self.cache, self.seq_len, self.seed, start, count, self.prefix_frac)
        if self.prefix_loss:  # every real target, prefix included
            n_out_B = rows["loss_mask"].sum(-1).astype(np.int64)
            n_B = rows["segment_ids"].sum(-1)
            rows["loss_mask"] = (np.arange(self.seq_len)[None] < n_B[:, None] - 1).astype(np.float32)
            if self.equal_targets:
                rows["loss_mask"] = equal_count_subset(n_B - 1, n_out_B, self.seq_len, self.seed, start)
        return rows

    def batch(self, step: int, batch_size: int, process_index: int = 0, process_count: int = 1) -> dict:
        per = batch_size // process_count
        return self.rows(step * batch_size + process_index * per, per)


def equal_count_subset(n_targets_B, keep_B, seq_len: int, seed: int, start: int):
    """loss_mask [B, L]: for row b (global index start + b), keep_B[b] of its first n_targets_B[b] positions,
    drawn without replacement by a generator keyed on (seed, row), so a row's subset never depends on the batch."""
    mask = np.zeros((len(keep_B), seq_len), np.float32)
    for b, (n, k) in enumerate(zip(n_targets_B, keep_B)):
        rng = np.random.default_rng((seed, start + b, 1))  # 1: a stream apart from MLMSampler's (seed, row)
        mask[b, rng.choice(int(n), size=int(k), replace=False)] = 1.0
    return mask


class MLMSampler:
    """Masked-LM rows (the encoder task where Su proposed mixed heads): one window per row; each real token is
    chosen with probability `rate` (at least one per row), replaced by `mask_id` (an id past the tokenizer's
    vocabulary), and predicted at its own position: targets = the original tokens, loss on the chosen positions.
    prefix_len = the row's length, so a `mixed` mask splits its heads into lower- and upper-triangular over the
    whole row. The choice depends only on (seed, row), so validation rows are fixed."""

    def __init__(self, cache, seq_len: int, seed: int, mask_id: int, rate: float = 0.15):
        self.cache, self.seq_len, self.seed, self.mask_id, self.rate = cache, seq_len, seed, mask_id, rate

    def rows(self, start: int, count: int) -> dict:
        rows = packing.prefix_rows(self.cache, self.seq_len, self.seed, start, count, 0.5)
        orig, n_B = rows["tokens"], rows["segment_ids"].sum(-1)
        chosen = np.zeros(orig.shape, bool)
        for b in range(count):
            rng = np.random.default_rng((self.seed, start + b))
            c = rng.random(n_B[b]) < self.rate
            c[rng.integers(n_B[b])] = True
            chosen[b, : n_B[b]] = c
        rows.update(tokens=np.where(chosen, self.mask_id, orig).astype(orig.dtype), targets=orig,
                    loss_mask=chosen.astype(np.float32), prefix_len=n_B.astype(np.int32))
        return rows

    def batch(self, step: int, batch_size: int, process_index: int = 0, process_count: int = 1) -> dict:
        per = batch_size // process_count
        return self.rows(step * batch_size + process_index * per, per)


def mask_id(data_cfg) -> int:
    """The masked-LM [MASK] id: the first id past the tokenizer's vocabulary (model.vocab_size must cover it)."""
    return load_tokenizer(tokenizer_path(data_cfg)).get_vocab_size()


def tokenizer_path(data_cfg) -> Path:
    path = Path(data_cfg.tokenizer) if data_cfg.tokenizer else DEFAULT_TOKENIZER
    if not path.exists() and (DEFAULT_TOKENIZER.parent / path).is_file():
        path = DEFAULT_TOKENIZER.parent / path  # a bundled tokenizer by name, e.g. "tokenizer_1k.json"
    load_tokenizer(path)  # fails early, with a one-line message, on a missing or broken file
    return path


def token_cache_for(data_cfg, split: str):
    src = tfds_corpus.load_source(data_cfg.name, split, data_dir=data_cfg.tfds_data_dir or None,
                                  corpus_dir=data_cfg.corpus_dir or None, text_field=data_cfg.text_field)
    cache = packing.token_cache(src, tokenizer_path(data_cfg), cache_dir=data_cfg.token_cache_dir or None)
    if cache.n_docs == 0:
        raise UserError(f"data set {data_cfg.name!r} split {split!r} has no documents; check data.name/data.split")
    return cache


def task_cache(data_cfg, split: str):
    """The split's token cache as the task reads it: windowed documents for the prefix task with data.windows
    and always for the masked-LM task."""
    cache = token_cache_for(data_cfg, split)
    if data_cfg.task == "mlm" or data_cfg.task == "prefix" and data_cfg.windows:
        cache = packing.window_documents(cache, data_cfg.seq_len)
    return cache


@dataclasses.dataclass(frozen=True)
class Targets:
    """Which positions of a prefix-task row carry loss: the output part only (prefix_loss False), every real target
    (prefix_loss), or a subset of every target as large as the output part (equal_targets). LM and masked-LM rows
    ignore it."""

    prefix_loss: bool = False
    equal_targets: bool = False


def targets(rc, evaluation: bool = False) -> Targets:
    """The run's Targets from train.prefix_loss / train.equal_targets; evaluation: eval.output_only (studies)
    scores the output part whatever training scores."""
    loss_all = rc.train.prefix_loss and not (evaluation and rc.eval.output_only)
    return Targets(loss_all, loss_all and rc.train.equal_targets)


def train_sampler(data_cfg, seed: int, tgt: Targets):
    """(sampler over the training split, its domain names): `.batch(step, batch_size, ...)` is a pure function of
    (seed, step)."""
    d = data_cfg
    cache = task_cache(d, d.split)
    if d.task == "prefix":
        return PrefixSampler(cache, d.seq_len, seed, d.prefix_frac, tgt.prefix_loss, tgt.equal_targets), \
            cache.domain_names
    if d.task == "mlm":
        return MLMSampler(cache, d.seq_len, seed, mask_id(d)), cache.domain_names
    return packing.PackedSampler(cache, d.seq_len, seed), cache.domain_names


def domain_subset(cache, domain: int):
    """A TokenCache of one domain's documents (validation splits are small, so copying is cheap)."""
    docs = np.nonzero(cache.domains == domain)[0]
    pieces = [np.asarray(cache.tokens[cache.offsets[i]:cache.offsets[i + 1]]) for i in docs]
    offsets = np.zeros(len(docs) + 1, np.int64)
    np.cumsum([len(p) for p in pieces], out=offsets[1:])
    return dataclasses.replace(cache, tokens=np.concatenate(pieces), offsets=offsets,
                               domains=cache.domains[docs])


def domain_sampler(data_cfg, sub, tgt: Targets):
    """(sampler, rows in one pass) over one domain's documents: one window per row for the masked-LM task, one
    document per row for the prefix task, packed rows of seq_len for LM (at least one row, so a short domain still
    has a padded row)."""
    d = data_cfg
    if d.task == "mlm":
        return MLMSampler(sub, d.seq_len, 0, mask_id(d)), sub.n_docs
    if d.task == "prefix":
        return PrefixSampler(sub, d.seq_len, 0, d.prefix_frac, tgt.prefix_loss, tgt.equal_targets), sub.n_docs
    sampler = packing.PackedSampler(sub, d.seq_len, 0)
    return sampler, max(1, sampler.rows_per_epoch)


def validation_rows(data_cfg, rows_per_domain: int, tgt: Targets) -> dict:
    """The fixed validation set: `rows_per_domain` rows of every domain, so per-domain losses compare.

    LM task: rows packed from that domain's validation documents alone. Prefix task: one document per row.
    """
    cache = task_cache(data_cfg, data_cfg.eval_split)
    parts = []
    for dom in np.unique(cache.domains):
        sampler, available = domain_sampler(data_cfg, domain_subset(cache, int(dom)), tgt)
        parts.append(sampler.rows(0, min(rows_per_domain, available)))
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def batches_of(rows: dict, batch_size: int, process_index: int = 0, process_count: int = 1) -> list[dict]:
    """`rows` cut into global batches of batch_size (the last padded with loss-free rows), then this process's
    slice of each."""
    n = len(rows["tokens"])
    pad = -n % batch_size
    if pad:
        rows = {k: np.concatenate([v, np.repeat(v[-1:], pad, 0)]) for k, v in rows.items()}
        rows["loss_mask"][n:] = 0.0
    per = batch_size // process_count
    return [{k: v[i + process_index * per: i + (process_index + 1) * per] for k, v in rows.items()}
            for i in range(0, n + pad, batch_size)]


# The run config's entry points: the only functions here that read more than the data config.


def sampler(rc):
    """The training sampler of a run config and its domain names."""
    return train_sampler(rc.data, rc.train.seed, targets(rc))


def eval_rows(rc) -> dict:
    """A run config's validation rows (eval.rows_per_domain per domain, scored as evaluation scores them)."""
    return validation_rows(rc.data, rc.eval.rows_per_domain, targets(rc, evaluation=True))


def eval_batches(rc, process_index: int = 0, process_count: int = 1) -> list[dict]:
    """A run config's validation batches of eval.batch_size, this process's slice of each."""
    return batches_of(eval_rows(rc), rc.eval.batch_size, process_index, process_count)


def check_vocab(data_cfg, vocab_size: int) -> None:
    n = load_tokenizer(tokenizer_path(data_cfg)).get_vocab_size()
    if data_cfg.task == "mlm" and n >= vocab_size:
        raise UserError(f"data.task='mlm' needs a [MASK] id past the tokenizer's {n} tokens; set "
                        f"--config.model.vocab_size={n + 1}")
    if n > vocab_size:
        raise UserError(f"the tokenizer has {n} tokens but model.vocab_size is {vocab_size}; "
                        f"set --config.model.vocab_size={n} or larger")
