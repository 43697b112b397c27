"""python -m analysis.ablate ...: the expert-ablation command (cli.py)."""

from analysis.ablate.cli import main

if __name__ == "__main__":
    main()
