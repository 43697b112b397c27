"""python -m experiments.masks_round2 ...: the round-2 runner (runner.py); the report alone is
python -m experiments.masks_round2.report --out OUT."""

from experiments.masks_round2.runner import main

if __name__ == "__main__":
    main()
