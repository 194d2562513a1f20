"""`python -m batchinf.cli`: the same as the `batchinf` command."""

from batchinf.cli import main

if __name__ == "__main__":
    main()
