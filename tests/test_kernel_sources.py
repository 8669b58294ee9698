"""Static checks of the Triton kernels' source that the CPU interpreter cannot make: constructs
the GPU machine's Triton (3.6) rejects when it hashes a kernel's dependencies, although newer
Triton and the interpreter accept them."""
import ast
import glob
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _jit_functions():
    for path in sorted(glob.glob(os.path.join(ROOT, "dspark", "**", "*.py"), recursive=True)):
        tree = ast.parse(open(path).read(), filename=path)
        for fn in ast.walk(tree):
            if isinstance(fn, ast.FunctionDef) and any(
                    "jit" in ast.unparse(d) for d in fn.decorator_list):
                yield os.path.relpath(path, ROOT), fn


def test_jit_functions_found():
    assert len(list(_jit_functions())) > 50


def test_no_nested_tuple_assignment_in_jit_code():
    """`(a, b), c = f()` in any jit function (or one it calls) makes Triton 3.6's
    DependenciesFinder raise "unhashable type: 'list'" at the first launch on the GPU."""
    bad = []
    for path, fn in _jit_functions():
        for node in ast.walk(fn):
            targets = node.targets if isinstance(node, ast.Assign) else (
                [node.target] if isinstance(node, ast.For) else [])
            for t in targets:
                if isinstance(t, (ast.Tuple, ast.List)) and any(
                        isinstance(e, (ast.Tuple, ast.List)) for e in t.elts):
                    bad.append(f"{path}:{node.lineno} in {fn.name}")
    assert not bad, "nested tuple targets in jit code (unpack flat instead): " + ", ".join(bad)


def test_no_string_defaults_on_jit_helpers():
    """A jit helper (called from jit code, not launched) whose constexpr parameter has a string
    default fails to compile under Triton 3.6 when a caller leaves it out ("'str' object has no
    attribute 'type'": the default is passed as a plain str). Kernels (launched from the host)
    may have them: the launcher wraps them. Helpers take such parameters explicitly."""
    bad = []
    for path, fn in _jit_functions():
        if fn.name.endswith("_kernel"):
            continue
        args = fn.args.args[len(fn.args.args) - len(fn.args.defaults):]
        for a, d in zip(args, fn.args.defaults):
            if isinstance(d, ast.Constant) and isinstance(d.value, str):
                bad.append(f"{path}:{fn.lineno} {fn.name}({a.arg}={d.value!r})")
    assert not bad, "string defaults on jit helpers (pass them explicitly): " + ", ".join(bad)
