"""``python -m pipeline.cli``: the ``kvstep`` command."""

from pipeline.cli.main import main

if __name__ == "__main__":
    raise SystemExit(main())
