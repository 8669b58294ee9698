"""Every module of the package imports after a plain `pip install -e .` (no extras).

    python tests/import_all.py          # .ci/run runs it before installing the [test] extra

Two checks, so the result does not depend on what else the machine has installed:
  1. static: every `import` in dspark/ names the standard library, the package itself, or a
     distribution setup.py's install_requires declares; an extra's distribution (matplotlib
     for plots) only inside the function that needs it, or anywhere in the package of that
     extra (dspark/serve/: fastapi, uvicorn, prometheus_client); anything else only guarded by
     `except ImportError` (an optional feature that says what to install);
  2. dynamic: importing every module succeeds (TRITON_INTERPRET=1 without CUDA, as on CPU),
     or, for a module of an extra's package without that extra, fails with an ImportError
     that names `pip install 'dspark[<extra>]'`.
"""
from __future__ import annotations

import ast
import importlib
import os
import pkgutil
import sys
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# import name -> distribution in setup.py's install_requires
DECLARED = {"torch", "triton", "safetensors", "numpy", "tokenizers", "tqdm"}
# import name of an extra's distribution (setup.py extras_require): only inside the function
# that needs it, never at module level
EXTRAS = {"matplotlib"}
# packages that belong to an extra: their modules import it at module level, and the package's
# __init__ raises an ImportError naming `pip install 'dspark[<extra>]'` without it
EXTRA_PACKAGES = {"dspark/serve/": ("serve", {"fastapi", "starlette", "uvicorn", "prometheus_client"})}


def _guarded(node, parents) -> bool:
    """Inside the body of a `try` that catches ImportError (or a parent class of it)?"""
    child = node
    for p in reversed(parents):
        if isinstance(p, ast.Try) and child in p.body:
            for h in p.handlers:
                names = [h.type] if not isinstance(h.type, ast.Tuple) else list(h.type.elts)
                if h.type is None or any(isinstance(n, ast.Name) and n.id in (
                        "ImportError", "ModuleNotFoundError", "Exception") for n in names):
                    return True
        child = p
    return False


def undeclared_imports(package_dir: str) -> list[str]:
    bad = []
    stdlib = set(sys.stdlib_module_names) | {"__future__"}
    for dirpath, _, files in os.walk(package_dir):
        for fn in sorted(files):
            if not fn.endswith(".py"):
                continue
            path = os.path.join(dirpath, fn)
            tree = ast.parse(open(path).read(), path)
            stack = [(tree, [])]
            while stack:
                node, parents = stack.pop()
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    if isinstance(node, ast.ImportFrom) and node.level:
                        continue                                  # relative: the package
                    mods = ([a.name for a in node.names] if isinstance(node, ast.Import)
                            else [node.module])
                    for m in mods:
                        top = m.split(".")[0]
                        if top in stdlib or top in DECLARED or top == "dspark":
                            continue
                        rel = os.path.relpath(path, ROOT)
                        if any(rel.startswith(p) and top in names
                               for p, (_, names) in EXTRA_PACKAGES.items()):
                            continue
                        in_function = any(isinstance(p, (ast.FunctionDef, ast.AsyncFunctionDef))
                                          for p in parents)
                        if top in EXTRAS and in_function:
                            continue
                        if not _guarded(node, parents):
                            rel = os.path.relpath(path, ROOT)
                            bad.append(f"{rel}:{node.lineno}: imports {m!r}, which setup.py's "
                                       f"install_requires does not declare (declare it, or guard "
                                       f"the import with `except ImportError` and say what to "
                                       f"install)")
                for child in ast.iter_child_nodes(node):
                    stack.append((child, parents + [node]))
    return bad


def import_every_module(package: str = "dspark") -> list[str]:
    import torch
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    pkg = importlib.import_module(package)
    failed = []
    names = [package] + [m.name for m in pkgutil.walk_packages(pkg.__path__, package + ".")]
    for name in names:
        if name.endswith("__main__"):
            continue              # command-line entry points run on import; their imports are
                                  # covered by the static check
        try:
            importlib.import_module(name)
        except ImportError as e:
            extra = next((x for p, (x, _) in EXTRA_PACKAGES.items()
                          if name.startswith(p.rstrip("/").replace("/", "."))), None)
            if extra is None or f"pip install 'dspark[{extra}]'" not in str(e):
                failed.append(f"{name}:\n{traceback.format_exc(limit=3)}")
        except Exception:
            failed.append(f"{name}:\n{traceback.format_exc(limit=3)}")
    return failed, len(names)


def main() -> int:
    sys.path.insert(0, ROOT)
    bad = undeclared_imports(os.path.join(ROOT, "dspark"))
    failed, n = import_every_module()
    for line in bad + failed:
        print(line, file=sys.stderr)
    print(f"import_all: {n} modules, {len(failed)} failed to import, {len(bad)} undeclared imports")
    return 1 if bad or failed else 0


if __name__ == "__main__":
    sys.exit(main())
