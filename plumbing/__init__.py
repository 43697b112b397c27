"""What every layer shares with the person at the keyboard: the user error types (one line naming the problem and
the fix; the commands exit 2 on them) and the command-line plumbing every command uses. The bottom layer: it
imports nothing of the project."""
