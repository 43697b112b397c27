"""python -m experiments.encdec ...: the 2x2's runner (runner.py)."""

from experiments.encdec.runner import main

if __name__ == "__main__":
    main()
