"""The bundled default: a small MoE that learns more than a bigram on the bundled 9-domain corpus in a few minutes
on a quiet 2-core CPU.

    python -m train                                # = --config configs/default.py --workdir runs/default
    python -m train --config configs/default.py --workdir runs/default --config.train.steps=2000
    python -m analysis.routing --workdir runs/default

4 layers (1 dense + 3 MoE), 16 routed experts (top-2) + 1 shared, d_model 192, GQA 4 query / 2 kv heads of 48,
RoPE, the bundled 1,024-token tokenizer, sequence 256, batch 16, 800 steps (3.3M tokens); 4.90M parameters, 1.80M
active. The small vocabulary is what makes the budget enough: with the 8,192-token tokenizer the same model ends
above its bigram reference at 400 steps and only 0.12 nats below it at 800 (the sizing table in docs/training.md,
with the measured loss, time and speed).
"""

from configs.base import base_config


def get_config():
    c = base_config()
    c.model.update(vocab_size=1024, d_model=192, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=48, d_ff=512,
                   first_k_dense=1, n_routed_experts=16, n_shared_experts=1, top_k=2, moe_d_ff=128, n_group=1,
                   topk_group=1)
    c.data.update(tokenizer="tokenizer_1k.json", seq_len=256)
    # A run of a few hundred steps needs a faster bias than DeepSeek-V3's 1e-3 (tuned for ~10^5 steps) to undo
    # the router's early collapse onto a few experts: the bias moves at most gamma per step.
    c.train.update(steps=800, batch_size=16, warmup_steps=50, lr=3e-3, bias_update_rate=1e-2)
    c.checkpoint.update(every=200, keep=4)  # all four: analysis.dynamics and the notebook compare steps
    c.log.every = 10
    c.eval.update(every=200, rows_per_domain=8, batch_size=16)
    return c
