"""python -m experiments.head_sweep ...: the sweep's runner (runner.py)."""

from experiments.head_sweep.runner import main

if __name__ == "__main__":
    main()
