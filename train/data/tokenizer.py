"""The bundled byte-level BPE tokenizer (`train/data/tokenizer.json`, 8,192 tokens) and its special ids."""

from pathlib import Path

import numpy as np
import tokenizers

from plumbing.errors import UserError

DEFAULT_TOKENIZER = Path(__file__).parent / "tokenizer.json"
EOS, PAD = "<|endoftext|>", "<|pad|>"
EOS_ID, PAD_ID = 0, 1  # build_tokenizer lists the special tokens first, so they get these ids


def load_tokenizer(path=None) -> tokenizers.Tokenizer:
    """Load a HF `tokenizers` JSON file (default: the bundled one); checks that EOS / PAD have ids 0 / 1."""
    path = Path(path or DEFAULT_TOKENIZER)
    if not path.is_file():
        raise UserError(f"tokenizer file {path} not found; run `python -m train.data.build_tokenizer` or fix the path")
    try:
        tok = tokenizers.Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception on malformed JSON
        raise UserError(f"tokenizer file {path} is unreadable ({e}); rebuild it with train.data.build_tokenizer") from e
    if tok.token_to_id(EOS) != EOS_ID or tok.token_to_id(PAD) != PAD_ID:
        raise UserError(f"tokenizer {path} must map {EOS} to {EOS_ID} and {PAD} to {PAD_ID}; rebuild it")
    return tok


def token_dtype(tok: tokenizers.Tokenizer):
    """Smallest unsigned numpy dtype that holds every id: uint16 for vocabularies up to 65,536."""

    return np.uint16 if tok.get_vocab_size() <= 1 << 16 else np.uint32
