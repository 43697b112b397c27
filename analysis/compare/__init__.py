"""Two routers on the same tokens: two runs, two checkpoints of one run, or a run and its fine-tune.
`python -m analysis.compare` (cli.py).

  record.py   route the same tokens through a model: each MoE layer's top-k and routing entropy per token
  overlap.py  expert-set Jaccard overlap per token against the chance of each model's load, entropy per domain
  swap.py     the gate swap: one model's routers (weights + routing bias) in the other, the loss change
  plots.py    compare.png
"""
