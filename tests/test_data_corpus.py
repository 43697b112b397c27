"""Corpus files, the moe_corpus TFDS builder (prepared into tmp dirs, no TensorFlow) and the bundled tokenizer."""

import json
import lzma

import pytest

from plumbing.errors import UserError
from train.data import tfds_corpus
from train.data.tfds_corpus import DEFAULT_CORPUS_DIR, corpus_files, load_source, read_docs, validation_ids
from train.data.tokenizer import EOS_ID, PAD_ID, load_tokenizer


def _docs(prefix, n):
    return [f"{prefix} document {i}: " + " ".join(["word"] * (i % 7 + 1)) for i in range(n)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    corpus = root / "corpus"
    corpus.mkdir()
    docs = {"alpha": _docs("alpha", 30), "beta": _docs("beta", 25), "gamma": _docs("gamma", 22)}
    (corpus / "alpha.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs["alpha"]))
    (corpus / "beta.txt").write_text("\n\n".join(docs["beta"]) + "\n")
    with lzma.open(corpus / "gamma.jsonl.xz", "wt") as f:
        f.writelines(json.dumps({"text": d}) + "\n" for d in docs["gamma"])
    return corpus, root / "tfds", docs


def test_prepare_and_read_back(tiny):
    corpus, data_dir, docs = tiny
    train = load_source("moe_corpus", "train", data_dir=data_dir, corpus_dir=corpus)
    val = load_source("moe_corpus", "validation", data_dir=data_dir, corpus_dir=corpus)
    assert train.domains == val.domains == ["alpha", "beta", "gamma"]
    got = {}
    for src in (train, val):
        for i in range(len(src)):
            ex = src[i]
            got.setdefault(ex["domain"], []).append(ex["text"])
    for d, name in enumerate(train.domains):
        assert sorted(got[d]) == sorted(docs[name])  # every document once, with the right label
    val_texts = {val[i]["text"] for i in range(len(val))}
    for ds in docs.values():
        want = {ds[i] for i in validation_ids(ds)}
        assert want <= val_texts and 1 <= len(want) <= len(ds) // 5
    assert not val_texts & {train[i]["text"] for i in range(len(train))}
    assert train.key.endswith("-train") and val.key.endswith("-validation")


def test_changed_corpus_is_reprepared(tiny, tmp_path):
    corpus, _, docs = tiny
    copy = tmp_path / "corpus"
    copy.mkdir()
    for f in corpus.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    before = load_source("moe_corpus", "train", data_dir=tmp_path / "tfds", corpus_dir=copy)
    (copy / "beta.txt").write_text("\n\n".join(docs["beta"] + ["a brand new beta document"]))
    after = load_source("moe_corpus", "train", data_dir=tmp_path / "tfds", corpus_dir=copy)
    assert before.key != after.key
    assert "a brand new beta document" in {after[i]["text"] for i in range(len(after))}


def test_validation_split_is_stable():
    docs = _docs("x", 200)
    val = {docs[i] for i in validation_ids(docs)}
    shuffled = docs[::-1]
    assert len(val) == 20 and val == {shuffled[i] for i in validation_ids(shuffled)}  # by content, not order


def test_empty_file_names_file(tmp_path):
    (tmp_path / "ok.jsonl").write_text(json.dumps({"text": "fine"}) + "\n")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(UserError, match="empty.jsonl"):
        load_source("moe_corpus", "train", data_dir=tmp_path / "tfds", corpus_dir=tmp_path)


def test_non_utf8_file_names_file(tmp_path):
    (tmp_path / "latin.txt").write_bytes("caf\xe9 au lait\n\nsecond".encode("latin-1"))
    with pytest.raises(UserError, match="latin.txt"):
        read_docs(tmp_path / "latin.txt")
    with pytest.raises(UserError, match="latin.txt"):
        load_source("moe_corpus", "train", data_dir=tmp_path / "tfds", corpus_dir=tmp_path)


def test_bad_inputs_are_user_errors(tmp_path):
    with pytest.raises(UserError, match="not found"):
        corpus_files(tmp_path / "missing")
    with pytest.raises(UserError, match="tfds build"):
        load_source("no_such_dataset_xyz", "train", data_dir=tmp_path)
    with pytest.raises(UserError, match="tok.json"):
        load_tokenizer(tmp_path / "tok.json")
    (tmp_path / "bad.jsonl").write_text("not json\n")
    with pytest.raises(UserError, match="bad.jsonl line 1"):
        read_docs(tmp_path / "bad.jsonl")


def test_bundled_corpus_and_tokenizer():
    files = corpus_files(DEFAULT_CORPUS_DIR)
    assert len(files) >= 8 and (DEFAULT_CORPUS_DIR / "NOTICE.md").exists()
    assert len(tfds_corpus.fingerprint(DEFAULT_CORPUS_DIR)) == 16
    tok = load_tokenizer()
    assert tok.get_vocab_size() == 8192
    assert (tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|pad|>")) == (EOS_ID, PAD_ID)
    text = "def f(x):\n    return x ** 2  # café, ∑"
    ids = tok.encode(text, add_special_tokens=False).ids
    assert tok.decode(ids) == text and EOS_ID not in ids
