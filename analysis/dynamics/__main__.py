"""python -m analysis.dynamics ...: the routing-dynamics command (cli.py)."""

from analysis.dynamics.cli import main

if __name__ == "__main__":
    main()
