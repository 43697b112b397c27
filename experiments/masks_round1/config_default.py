"""The mask study, round 1 with the project's default small model: experiments/masks_round1/config.py,
model block from configs/default.py.

    python -m experiments.masks_round1 compare-masks --config experiments/masks_round1/config_default.py \
        --masks causal,prefix,mixed --seeds 3 --steps 100 --nope --out runs/compare_masks_default

Task, sequence length (128, one document per row, input = first half, loss on the output only), batch, optimizer,
schedule, checkpointing and evaluation are exactly those of experiments/masks_round1/config.py; only c.model
differs: it is configs/default.py's model settings (read from configs.default.get_config().model, not copied) with
round 1's own 8,192-token vocabulary,
i.e. 4 layers (1 dense + 3 MoE), d_model 192, 4 query / 2 kv heads of 48, d_ff 512, 16 routed experts (top-2) + 1
shared of width 128, RoPE (model.rope=False for --nope); 7.65M parameters, 4.56M active. 100 steps: 18 runs in
~25 min on a shared 2-core CPU (results in experiments/masks_round1/results/compare-masks-default/).
model.mask and model.rope are set per variant by the study runner; everything else is identical across variants.
(configs/default.py's train settings, e.g. its faster bias_update_rate and longer sequences, are not taken.)
"""

from configs import default
from experiments.masks_round1 import config as round1


def get_config():
    c = round1.get_config()
    vocab = c.model.vocab_size  # round 1 ran with the 8,192-token tokenizer; the default model now uses 1,024
    c.model.update(default.get_config().model.to_dict())
    c.model.vocab_size = vocab
    c.model.update(mask="causal", rope=True)  # the runner overrides both per variant, as in config.py
    return c
