"""Attention rank and rank collapse: `python -m analysis.rank` (cli.py), and the rank of the logits before and
after the softmax: `python -m analysis.rank.logits` (logits.py).

  attention.py  the rank of every layer's and head's attention and the rank collapse of four paths
  metrics.py    the rank measures, pure NumPy
  plots.py      rank_heads.png, rank_spectrum.png and rank_collapse.png
"""
