"""Train the bundled byte-level BPE tokenizer on the train split of the corpus (developers only).

    python -m train.data.build_tokenizer [--corpus-dir train/data/corpus] [--out train/data/tokenizer.json]

Byte-level so every input is encodable; ids 0 and 1 are `<|endoftext|>` (EOS and document separator) and `<|pad|>`.
The split is the one the TFDS builder makes (same hash rule), so validation text never shapes the vocabulary.
"""

import argparse

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from train.data.tfds_corpus import DEFAULT_CORPUS_DIR, corpus_files, read_docs, validation_ids
from train.data.tokenizer import DEFAULT_TOKENIZER, EOS, PAD

VOCAB_SIZE = 8192


def train_docs(corpus_dir):
    """Train-split documents of every domain, in a fixed order (domain, then file order)."""
    for path in corpus_files(corpus_dir).values():
        docs = read_docs(path)
        val = validation_ids(docs)
        yield from (d for i, d in enumerate(docs) if i not in val)


def build(corpus_dir=DEFAULT_CORPUS_DIR, vocab_size=VOCAB_SIZE) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=[EOS, PAD],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(train_docs(corpus_dir), trainer=trainer)
    return tok


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--corpus-dir", default=str(DEFAULT_CORPUS_DIR))
    ap.add_argument("--out", default=str(DEFAULT_TOKENIZER))
    ap.add_argument("--vocab-size", type=int, default=VOCAB_SIZE)
    args = ap.parse_args(argv)
    tok = build(args.corpus_dir, args.vocab_size)
    tok.save(args.out)
    print(f"wrote {args.out}: {tok.get_vocab_size()} tokens")


if __name__ == "__main__":
    main()
