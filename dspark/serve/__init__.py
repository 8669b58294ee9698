"""OpenAI-compatible serving: `python -m dspark.serve [MODEL]` or `dspark serve [MODEL]`
(needs the `serve` extra: pip install 'dspark[serve]'). `build_app` gives the FastAPI app for
an AsyncEngine, to run under any ASGI server or to extend with routes of your own."""


def build_app(*args, **kwargs):
    from .app import build_app as build
    return build(*args, **kwargs)


__all__ = ["build_app"]
