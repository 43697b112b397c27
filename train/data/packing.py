"""Token cache and Megatron-style packed batches, deterministic in (seed, row) and independent of process count.

    src = load_source("moe_corpus", "train")
    cache = token_cache(src)                        # tokenizes once, then loads from ~/.cache/moe-lm/tokens
    sampler = PackedSampler(cache, seq_len=512, seed=0)
    for step, batch in iterate(sampler, start_step, batch_size=64, process_index=0, process_count=1): ...

Packing convention (B batch, L seq_len). Epoch e orders the documents by `np.random.default_rng([seed, e])`;
each document is followed by EOS; epochs are concatenated into one endless stream s. Global row r is
s[r*L : r*L + L + 1] (consecutive rows overlap by one token, so no target is lost): tokens = row[:L],
targets = row[1:]. A document's EOS belongs to that document (it is its last token). For each input token i:
  segment_ids[i]  1, 2, 3 ... numbering the documents met in the row; attention must stay within a segment.
  positions[i]    offset from the start of its segment in this row (0 at each document start and at row start,
                  as Megatron's reset_position_ids; bounded by L-1).
  loss_mask[i]    1 if targets[i] is in the same document as tokens[i], else 0. The only 0s are where the input
                  is an EOS (its target is the next document's first token, which nothing in the segment can
                  predict); predicting a document's own EOS is trained. The first token of each document is
                  therefore never a target.
  domains[i]      domain id of the document tokens[i] belongs to.
"""

import hashlib
import json
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import grain
import numpy as np

from plumbing.errors import UserError
from train.data.tokenizer import DEFAULT_TOKENIZER, EOS_ID, PAD_ID, load_tokenizer, token_dtype

DEFAULT_CACHE_DIR = os.environ.get("MOE_LM_TOKEN_CACHE", os.path.expanduser("~/.cache/moe-lm/tokens"))


@dataclass(frozen=True)
class TokenCache:
    """A tokenized split: document i is tokens[offsets[i]:offsets[i+1]] (no EOS stored), from domain domains[i]."""

    tokens: np.ndarray  # [T] uint16/uint32, memory-mapped
    offsets: np.ndarray  # [N+1] int64
    domains: np.ndarray  # [N] int32
    domain_names: tuple
    eos_id: int = EOS_ID
    pad_id: int = PAD_ID
    key: str = ""  # what the tokens are: the source's key and the tokenizer file's hash ("" when not cached)

    @property
    def n_docs(self) -> int:
        return len(self.domains)

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)


def _file_hash(path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]


def token_cache(source, tokenizer_path=None, cache_dir=None, encode_batch_size=256) -> TokenCache:
    """Tokenize `source` (a `load_source` result) once; later calls load the cached arrays.

    Keyed by (source.key, which names data set, corpus fingerprint and split; tokenizer file hash).
    """
    tokenizer_path = Path(tokenizer_path or DEFAULT_TOKENIZER)
    return token_cache_with(source, load_tokenizer(tokenizer_path), tokenizer_path, cache_dir, encode_batch_size)


def token_cache_with(source, tok, tokenizer_path, cache_dir=None, encode_batch_size=256, eos_id: int = EOS_ID,
                     pad_id: int = PAD_ID) -> TokenCache:
    """`token_cache` with an already loaded tokenizer whose EOS / PAD ids may differ from the bundled 0 / 1 (an
    imported HF model's). Keyed by the tokenizer file's hash: one tokenizer.json shares one cache wherever it is."""
    key = f"{source.key}-{_file_hash(tokenizer_path)}"
    path = Path(cache_dir or DEFAULT_CACHE_DIR) / key
    if not (path / "meta.json").exists():
        _write_cache(source, tok, path, encode_batch_size)
    meta = json.loads((path / "meta.json").read_text())
    return TokenCache(np.load(path / "tokens.npy", mmap_mode="r"), np.load(path / "offsets.npy"),
                      np.load(path / "domains.npy"), tuple(meta["domain_names"]), eos_id, pad_id, key)


def _write_cache(source, tok, path: Path, encode_batch_size: int):
    dtype = token_dtype(tok)
    # Text that spells "<|endoftext|>" must not become EOS: only packing inserts EOS / PAD ids.
    tok.encode_special_tokens = True
    ds = grain.MapDataset.source(source).batch(encode_batch_size, batch_fn=list)
    chunks, lengths, domains = [], [], []
    for exs in ds:
        for enc in tok.encode_batch([ex["text"] for ex in exs], add_special_tokens=False):
            chunks.append(np.asarray(enc.ids, dtype))
            lengths.append(len(enc.ids))
        domains += [ex["domain"] for ex in exs]
    offsets = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    # Write into a temp dir and rename it: a crash or a concurrent writer never leaves a half cache behind.
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    np.save(tmp / "tokens.npy", np.concatenate(chunks) if chunks else np.zeros(0, dtype))
    np.save(tmp / "offsets.npy", offsets)
    np.save(tmp / "domains.npy", np.asarray(domains, np.int32))
    (tmp / "meta.json").write_text(json.dumps({"domain_names": list(source.domains), "key": source.key}))
    try:
        os.rename(tmp, path)
    except OSError:  # another process finished first; its cache is identical
        for f in tmp.iterdir():
            f.unlink()
        tmp.rmdir()


