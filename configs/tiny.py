"""Tiny config: trains in seconds on CPU, for tests and smoke runs.

    python -m train --config configs/tiny.py --workdir runs/tiny
"""

from configs.base import base_config


def get_config():
    c = base_config()
    c.model.update(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, d_ff=128, first_k_dense=1,
                   n_routed_experts=8, n_shared_experts=1, top_k=2, moe_d_ff=32, n_group=2, topk_group=1)
    c.data.seq_len = 64
    c.train.update(steps=20, batch_size=8, warmup_steps=5, lr=3e-3)
    c.checkpoint.every = 10
    c.log.every = 5
    c.eval.update(every=10, rows_per_domain=2, batch_size=8)
    # At these shapes compiling dominates a run, and ragged_dot compiles faster than slab (CPU's `auto` choice,
    # which wins per step at the default config's size).
    c.execution.grouped_matmul = "ragged_dot"
    return c
