"""python -m analysis.routing ...: the routing analysis's command (cli.py)."""

from analysis.routing.cli import main

if __name__ == "__main__":
    main()
