"""Packed batches: document isolation, stream reconstruction, masks, determinism, process slicing, resume."""

import itertools

import numpy as np
import pytest

from plumbing.errors import UserError
from train.data.packing import (
    PackedSampler,
    TokenCache,
    eval_batches,
    iterate,
    prefix_rows,
    token_cache,
    window_documents,
)
from train.data.tokenizer import EOS_ID, PAD_ID, load_tokenizer

L = 16


@pytest.fixture(scope="module")
def cache():
    """Synthetic cache: 23 documents of 1-40 tokens (ids >= 2, so EOS/PAD never occur inside a document)."""
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 41, size=23)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    tokens = rng.integers(2, 500, size=offsets[-1]).astype(np.uint16)
    return TokenCache(tokens, offsets, rng.integers(0, 3, size=23).astype(np.int32), ("a", "b", "c"))


def stream(cache, seed, epochs):
    """Reference: the packed stream built the slow, obvious way, with each token's document slot and domain."""
    toks, slots, doms = [], [], []
    for e in range(epochs):
        for k, d in enumerate(np.random.default_rng([seed, e]).permutation(cache.n_docs)):
            doc = list(cache.tokens[cache.offsets[d]:cache.offsets[d + 1]]) + [EOS_ID]
            toks += doc
            slots += [e * cache.n_docs + k] * len(doc)
            doms += [cache.domains[d]] * len(doc)
    return np.array(toks), np.array(slots), np.array(doms)


def test_rows_match_reference_stream(cache):
    sampler = PackedSampler(cache, L, seed=3)
    n_rows = 3 * sampler.rows_per_epoch  # crosses two epoch boundaries
    toks, slots, doms = stream(cache, 3, 4)
    b = sampler.rows(0, n_rows)
    for r in range(n_rows):
        s = slice(r * L, r * L + L)
        np.testing.assert_array_equal(b["tokens"][r], toks[s])
        np.testing.assert_array_equal(b["targets"][r], toks[r * L + 1: r * L + L + 1])
        np.testing.assert_array_equal(b["domains"][r], doms[s])
        # Segments change exactly where the document slot changes and count up from 1.
        row_slots = slots[s]
        np.testing.assert_array_equal(b["segment_ids"][r], row_slots - row_slots[0] + 1)
        # Positions: 0 at row start and at each document start, then +1.
        want_pos, p = [], 0
        for i in range(L):
            p = 0 if i == 0 or row_slots[i] != row_slots[i - 1] else p + 1
            want_pos.append(p)
        np.testing.assert_array_equal(b["positions"][r], want_pos)
        # Loss only where input and target are in the same document: here exactly where the input is not EOS.
        np.testing.assert_array_equal(b["loss_mask"][r], slots[r * L + 1: r * L + L + 1] == row_slots)
        np.testing.assert_array_equal(b["loss_mask"][r], b["tokens"][r] != EOS_ID)
    assert {k: v.dtype for k, v in b.items()} == {
        "tokens": np.int32, "targets": np.int32, "segment_ids": np.int32, "positions": np.int32,
        "loss_mask": np.float32, "domains": np.int32}


def test_rows_overlap_by_one(cache):
    b = PackedSampler(cache, L, seed=0).rows(0, 10)
    np.testing.assert_array_equal(b["targets"][:-1, -1], b["tokens"][1:, 0])


def test_deterministic_and_seed_dependent(cache):
    a = PackedSampler(cache, L, seed=1).batch(7, 8)
    b = PackedSampler(cache, L, seed=1).batch(7, 8)
    c = PackedSampler(cache, L, seed=2).batch(7, 8)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])
    assert not np.array_equal(a["tokens"], c["tokens"])
    # Row content does not depend on what was asked before (epoch cache order, batch composition).
    fresh = PackedSampler(cache, L, seed=1)
    fresh.rows(1000, 4)
    np.testing.assert_array_equal(fresh.rows(57, 3)["tokens"], a["tokens"][1:4])


@pytest.mark.parametrize("process_count", [1, 2, 4])
def test_process_slices_concatenate_to_global_batch(cache, process_count):
    sampler = PackedSampler(cache, L, seed=5)
    full = sampler.batch(3, 8)
    parts = [sampler.batch(3, 8, i, process_count) for i in range(process_count)]
    for k in full:
        np.testing.assert_array_equal(np.concatenate([p[k] for p in parts]), full[k])


def test_indivisible_batch_is_user_error(cache):
    with pytest.raises(UserError, match="process_count"):
        PackedSampler(cache, L, seed=0).batch(0, 6, 0, 4)


def test_iterate_resumes_exactly(cache):
    sampler = PackedSampler(cache, L, seed=9)
    from_zero = list(itertools.islice(iterate(sampler, 0, 4, 1, 2), 6))
    resumed = list(itertools.islice(iterate(sampler, 4, 4, 1, 2), 2))
    assert [s for s, _ in from_zero] == list(range(6)) and [s for s, _ in resumed] == [4, 5]
    for (_, a), (_, b) in zip(from_zero[4:], resumed):
        for k in a:
            np.testing.assert_array_equal(a[k], b[k])


def test_eval_batches_fixed(cache):
    a = eval_batches(cache, L, batch_size=4, n_batches=100)
    b = eval_batches(cache, L, batch_size=4, n_batches=100)
    assert len(a) == PackedSampler(cache, L, 0).rows_per_epoch // 4  # capped: never repeats documents
    np.testing.assert_array_equal(a[-1]["tokens"], b[-1]["tokens"])


