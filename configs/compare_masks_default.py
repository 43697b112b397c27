"""The mask study (issue 6) with the project's default small model: configs/compare_masks.py, model block from
configs/default.py.

    python -m analysis.experiments compare-masks --config configs/compare_masks_default.py \
        --masks causal,prefix,mixed --seeds 3 --steps 100 --nope --out runs/compare_masks_default

Task, sequence length (128, one document per row, input = first half, loss on the output only), batch, optimizer,
schedule, checkpointing and evaluation are exactly those of configs/compare_masks.py; only c.model differs: it is
configs/default.py's model settings (read from configs.default.get_config().model, not copied), i.e. 4 layers
(1 dense + 3 MoE), d_model 192, 4 query / 2 kv heads of 48, d_ff 512, 16 routed experts (top-2) + 1 shared of
width 128, RoPE (model.rope=False for --nope); 7.65M parameters, 4.56M active. 100 steps: 18 runs in ~25 min on a
shared 2-core CPU (results in docs/decoder-only.md, claim 1, "With the default small model").
model.mask and model.rope are set per variant by the study runner; everything else is identical across variants.
(configs/default.py's train settings, e.g. its faster bias_update_rate and longer sequences, are not taken.)
"""

from configs import compare_masks, default


def get_config():
    c = compare_masks.get_config()
    c.model.update(default.get_config().model.to_dict())
    c.model.update(mask="causal", rope=True)  # the runner overrides both per variant, as in compare_masks
    return c
