"""Expert paths across layers: which expert of MoE layer l+1 follows which of layer l, against the product of
the marginals. `python -m analysis.paths` (cli.py).

  transitions.py  joint counts of consecutive layers' choices, mutual information in bits, its nulls (NumPy only)
  plots.py        paths.png
"""
