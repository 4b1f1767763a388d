"""``python -m benches.overhead``: see ``python -m benches.overhead --help``."""

from benches.overhead.command import main

if __name__ == "__main__":
    raise SystemExit(main())