class PackedSampler:
    """Rows of the packed stream described in the module docstring; row r depends only on (cache, seed, r)."""

    def __init__(self, cache: TokenCache, seq_len: int, seed: int, epochs_cached: int = 4):
        self.cache, self.seq_len, self.seed = cache, seq_len, seed
        self.slot_lens = cache.lengths + 1  # each document plus its EOS
        self.epoch_tokens = int(self.slot_lens.sum())
        if cache.n_docs == 0:
            raise ValueError("empty token cache")
        self._epochs: OrderedDict = OrderedDict()
        self._epochs_cached = epochs_cached
        self._lock = threading.Lock()  # iterate() calls rows() from several grain threads

    @property
    def rows_per_epoch(self) -> int:
        return self.epoch_tokens // self.seq_len

    def _epoch(self, e: int):
        """(perm [N], cum [N+1]) for epoch e: slot k holds document perm[k] and starts at stream offset cum[k]."""
        with self._lock:
            return self._epoch_locked(e)

    def _epoch_locked(self, e: int):
        if e not in self._epochs:
            perm = np.random.default_rng([self.seed, e]).permutation(self.cache.n_docs)
            cum = np.zeros(len(perm) + 1, np.int64)
            np.cumsum(self.slot_lens[perm], out=cum[1:])
            self._epochs[e] = (perm, cum)
            if len(self._epochs) > self._epochs_cached:
                self._epochs.popitem(last=False)
        self._epochs.move_to_end(e)
        return self._epochs[e]

    def _lookup(self, pos: np.ndarray):
        """Stream positions -> (token, global slot index, offset in document, domain), each shaped like pos."""
        tok, slot, off, dom = (np.empty(pos.shape, np.int64) for _ in range(4))
        epoch = pos // self.epoch_tokens
        for e in np.unique(epoch):  # a batch spans at most a couple of epochs
            m = epoch == e
            perm, cum = self._epoch(int(e))
            q = pos[m] - e * self.epoch_tokens
            k = np.searchsorted(cum, q, side="right") - 1
            doc = perm[k]
            off[m] = q - cum[k]
            is_eos = off[m] >= self.cache.lengths[doc]
            idx = np.where(is_eos, 0, self.cache.offsets[doc] + off[m])
            tok[m] = np.where(is_eos, self.cache.eos_id, self.cache.tokens[idx])
            slot[m] = e * self.cache.n_docs + k
            dom[m] = self.cache.domains[doc]
        return tok, slot, off, dom

    def rows(self, start: int, count: int) -> dict:
        """Global rows [start, start+count) as a dict of [count, L] arrays (see module docstring)."""
        L = self.seq_len
        pos_BxL1 = (np.arange(start, start + count, dtype=np.int64)[:, None] * L
                    + np.arange(L + 1, dtype=np.int64)[None, :])
        tok_BxL1, slot_BxL1, _, dom_BxL1 = self._lookup(pos_BxL1)
        slot_BxL = slot_BxL1[:, :L]
        seg_BxL = slot_BxL - slot_BxL[:, :1] + 1  # slots are consecutive, every document has >= 1 token
        starts_BxL = np.ones_like(seg_BxL, dtype=bool)
        starts_BxL[:, 1:] = seg_BxL[:, 1:] != seg_BxL[:, :-1]
        idx_BxL = np.broadcast_to(np.arange(L), seg_BxL.shape)
        # Position = index minus the index of the latest segment start at or before it.
        positions_BxL = idx_BxL - np.maximum.accumulate(np.where(starts_BxL, idx_BxL, 0), axis=1)
        return {
            "tokens": tok_BxL1[:, :L].astype(np.int32),
            "targets": tok_BxL1[:, 1:].astype(np.int32),
            "segment_ids": seg_BxL.astype(np.int32),
            "positions": positions_BxL.astype(np.int32),
            "loss_mask": (slot_BxL1[:, 1:] == slot_BxL).astype(np.float32),
            "domains": dom_BxL1[:, :L].astype(np.int32),
        }

    def batch(self, step: int, batch_size: int, process_index: int = 0, process_count: int = 1) -> dict:
        """This process's contiguous slice of global batch `step` (rows step*batch_size ...)."""
        if batch_size % process_count:
            raise UserError(f"batch_size {batch_size} is not divisible by process_count {process_count}; "
                            "pick a global batch size that is a multiple of the number of processes")
        per = batch_size // process_count
        return self.rows(step * batch_size + process_index * per, per)


