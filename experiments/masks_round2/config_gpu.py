"""The mask study's GPU round: experiments/masks_round2/config.py scaled up. One command, on one GPU:

    python -m experiments.masks_round2 --config experiments/masks_round2/config_gpu.py --seeds 5 \
        --out runs/study_gpu --probe_rows 64,32,32

4 arms x 5 paired seeds; d_model 384, 6 layers (1 dense + 5 MoE), 6 query / 3 kv heads of 64, 8 routed experts
top-2 + 1 shared, 512-token windows, batch 32 x 512, 900 steps (~14.7M tokens per run: the bundled corpus has
~7.4M training tokens with the 1,024-token tokenizer, so about two epochs). The validation curve every 25 steps on
every validation window (eval.rows_per_domain large); the final numbers and the gate on every window too.
Not run yet (no GPU in the session that wrote it): expect roughly an hour or two on an H100 (not measured).
"""

from experiments.masks_round2.config import get_config as cpu_config


def get_config():
    c = cpu_config()
    c.model.update(d_model=384, n_layers=6, n_heads=6, n_kv_heads=3, head_dim=64, d_ff=1024, moe_d_ff=256)
    c.data.update(seq_len=512)
    # lr pinned: the CPU round's 6e-3 was sized for its 128-wide model (experiments/masks_round2/README.md,
    # Sizing)
    c.train.update(steps=900, batch_size=32, warmup_steps=90, lr=3e-3)
    c.checkpoint.update(every=300, keep=1)
    c.log.update(every=25, peak_flops=0.0)
    c.eval.update(every=25, rows_per_domain=100_000, batch_size=64)
    return c
