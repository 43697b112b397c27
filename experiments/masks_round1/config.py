"""The mask study, round 1: causal vs prefix-LM vs mixed decoders on input->output rows of the bundled
corpus.

    python -m experiments.masks_round1 compare-masks --config experiments/masks_round1/config.py \
        --masks causal,prefix,mixed --seeds 3 --steps 150 --nope
    python -m analysis.rank --workdir runs/compare_masks/causal/seed0

One document per row (seq 128): the first half is the input, the rest the output, loss on the output only
(train.prefix_loss=False, as in Su Jianlin's GPT vs UniLM experiment). The model is the default architecture
scaled down so that 18 runs of 150 steps fit in about an hour on a shared 2-core CPU: 4 layers (1 dense + 3 MoE),
d_model 64, 4 query / 2 kv heads of 16, 8 routed experts (top-2) + 1 shared, RoPE (model.rope=False for --nope);
1.39M parameters, 1.22M active.
model.mask is set per variant by the study runner; everything else is identical across variants.
"""

from configs.base import base_config


def get_config():
    c = base_config()
    c.model.update(d_model=64, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=16, d_ff=192, first_k_dense=1,
                   n_routed_experts=8, n_shared_experts=1, top_k=2, moe_d_ff=48, n_group=1, topk_group=1)
    c.data.update(seq_len=128, task="prefix", prefix_frac=0.5)
    c.train.update(steps=150, batch_size=8, warmup_steps=15, lr=3e-3, prefix_loss=False)
    c.checkpoint.update(every=50, keep=1)
    c.log.update(every=10, progress=False, tensorboard=False, peak_flops=1e12)
    c.eval.update(every=50, rows_per_domain=4, batch_size=12)
    return c
