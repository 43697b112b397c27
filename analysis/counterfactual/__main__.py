"""python -m analysis.counterfactual ...: the chosen route against random routes of equal compute (cli.py)."""

from analysis.counterfactual.cli import main

if __name__ == "__main__":
    main()
