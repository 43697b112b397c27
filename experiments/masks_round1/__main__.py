"""python -m experiments.masks_round1 compare-masks ...: the round-1 runner (runner.py)."""

from experiments.masks_round1.runner import main

if __name__ == "__main__":
    main()
