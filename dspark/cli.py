"""The `dspark` command: `dspark serve [MODEL] [options]` (see `dspark serve --help`)."""
from __future__ import annotations

import sys


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: dspark serve [MODEL] [options]\n\n  serve    OpenAI-compatible HTTP server "
              "(dspark serve --help)")
        sys.exit(0 if argv else 2)
    if argv[0] != "serve":
        sys.exit(f"dspark: unknown command {argv[0]!r}: use `dspark serve [MODEL] [options]`")
    from .serve.cli import main as serve
    serve(argv[1:], prog="dspark serve")


if __name__ == "__main__":
    main()
