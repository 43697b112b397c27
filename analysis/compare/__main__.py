"""python -m analysis.compare ...: two routers on the same tokens (cli.py)."""

from analysis.compare.cli import main

if __name__ == "__main__":
    main()
