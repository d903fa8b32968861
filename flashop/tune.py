"""`python -m flashop.tune`: the autotuner's command line (the autotuner is flashop/autotune.py).

The package does not import this module, so running it with -m does not execute a module that
`import flashop` already loaded (runpy warns about that). From Python, call `flashop.tune(...)`.
"""
import sys
import types

from flashop.autotune import main, tune


class _CallableModule(types.ModuleType):
    """`import flashop.tune` rebinds the package attribute `flashop.tune` from the function to this
    module; calling the module calls the function, so `flashop.tune(...)` keeps working."""

    def __call__(self, *args, **kwargs):
        return tune(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule

if __name__ == "__main__":
    main()
