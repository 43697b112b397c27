"""python -m experiments.mlm ...: the masked-LM comparison's runner (runner.py)."""

from experiments.mlm.runner import main

if __name__ == "__main__":
    main()
