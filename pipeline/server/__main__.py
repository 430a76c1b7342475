"""``python -m pipeline.server``: serve one engine over HTTP (see ``launch.main``)."""

from pipeline.server.launch import main

if __name__ == "__main__":
    main()
