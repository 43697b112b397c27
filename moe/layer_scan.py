"""Consecutive blocks of the same structure run as one `jax.lax.scan` over their stacked states
(`Execution.scan_layers`): the compiled program holds one copy of such a block instead of one per layer.

Why: XLA compiles (and on GPU autotunes) every unrolled layer on its own. configs/gpu_1b.py's 16 layers took more
than 5 minutes to compile cold on an H200 (docs/performance.md, "GPU figures, run 4"): a third of a 15-minute
lease, and far worse at DeepSeek-V3's 61 layers. MaxText scans its layers by default for the same reason.

The parameters stay one module per layer (checkpoints, export and analysis see the same tree); the scan stacks
their states inside the traced function. That costs one copy of the scanned layers' parameters per call (and the
transpose, a slice of the stacked gradient, in the backward pass): on one H200 about 2 x 3.8 GB of fp32 at
configs/gpu_1b.py's shapes, a few ms against a ~265 ms step. Values are the unrolled loop's
(tests/test_model.py); with a KV cache the blocks run unrolled (decoding compiles small programs anyway).
"""

import jax
import jax.numpy as jnp
from flax import nnx


def runs_of_equal_blocks(blocks) -> list[tuple[int, int]]:
    """[start, stop) of each maximal run of consecutive blocks with one graph structure (the first dense
    blocks, then the MoE blocks, for DeepSeek-V3's layout; interleaved families give runs of one)."""
    defs = [nnx.graphdef(b) for b in blocks]
    runs, start = [], 0
    for i in range(1, len(defs) + 1):
        if i == len(defs) or defs[i] != defs[start]:
            runs.append((start, i))
            start = i
    return runs


def scan_blocks(call, blocks, x, keep_hidden: bool = False):
    """`call(block, x, None) -> (x, cache, probs, routing)` over `blocks` (one structure) as one scan: the final
    x and, per block in order, its (cache, probs, routing, x after it or None unless keep_hidden)."""
    graphdef = nnx.graphdef(blocks[0])
    stacked = jax.tree.map(lambda *leaves: jnp.stack(leaves), *(nnx.state(b) for b in blocks))

    def body(x, state):
        x, cache, probs, routing = call(nnx.merge(graphdef, state), x, None)
        return x, (cache, probs, routing, x if keep_hidden else None)

    x, outs = jax.lax.scan(body, x, stacked)
    return x, [jax.tree.map(lambda a, i=i: a[i], outs) for i in range(len(blocks))]
