"""Expert importance without ablating: REAP's gate x output norm against the zeroing ablation, and the
massive-activation ("super expert") scan. `python -m analysis.importance` (cli.py).

  reap.py    one pass over the validation rows: per expert the REAP score, its routing share and the largest
             activation of its output; the residual stream's largest activation per layer (`expert_stats`)
  relate.py  Spearman correlation of the scores with the zeroing ablation's loss change, outlier flags (NumPy)
  plots.py   importance.png and super_experts.png
"""
