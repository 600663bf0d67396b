"""``python -m simplefsdp.train``: the training entry point."""

from simplefsdp.train.cli import main

if __name__ == "__main__":
    main()
