"""Mixed vs bidirectional heads on a masked LM, the GPU size (experiments/mlm/README.md):

    python -m experiments.mlm --config experiments/mlm/config_gpu.py --seeds 5 --out runs/mlm_gpu

experiments/masks_round2/config_gpu.py's model, data and optimizer (d_model 384, 6 layers, 512-token windows,
batch 32, 900 steps: ~14.7M tokens per run, about two epochs of the corpus) on masked-LM rows, as
experiments/mlm/config.py is experiments/masks_round2/config.py's: 15% of the tokens replaced by [MASK] = id 1024,
so model.vocab_size is 1,025.
Not run yet (no GPU lent to the sessions that wrote it).
"""

from experiments.masks_round2.config_gpu import get_config as study_gpu_config


def get_config():
    c = study_gpu_config()
    c.model.update(vocab_size=1025, mask="bidirectional")
    c.data.update(task="mlm")
    c.eval.update(output_only=False)
    return c
