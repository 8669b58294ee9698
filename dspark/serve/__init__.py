"""OpenAI-compatible serving: `python -m dspark.serve [MODEL]` or `dspark serve [MODEL]`
(needs the `serve` extra: pip install 'dspark[serve]'). `build_app` gives the FastAPI app for
an AsyncEngine, to run under any ASGI server or to extend with routes of your own."""

try:            # the package's modules import the extra at module level
    import fastapi  # noqa: F401
    import prometheus_client  # noqa: F401
    import uvicorn  # noqa: F401
except ImportError as e:
    raise ImportError(f"dspark.serve needs the 'serve' extra ({e.name} is not installed): "
                      f"pip install 'dspark[serve]'") from e


def build_app(*args, **kwargs):
    from .app import build_app as build
    return build(*args, **kwargs)


__all__ = ["build_app"]
