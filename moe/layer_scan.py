"""Consecutive blocks of the same structure run as one `jax.lax.scan` over their stacked states
(`Execution.scan_layers`): the compiled program holds one copy of such a block instead of one per layer.

Why: the unrolled program grows with the depth, and XLA's passes and code generation with it.
configs/gpu_1b.py's step (16 layers) optimizes to 1,373 dots unrolled and 127 scanned, and compiles in about
half to two thirds of the time scanned, for the CPU and for a GPU alike; unrolled, a cold compile for a GPU
takes minutes. MaxText scans its layers by default.

The parameters stay one module per layer (checkpoints, export and analysis see the same tree); the scan stacks
their states inside the traced function. That costs a stacked copy of the scanned layers' parameters per call
and a stacked gradient that is sliced back per layer: time and memory. At configs/gpu_1b.py's shapes ~3.8 GB
of fp32 each, a few ms of a GPU's memory bandwidth, small next to its step; on CPU the default config's step
runs ~8% slower scanned, so it is off by default. The same function as the unrolled loop up to rounding
(tests/test_layer_scan.py); with a KV cache the blocks run unrolled (decoding compiles small programs anyway).
"""

import itertools

import jax
import jax.numpy as jnp
from flax import nnx


def runs_of_equal_blocks(blocks) -> list[tuple[int, int]]:
    """[start, stop) of each maximal run of consecutive blocks with one graph structure (the first dense
    blocks, then the MoE blocks, for DeepSeek-V3's layout; interleaved families give runs of one)."""
    runs, start = [], 0
    for _, run in itertools.groupby(blocks, key=nnx.graphdef):
        stop = start + len(list(run))
        runs.append((start, stop))
        start = stop
    return runs


def scan_blocks(call, blocks, x_BxLxD, keep_hidden: bool = False):
    """`call(block, x, None) -> (x, cache, probs, routing)` over `blocks` (one structure) as one scan: the final
    x and, per block in order, its (cache, probs, routing, x after it or None unless keep_hidden)."""
    graphdef = nnx.graphdef(blocks[0])
    # Every leaf with a leading layer axis [n_blocks, ...]; the scan hands the body one layer's slice.
    state_by_layer = jax.tree.map(lambda *leaves: jnp.stack(leaves), *(nnx.state(b) for b in blocks))

    def body(x_BxLxD, state):
        x_BxLxD, cache, probs, routing = call(nnx.merge(graphdef, state), x_BxLxD, None)
        return x_BxLxD, (cache, probs, routing, x_BxLxD if keep_hidden else None)

    x_BxLxD, outs = jax.lax.scan(body, x_BxLxD, state_by_layer)
    return x_BxLxD, [jax.tree.map(lambda a, i=i: a[i], outs) for i in range(len(blocks))]
