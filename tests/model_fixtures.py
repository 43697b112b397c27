"""Tiny models and jitted forwards shared across test files (compiled once per shape)."""

import functools

import jax
from flax import nnx

from moe import Execution, ModelConfig, Transformer

TINY = dict(vocab_size=61, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=48,
            first_k_dense=1, n_routed_experts=8, n_shared_experts=1, top_k=2, moe_d_ff=16, n_group=2,
            topk_group=1, routed_scaling_factor=1.5)


@functools.cache
def tiny_model(**overrides) -> Transformer:
    return Transformer(ModelConfig(**{**TINY, **overrides}), nnx.Rngs(0))


@functools.cache
def forward_fn(**overrides):
    """A jitted (tokens, segment_ids, prefix_len) -> logits for the tiny model with these overrides, its routed
    experts on ragged_dot (`ragged_execution`)."""
    graphdef, state = nnx.split(tiny_model(**overrides))

    @jax.jit
    def fwd(tokens, segment_ids=None, prefix_len=None):
        model = nnx.merge(graphdef, state)
        return model(tokens, segment_ids_BxL=segment_ids, prefix_len_B=prefix_len, execution=ragged_execution())[0]

    return fwd


def ragged_execution(**settings) -> Execution:
    """An Execution whose routed experts run by ragged_dot, for tests whose subject is not the experts' kernel: it
    compiles in a fraction of the time of CPU's default (auto: slab; benchmarks/grouped_compile_time.py), which
    tests/test_grouped_kernels.py holds equal to it and tests/test_pinned.py trains end to end."""
    return Execution(grouped_matmul="ragged_dot", **settings)
