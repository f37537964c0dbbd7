"""``python -m rlkit``: the ``rlkit`` command (:func:`rlkit.cli.main`)."""
from rlkit.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
