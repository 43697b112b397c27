"""Data: the bundled multi-domain corpus, its TFDS builder, the tokenizer and the packed batch sampler."""
