"""The reference routing run: a model whose routed experts matter, for routing and ablation claims (about an hour
on a quiet 2-core CPU).

    python -m train --config configs/reference.py --workdir runs/reference
    python -m analysis.ablate --workdir runs/reference       # the zeroing controls, then each expert both ways
    python -m train --config configs/reference.py --workdir runs/reference_s1 --config.train.seed=1   # seeds

6 layers (1 dense + 5 MoE), 32 routed experts (top-4) + 1 shared of width 128, d_model 256, GQA 4 query / 2 kv heads
of 64, RoPE, the bundled 1,024-token tokenizer, sequence 256, batch 16, 2,500 steps (10.2M tokens); 18.6M
parameters, 4.80M active. The routed experts hold 4x the shared expert's active width (4 x 128 against 128), so the
model cannot route around them; the default (top-2 of 16, 2x) is the cheap end of the same design. Measured
figures (loss against the references, the zeroing controls, seeds): experiments/reference_routing/README.md.
"""

from configs.base import base_config


def get_config():
    c = base_config()
    c.model.update(vocab_size=1024, d_model=256, n_layers=6, n_heads=4, n_kv_heads=2, head_dim=64, d_ff=768,
                   first_k_dense=1, n_routed_experts=32, n_shared_experts=1, top_k=4, moe_d_ff=128, n_group=1,
                   topk_group=1)
    c.data.update(tokenizer="tokenizer_1k.json", seq_len=256)
    # The default's faster bias (see configs/default.py) and a slightly lower peak lr for the wider model.
    c.train.update(steps=2500, batch_size=16, warmup_steps=100, lr=2e-3, bias_update_rate=1e-2)
    c.checkpoint.update(every=500, keep=5)
    c.log.every = 25
    c.eval.update(every=500, rows_per_domain=8, batch_size=16)
    return c
