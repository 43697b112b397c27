"""Mixed vs bidirectional heads on a masked LM (experiments/mlm/README.md):

    python -m experiments.mlm --out runs/mlm --seeds 4

experiments/masks_round2/config.py's model, data and optimizer on masked-LM rows (train.inputs.MLMSampler:
256-token windows, 15% of the tokens replaced by [MASK] = id 1024, one past the 1,024-token tokenizer, so
model.vocab_size is 1,025).
model.mask (bidirectional / mixed) is set per arm by the runner.
"""

from experiments.masks_round2.config import get_config as study_config


def get_config():
    c = study_config()
    c.model.update(vocab_size=1025, mask="bidirectional")
    c.data.update(task="mlm")
    c.eval.update(output_only=False)
    return c
