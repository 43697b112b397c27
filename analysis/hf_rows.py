"""What the loss-scoring analyses (compare, paths, counterfactual, importance) read of their data, for a run or a
HuggingFace directory alike: validation batches, the domain names, and token counts of the whole split.

    rows = run_rows(run.config, rows_per_domain=4)                        # a run: train.inputs' validation rows
    rows = cache_rows(source.cache, source.run.config, rows_per_domain=4)  # analysis.hf_source's TokenCache
    rows.batches[i]             # tokens, targets, loss_mask, domains, segment_ids, positions [B, L], as eval batches
    scorer = RowsScorer(model, rows, tokenizer)   # analysis.ablate.ablation.Scorer over these batches

For a HF directory the rows are cut from its token cache (--text files, one domain each, or the bundled corpus
re-tokenized) exactly as train.inputs.validation_rows cuts a run's validation split: per domain, packed rows of
seq_len from that domain's documents alone (LM task), then batches of eval.batch_size, the last padded with
loss-free rows.
"""

import dataclasses

import jax
import numpy as np

from analysis.ablate import ablation
from moe import Execution
from moe.model import split_model
from plumbing.errors import UserError
from train import inputs
from train.step import make_eval_step


@dataclasses.dataclass
class Rows:
    batches: list  # eval-style batches
    domain_names: list
    counts_V: np.ndarray  # token id -> count in the whole split (frequency ranks)


def _counts(cache, vocab_size: int) -> np.ndarray:
    return np.bincount(np.asarray(cache.tokens, np.int64), minlength=vocab_size)[:vocab_size]


def run_rows(config, rows_per_domain=None) -> Rows:
    """A run's validation batches (eval.rows_per_domain, or rows_per_domain) and its eval split's counts."""
    cache = inputs.token_cache_for(config.data, config.data.eval_split)
    return Rows(ablation.eval_batches(config, rows_per_domain), list(cache.domain_names),
                _counts(cache, config.model.vocab_size))


def cache_rows(cache, config, rows_per_domain: int) -> Rows:
    """`rows_per_domain` packed rows of every domain of `cache` (fewer where a domain is shorter), in batches of
    config.eval.batch_size. config: the HFRun's (data.seq_len, task "lm")."""
    parts = []
    for dom in np.unique(cache.domains):
        sampler, available = inputs.domain_sampler(config.data, inputs.domain_subset(cache, int(dom)),
                                                   inputs.Targets())
        parts.append(sampler.rows(0, min(rows_per_domain, available)))
    if not parts:
        raise UserError("no documents to score; pass --text files with text")
    rows = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    return Rows(inputs.batches_of(rows, config.eval.batch_size), list(cache.domain_names),
                _counts(cache, config.model.vocab_size))


def routing_batches(rows: Rows) -> list[dict]:
    """The batches with `valid` = scored tokens (loss_mask > 0), what the routing records count."""
    return [dict(b, valid=b["loss_mask"] > 0) for b in rows.batches]


class RowsScorer(ablation.Scorer):
    """analysis.ablate.ablation.Scorer over the batches of `rows` (the same loss, per row and token class, and
    the same compiled pass) instead of a run's validation split."""

    def __init__(self, model, rows: Rows, tokenizer):  # not super().__init__: it reads a run's split
        self.batches = rows.batches
        self.domain_names = list(rows.domain_names)
        self.domain_R = np.concatenate([b["domains"][:, 0] for b in self.batches]).astype(np.int64)
        self.n_classes = len(ablation.TOKEN_CLASSES)
        classes = ablation.class_table(tokenizer, model.cfg.vocab_size)
        self.seg_batches, n_rows = ablation._segment_batches(self.batches, classes, self.n_classes)
        self.shape_RxC = (n_rows, self.n_classes)
        graphdef = split_model(model)[0]
        self.step = jax.jit(make_eval_step(graphdef, n_rows * self.n_classes, Execution()))
