"""The package's layers call down, never up (docs: /work/shared/design/architecture.md).

Every `import` of a dspark module in dspark/ (top level and inside functions: a lazy import is
still a dependency) is parsed with ast and checked against RULES: a module under a prefix on the
left may not import a module under any prefix on its right. Relative imports are resolved first.
"""
import ast
import os

import pytest

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "dspark")

_ABOVE_KERNELS = ("dspark.models", "dspark.attention", "dspark.kvcache", "dspark.spec",
                  "dspark.engine", "dspark.runner", "dspark.scheduler", "dspark.sampling",
                  "dspark.draft_pass", "dspark.overlap", "dspark.request", "dspark.config",
                  "dspark.distributed", "dspark.bench", "dspark.serve", "dspark.async_engine")
_ENGINE = ("dspark.engine", "dspark.async_engine", "dspark.runner", "dspark.scheduler",
           "dspark.overlap", "dspark.warmup", "dspark.serve", "dspark.distributed.engine")

# (modules under this prefix, may not import modules under these prefixes, why)
RULES = [
    ("dspark.kernels", _ABOVE_KERNELS, "kernels are leaf code"),
    ("dspark.formats", _ABOVE_KERNELS + ("dspark.kernels", "dspark.cuda"),
     "byte formats are leaf code"),
    ("dspark.cuda", _ABOVE_KERNELS + ("dspark.kernels", "dspark.formats"),
     "CUDA plumbing is leaf code"),
    ("dspark.kvcache", ("dspark.models", "dspark.attention") + _ENGINE + ("dspark.spec",),
     "the cache knows no models or backends"),
    ("dspark.models", _ENGINE, "models know no engine, runner or scheduler"),
    ("dspark.spec", ("dspark.models", "dspark.draft_pass") + _ENGINE,
     "control knows no models (nor the runner's draft pass)"),
]


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _module_name(path: str) -> tuple[str, str]:
    """(module, package) of a file under ROOT."""
    rel = os.path.relpath(path, os.path.dirname(ROOT))[:-3].replace(os.sep, ".")
    if rel.endswith(".__init__"):
        rel = rel[: -len(".__init__")]
        return rel, rel
    return rel, rel.rsplit(".", 1)[0]


def _is_module(name: str) -> bool:
    path = os.path.join(os.path.dirname(ROOT), *name.split("."))
    return os.path.isfile(path + ".py") or os.path.isdir(path)


def imports_of(path: str):
    """(line, imported dspark module) of every import in the file."""
    module, package = _module_name(path)
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _under(alias.name, "dspark"):
                    yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            if not _under(base, "dspark"):
                continue
            for alias in node.names:      # `from dspark.x import y`: y may be a module itself
                sub = f"{base}.{alias.name}"
                yield node.lineno, sub if _is_module(sub) else base


def _package_files():
    for folder, _, names in os.walk(ROOT):
        for name in sorted(names):
            if name.endswith(".py"):
                yield os.path.join(folder, name)


def violations():
    found = []          # (a list: the order of the files and lines, one entry per import)
    for path in _package_files():
        module, _ = _module_name(path)
        for line, target in sorted(set(imports_of(path))):
            for prefix, banned, why in RULES:
                if _under(module, prefix) and any(_under(target, b) for b in banned):
                    found.append(f"{os.path.relpath(path, os.path.dirname(ROOT))}:{line}: "
                                 f"{module} imports {target} ({why})")
    return found


def test_layers_call_down_never_up():
    found = violations()
    assert not found, "imports against the layer rules:\n" + "\n".join(found)


def test_the_walk_sees_relative_and_lazy_imports(tmp_path, monkeypatch):
    """The checker itself: a relative import two levels up and an import inside a function are
    both resolved to the module they name."""
    pkg = tmp_path / "dspark" / "kernels"
    pkg.mkdir(parents=True)
    (tmp_path / "dspark" / "__init__.py").write_text("")
    (tmp_path / "dspark" / "models.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "k.py").write_text("from ..models import x\n\ndef f():\n    import dspark.models\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", str(tmp_path / "dspark"))
    assert list(imports_of(str(pkg / "k.py"))) == [(1, "dspark.models"), (4, "dspark.models")]
    assert [v.split(": ", 1)[1] for v in violations()] == [
        "dspark.kernels.k imports dspark.models (kernels are leaf code)"] * 2


@pytest.mark.parametrize("prefix", [r[0] for r in RULES])
def test_every_ruled_layer_exists(prefix):
    assert _is_module(prefix), f"{prefix}: a rule for a package that is not there"