def test_prefix_rows(cache):
    b = prefix_rows(cache, L, seed=4, start=0, count=cache.n_docs + 2, prefix_frac=0.5)
    perm = np.random.default_rng([4, 0]).permutation(cache.n_docs)
    for r in range(cache.n_docs):
        d = perm[r]
        doc = list(cache.tokens[cache.offsets[d]:cache.offsets[d + 1]]) + [EOS_ID]
        row = (doc + [PAD_ID] * (L + 1))[: L + 1]
        n = min(len(doc), L + 1)
        P = b["prefix_len"][r]
        np.testing.assert_array_equal(b["tokens"][r], row[:L])
        np.testing.assert_array_equal(b["targets"][r], row[1:])
        assert 1 <= P <= n - 1 and abs(P - n / 2) <= 1
        np.testing.assert_array_equal(b["segment_ids"][r], np.arange(L) < n)
        # Loss exactly on targets in the output part: target index i+1 in [P, n).
        np.testing.assert_array_equal(b["loss_mask"][r], (np.arange(L) + 1 >= P) & (np.arange(L) + 1 < n))
        assert (b["domains"][r][: min(n, L)] == cache.domains[d]).all()
    again = prefix_rows(cache, L, seed=4, start=cache.n_docs, count=2)  # deterministic in (seed, row)
    np.testing.assert_array_equal(again["tokens"], b["tokens"][cache.n_docs:])


class _ListSource:
    """Minimal stand-in for a load_source() result."""

    def __init__(self, texts):
        self.texts, self.key, self.domains = texts, "list-test", ["x", "y"]

    def __len__(self):
        return len(self.texts)

    def __getitem__(self, i):
        return {"text": self.texts[i], "domain": i % 2}


def test_token_cache_with_bundled_tokenizer(tmp_path):
    texts = [f"Document number {i}. " * (i + 1) for i in range(4)] + ["literal <|endoftext|> and <|pad|>"]
    c = token_cache(_ListSource(texts), cache_dir=tmp_path)
    tok = load_tokenizer()
    for i, t in enumerate(texts):
        assert tok.decode(list(c.tokens[c.offsets[i]:c.offsets[i + 1]])) == t
    np.testing.assert_array_equal(c.domains, [0, 1, 0, 1, 0])
    assert not np.isin(c.tokens, [EOS_ID, PAD_ID]).any()  # special ids come only from packing
    assert c.domain_names == ("x", "y") and c.tokens.dtype == np.uint16
    again = token_cache(_ListSource(["ignored: loaded from cache"]), cache_dir=tmp_path)
    assert again.n_docs == 5


def test_window_documents_train_on_every_target_once():
    """Windowed prefix rows: every (token -> next token) pair of every document, the EOS included, is a target
    in exactly one row; mid-document windows carry no EOS."""
    lengths = [10, 3, 1, 9]  # 9 = 2 * L + 1: the last full window ends the document
    toks = np.arange(2, 2 + sum(lengths), dtype=np.uint16)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    cache = TokenCache(toks, offsets, np.array([0, 1, 0, 1], np.int32), ("a", "b"))
    L = 4
    win = window_documents(cache, L)
    assert win.lengths.tolist() == [5, 5, 2, 3, 1, 5, 5]
    assert win.domains.tolist() == [0, 0, 0, 1, 0, 1, 1]
    rows = prefix_rows(win, L, seed=0, start=0, count=win.n_docs, prefix_frac=0.5)
    pairs = []
    for b in range(win.n_docs):
        real = (rows["segment_ids"][b] > 0) & (rows["targets"][b] != PAD_ID)  # the last real token's target is PAD
        pairs += [(int(t), int(u)) for t, u in zip(rows["tokens"][b][real], rows["targets"][b][real])]
    want = []
    for lo, hi in zip(offsets[:-1], offsets[1:]):
        doc = toks[lo:hi].tolist()
        want += list(zip(doc, doc[1:])) + ([(doc[-1], EOS_ID)] if (hi - lo - 1) % L or hi - lo == 1 else [])
    assert sorted(pairs) == sorted(want)
    eos_rows = [b for b in range(win.n_docs) if EOS_ID in rows["targets"][b]]
    assert len(eos_rows) == 3  # only true document ends (the 9-token document's EOS has no window of its own)


def _window_documents_loop(cache, L):
    """The plain reference: one slice per window, document by document."""
    windows, doms = [], []
    for d, (lo, hi) in enumerate(zip(cache.offsets[:-1], cache.offsets[1:])):
        starts = list(range(lo, max(hi - 1, lo + 1), L))
        for s in starts:
            if min(s + L + 1, hi) - s >= 2 or len(starts) == 1:
                windows.append(cache.tokens[s:min(s + L + 1, hi)])
                doms.append(cache.domains[d])
    return windows, doms


def test_window_documents_equals_the_plain_loop_on_random_documents():
    rng = np.random.default_rng(0)
    for _ in range(50):
        lengths = rng.integers(0, 30, rng.integers(1, 9))  # empty and 1-token documents included
        toks = rng.integers(2, 60, lengths.sum()).astype(np.uint16)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        cache = TokenCache(toks, offsets, rng.integers(0, 3, len(lengths)).astype(np.int32), ("a", "b", "c"))
        for L in (1, 2, 5, 16):
            win = window_documents(cache, L)
            want, doms = _window_documents_loop(cache, L)
            got = [win.tokens[a:b] for a, b in zip(win.offsets[:-1], win.offsets[1:])]
            assert len(got) == len(want) and all(np.array_equal(g, w) for g, w in zip(got, want))
            assert win.domains.tolist() == doms and win.tokens.dtype == toks.dtype
