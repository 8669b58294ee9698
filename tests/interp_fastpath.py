"""Test-suite speed-up of the Triton interpreter (TRITON_INTERPRET=1, the CPU runs): no result
changes, only repeated no-op work is skipped. Installed by conftest.py; DSPARK_FAST_INTERP=0
turns it off.

What it skips: the interpreter runs a kernel as GridExecutor.__call__, which patches
triton.language for the interpreter (`_patch_lang(kernel)`: inspect.getmembers over tl, tl.core,
tl.tensor, tl.math, ... and a wrapper set per builtin), runs every program, and undoes the patch
(`scope.restore()`) at the end. Every call of a @triton.jit function from inside the kernel
(tl.sum, tl.max, tl.zeros, the kernels' own helpers such as _bf16_round) calls `_patch_lang`
again, per program and call, although nothing undoes a patch before the grid run ends: the
language modules it would patch are patched already (their builtins are wrappers now, so
_patch_builtin wraps nothing; the other attributes get equivalent new closures; the nested
scope is discarded, never restored). That is ~25-30% of the interpreted time of this suite's
kernels. Here a `_patch_lang` for a set of language modules already patched in the current grid
run returns an empty scope; the first one for a new set (e.g. tl.core, seen first through
tl.sum's module) runs as before, so the state every program sees is the same as without this.

Installed only where that reasoning holds, checked on the installed Triton's source: the
GridExecutor / nested-call / `_LangPatchScope` structure above, and `restore()` called nowhere
but at the end of GridExecutor.__call__. Any other Triton layout: nothing is changed.
"""
import inspect
import os
import threading

_installed = False


def _layout_ok(interp) -> bool:
    need = ("_patch_lang", "_LangPatchScope", "GridExecutor", "InterpretedFunction", "tl")
    if not all(hasattr(interp, n) for n in need):
        return False
    try:
        src = inspect.getsource(interp)
        grid_src = inspect.getsource(interp.GridExecutor.__call__)
        call_src = inspect.getsource(interp.InterpretedFunction.__call__)
        patch_src = inspect.getsource(interp._patch_lang)
    except (OSError, TypeError):
        return False
    return ("patch_scope = _patch_lang(self.fn)" in grid_src
            and "patch_scope.restore()" in grid_src
            and "_patch_lang(self.fn)" in call_src and "restore" not in call_src
            and "return scope" in patch_src
            and src.count(".restore()") == 1)        # the grid run's, nothing in between


def install() -> bool:
    """Install the skip if interpreting and the Triton layout is the expected one; returns
    whether it is installed."""
    global _installed
    if _installed:
        return True
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0") or \
            os.environ.get("DSPARK_FAST_INTERP", "1") == "0":
        return False
    try:
        import triton.runtime.interpreter as interp
    except ImportError:
        return False
    if not _layout_ok(interp):
        return False
    state = threading.local()
    patch_lang, grid_call = interp._patch_lang, interp.GridExecutor.__call__

    def lang_key(fn):
        # the modules `_patch_lang(fn)` patches: triton.language / triton.language.core as seen
        # from fn's globals (its own selection, as a set)
        tl = interp.tl
        return frozenset(id(v) for v in fn.__globals__.values()
                         if inspect.ismodule(v) and v in (tl, tl.core))

    def _patch_lang(fn):
        done = getattr(state, "done", None)
        if done is None:                     # outside a grid run: as before
            return patch_lang(fn)
        key = lang_key(fn)
        if key in done:                      # patched in this grid run, not restored yet
            return interp._LangPatchScope()
        scope = patch_lang(fn)
        done.add(key)
        return scope

    def _grid_call(self, *args, **kwargs):
        prev = getattr(state, "done", None)
        state.done = set()
        try:
            return grid_call(self, *args, **kwargs)
        finally:
            state.done = prev

    interp._patch_lang = _patch_lang
    interp.GridExecutor.__call__ = _grid_call
    _installed = True
    return True
