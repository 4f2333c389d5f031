"""`python -m qkv` runs the `qkv` command."""

from qkv.cli import main

if __name__ == "__main__":
    main()
