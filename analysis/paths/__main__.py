"""python -m analysis.paths ...: expert paths across layers (cli.py)."""

from analysis.paths.cli import main

if __name__ == "__main__":
    main()
