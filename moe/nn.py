"""The building blocks every room of the model uses: a parameter with its logical axes, RMSNorm, and matmuls over
all leading rows.

Params are fp32 and carry logical axis names (`out_sharding`) that moe/sharding.py maps onto a mesh; matmuls run
in the activations' dtype; norms compute in fp32.
"""

import math

import jax
import jax.numpy as jnp
from flax import nnx


def param(rngs: nnx.Rngs, shape, names, std: float) -> nnx.Param:
    """An fp32 parameter drawn from N(0, std^2), carrying logical axis names for sharding."""
    return nnx.Param(std * jax.random.normal(rngs.params(), shape, jnp.float32), out_sharding=names)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, offset: bool = False):
        """offset: the zero-centred form x / rms(x) * (1 + scale), scale initialised 0 (Qwen3-Next)."""
        self.scale = nnx.Param(jnp.full((dim,), 0.0 if offset else 1.0, jnp.float32), out_sharding=("norm",))
        self.eps = eps
        self.offset = offset

    def __call__(self, x):
        # Normalize in fp32, then scale in the input dtype (as HF does, so exports match exactly).
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        if self.offset:  # HF's Qwen3NextRMSNorm scales in fp32, then casts
            return (x32 * (1.0 + self.scale[...].astype(jnp.float32))).astype(x.dtype)
        return self.scale[...].astype(x.dtype) * x32.astype(x.dtype)


def matmul_rows(x, w, contract: int = 1):
    """x [..., *C] @ w [*C, *O] -> [..., *O] as one 2-D matmul over all leading rows (C: the last `contract` dims
    of x, the first of w). XLA:CPU runs the backward of the equivalent 3-D einsum ("bld,dhk->blhk": the weight's
    gradient contracted over b and l) ~1.4x slower; the same math on every backend."""
    lead, inner = x.shape[:x.ndim - contract], w.shape[:contract]
    rows_NxC = x.reshape(-1, math.prod(inner))
    return (rows_NxC @ w.reshape(math.prod(inner), -1)).reshape(*lead, *w.shape[contract:])


def chunk_count(L: int, chunks: int) -> int:
    """The largest divisor of L that is at most `chunks` (>= 1): equal chunks for any sequence length."""
    return max(d for d in range(1, max(1, min(chunks, L)) + 1) if L % d == 0)
