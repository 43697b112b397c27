"""python -m analysis.importance ...: REAP importance against ablation, and the super-expert scan (cli.py)."""

from analysis.importance.cli import main

if __name__ == "__main__":
    main()
