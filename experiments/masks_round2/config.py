"""The mask study, round 2 (experiments/masks_round2/README.md): causal vs prefix-LM vs mixed vs causal
with loss on every token, on input->output windows of the bundled corpus with the bundled 1,024-token tokenizer.

    python -m experiments.masks_round2 --out runs/study_masks          # CPU round: 16 runs x ~9.5 min, 2 cores
    python -m experiments.masks_round2.report --out runs/study_masks   # report only, from the saved results

Every document is cut into 256-token windows (data.windows: all training text is available, none is dropped);
the first half of a window is the input, the second half the output. Validation: the output half only for every
arm (eval.output_only); the final loss on every validation window (1,148), the curve on 16 windows per domain.
The model: 4 layers (1 dense + 3 MoE), d_model 128, 4 query / 2 kv heads of 32, 8 routed experts top-2 + 1 shared, RoPE.
model.mask and train.prefix_loss are set per arm by the study runner; everything else is identical.
"""

from configs.base import base_config


def get_config():
    c = base_config()
    c.model.update(vocab_size=1024, d_model=128, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=32, d_ff=384,
                   first_k_dense=1, n_routed_experts=8, n_shared_experts=1, top_k=2, moe_d_ff=96, n_group=1,
                   topk_group=1)
    c.data.update(tokenizer="tokenizer_1k.json", seq_len=256, task="prefix", prefix_frac=0.5, windows=True)
    # Sized by the pilots of 2026-11-24 (experiments/masks_round2/README.md, "Sizing"): the causal model passes the
    # gate's bigram margin after ~2.5M tokens at this learning rate; the best run ending at 1M tokens was 0.68 nats
    # above the bigram.
    c.train.update(steps=1500, batch_size=8, warmup_steps=80, lr=6e-3, prefix_loss=False)
    c.checkpoint.update(every=1000, keep=1, async_save=False)
    c.log.update(every=25, progress=False, tensorboard=False, peak_flops=1e12)
    # every arm is scored on the output half, whatever it trained on: the curve every 100 steps on the first 16
    # validation windows of each domain, the final loss and probes by experiments.masks_round2 on every window
    c.eval.update(every=100, rows_per_domain=16, batch_size=48, output_only=True)
    return c
