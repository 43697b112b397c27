"""Is the routing specialization more than chance? `python -m analysis.specialization` (cli.py).

  baselines.py  what a metric reads without specialization: the step-0 model and a random router with the
                same load
  compare.py    each headline metric of one or several seeds beside those baselines, with its interval
  plots.py      specialization.png
"""
