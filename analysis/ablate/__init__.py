"""Does an expert matter to the output? `python -m analysis.ablate` (cli.py).

  ablation.py  remove experts by rerouting or by zeroing their output (`edited`) and score the validation loss
               change (`Scorer`, `ablate`)
  controls.py  the controls: every routed expert, the shared expert, every routed expert of one layer
  plots.py     ablation_importance.png and ablation_domains.png
"""

MODES = ("reroute", "zero")  # how an expert is removed: out of the selection, or its output zeroed
