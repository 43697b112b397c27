"""python -m experiments.deepseek_parts ...: the study's runner (runner.py)."""

from experiments.deepseek_parts.runner import main

if __name__ == "__main__":
    main()
