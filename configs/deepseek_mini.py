"""DeepSeek-V3's architecture at the bundled default's size: multi-head latent attention, multi-token prediction
(D = 1) and DeepSeek-V3's routing, trainable on a 2-core CPU like the default.

    python -m train --config configs/deepseek_mini.py --workdir runs/deepseek_mini
    python -m train.generate --workdir runs/deepseek_mini --prompt "In the beginning" --speculative mtp

Everything the default has (configs/default.py: 4 layers, 1 dense + 3 MoE, 16 routed experts + 1 shared, d_model
192, the 1,024-token tokenizer, sequence 256, batch 16, 800 steps) with DeepSeek-V3's parts in place of the rest:
  attention  MLA, 4 heads: query latent 96, kv latent 64 (the cache: 64 + 16 numbers per token and layer against
             GQA's 2 x 2 x 48 = 192), 32 + 16 (roped) query/key dims per head, values of 48; its parameters equal
             GQA's within 1% (109,728 against 110,592 per layer)
  routing    sigmoid scores, selection bias, 4 groups of 4 experts with the best 2 groups eligible, gates
             normalized over the chosen experts x 2.5 (DeepSeek-V3's routed_scaling_factor)
  MTP        one module (its own MoE block: layer 4), lambda 0.3, then 0.1 for the last 30% of the run (the paper:
             0.3 for the first 10T tokens of 14.8T)
6.34M parameters, 2.21M active. Speed: 5,960 tokens/s against the default's 6,960 (steps 30-80 of an 80-step run
each, `python -m train --config configs/X.py --workdir /tmp/X --config.train.steps=80`, quiet 2-core CPU,
2026-11-28): about 10 minutes for the 800 steps.
"""

from configs.default import get_config as default_config


def get_config():
    c = default_config()
    c.model.update(attention="mla", q_lora_rank=96, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16,
                   v_head_dim=48, n_group=4, topk_group=2, routed_scaling_factor=2.5, mtp_depth=1)
    c.train.update(mtp_weight=0.3, mtp_weight_late=0.1, mtp_weight_switch=0.7)
    return c
