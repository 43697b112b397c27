"""Counterfactual routing: per token, the loss with the router's chosen experts against random routes of equal
compute. `python -m analysis.counterfactual` (cli.py).

  routes.py   the forward pass with each MoE layer's route replaced (chosen, uniform random, or the chosen sets
              permuted across tokens), gates renormalized by the router's own rule
  informative.py  per-token loss changes over draws, per domain and token-frequency bucket (`counterfactual`)
  plots.py    counterfactual.png
"""

MODES = ("chosen", "random", "permuted")  # per MoE layer: the router's top-k, K uniform experts, another token's set