def eval_batches(cache: TokenCache, seq_len: int, batch_size: int, n_batches: int, seed: int = 0,
                 process_index: int = 0, process_count: int = 1) -> list[dict]:
    """The first n_batches batches of the validation stream with a fixed seed; fewer if that would repeat data."""
    sampler = PackedSampler(cache, seq_len, seed)
    n = max(1, min(n_batches, sampler.rows_per_epoch // batch_size))
    return [sampler.batch(i, batch_size, process_index, process_count) for i in range(n)]


def iterate(sampler: PackedSampler, start_step: int, batch_size: int, process_index: int = 0,
            process_count: int = 1, prefetch: int = 4, threads: int = 2):
    """Endless (step, batch) pairs from start_step, built ahead on grain worker threads.

    Batch `step` is a pure function of step, so resuming at any start_step reproduces the original run exactly.
    """
    # grain maps step -> batch and prefetches on worker threads, keeping step order.
    ds = grain.MapDataset.range(start_step, 1 << 62).map(
        lambda s: (s, sampler.batch(s, batch_size, process_index, process_count)))
    yield from ds.to_iter_dataset(grain.ReadOptions(num_threads=threads, prefetch_buffer_size=prefetch))


def window_documents(cache: TokenCache, seq_len: int) -> TokenCache:
    """Every document cut into consecutive windows, each a document of its own, so that one-document-per-row
    tasks (prefix_rows) train on all of the text rather than each document's first seq_len tokens.

    A window holds seq_len + 1 tokens and the next one starts at its last token (rows overlap by one token, as
    packed rows do, so no target is lost); prefix_rows cuts a full window to exactly its seq_len + 1 tokens, so
    only the document's true last window gets the EOS. A final window of a single token (no target) is dropped,
    so a document of k * seq_len + 1 tokens loses its EOS target (one target in seq_len + 1).
    """
    L1 = seq_len + 1
    lo, hi = cache.offsets[:-1], cache.offsets[1:]
    # document d has k[d] windows starting at lo + j * seq_len (at least one, even for a 1-token document)
    k = np.maximum(-(-(hi - lo - 1) // seq_len), 1)
    doc = np.repeat(np.arange(len(k)), k)
    j = np.arange(len(doc)) - np.repeat(np.cumsum(k) - k, k)
    starts = lo[doc] + j * seq_len
    ends = np.minimum(starts + L1, hi[doc])
    keep = (ends - starts >= 2) | (k[doc] == 1)
    starts, ends, doc = starts[keep], ends[keep], doc[keep]
    lengths = ends - starts
    offsets = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    # one gather instead of a slice per window: window w's tokens are tokens[starts[w] : ends[w]]
    index = np.repeat(starts - offsets[:-1], lengths) + np.arange(offsets[-1])
    tokens = np.asarray(cache.tokens[index]) if len(index) else np.zeros(0, cache.tokens.dtype)
    doms = np.asarray(cache.domains[doc], np.int32)
    return TokenCache(tokens, offsets, doms, cache.domain_names, cache.eos_id, cache.pad_id)


def prefix_rows(cache: TokenCache, seq_len: int, seed: int, start: int, count: int,
                prefix_frac: float = 0.5) -> dict:
    """One document per row for prefix-LM vs causal-LM experiments; row r is document perm_e[r % N], e = r // N.

    The row is the document plus EOS, cut to L+1 tokens and padded with PAD; tokens = row[:L], targets = row[1:].
    prefix_len [B] = round(prefix_frac * n) clipped to [1, n-1] for the n real tokens of the row: tokens[:prefix_len]
    are the input part (a prefix LM attends bidirectionally there). loss_mask is 1 exactly where the target is in
    the output part, i.e. i in [prefix_len-1, n-1): the first output token is predicted from the last prefix token.
    segment_ids are 1 on real tokens and 0 on padding; positions count from 0 (0 on padding).
    """
    L, N = seq_len, cache.n_docs
    rows = np.arange(start, start + count)
    tok_BxL1 = np.full((count, L + 1), cache.pad_id, np.int32)
    dom_B = np.zeros(count, np.int32)
    n_B = np.zeros(count, np.int64)
    sampler = PackedSampler(cache, seq_len, seed)
    for b, r in enumerate(rows):
        perm, _ = sampler._epoch(int(r // N))
        doc = perm[r % N]
        toks = np.append(cache.tokens[cache.offsets[doc]:cache.offsets[doc + 1]], cache.eos_id)[: L + 1]
        tok_BxL1[b, : len(toks)] = toks
        n_B[b], dom_B[b] = len(toks), cache.domains[doc]
    prefix_B = np.clip(np.round(prefix_frac * n_B), 1, n_B - 1).astype(np.int32)
    idx_BxL = np.broadcast_to(np.arange(L), (count, L))
    real_BxL = idx_BxL < n_B[:, None]
    loss_BxL = (idx_BxL >= prefix_B[:, None] - 1) & (idx_BxL < n_B[:, None] - 1)
    return {
        "tokens": tok_BxL1[:, :L],
        "targets": tok_BxL1[:, 1:],
        "segment_ids": real_BxL.astype(np.int32),
        "positions": np.where(real_BxL, idx_BxL, 0).astype(np.int32),
        "loss_mask": loss_BxL.astype(np.float32),
        "domains": np.where(real_BxL, dom_B[:, None], 0).astype(np.int32),
        "prefix_len": prefix_B,
    }
