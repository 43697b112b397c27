"""python -m analysis.rank ...: the attention-rank command (cli.py)."""

from analysis.rank.cli import main

if __name__ == "__main__":
    main()
