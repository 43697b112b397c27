"""When does routing settle? `python -m analysis.dynamics` (cli.py).

  trajectory.py  saturation, load and routing biases over every checkpoint and the step-0 model
  plots.py       dynamics_saturation.png, dynamics_load.png and dynamics_bias.png
"""
