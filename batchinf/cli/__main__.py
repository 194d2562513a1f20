"""`python -m batchinf.cli`: the same as the `batchinf` command."""

from batchinf.cli import entry

if __name__ == "__main__":
    entry()
