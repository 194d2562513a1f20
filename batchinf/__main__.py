"""`python -m batchinf`: the same as the `batchinf` command."""

from batchinf.cli import entry

if __name__ == "__main__":
    entry()
