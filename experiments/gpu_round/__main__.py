"""python -m experiments.gpu_round ...: every study part at the GPU size, one after another (runner.py)."""

from experiments.gpu_round.runner import main

if __name__ == "__main__":
    main()
