"""Decoding with a KV cache: generate.py (prefill the prompt once, then one token per step; greedy or nucleus
sampling) and speculative.py (greedy decoding with the multi-token prediction module as the draft)."""

from moe.decoding.generate import generate, generate_chunks, init_cache, layer_cache, prefill, sample, step
from moe.decoding.speculative import speculative_generate

__all__ = ["generate", "generate_chunks", "init_cache", "layer_cache", "prefill", "sample", "speculative_generate", "step"]
