"""`python -m flashop.tune`: the autotuner's command line (the autotuner is flashop/autotune.py).

The package does not import this module, so running it with -m does not execute a module that
`import flashop` already loaded (runpy warns about that). From Python, call `flashop.tune(...)`.
"""
from flashop.autotune import main

if __name__ == "__main__":
    main()
