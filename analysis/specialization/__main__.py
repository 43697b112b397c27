"""python -m analysis.specialization ...: the specialization-against-chance command (cli.py)."""

from analysis.specialization.cli import main

if __name__ == "__main__":
    main()
