"""The command line, `python -m app <command>` (`app.cli.main.main`).

`main` owns tasks, run and serve; `train`, `evaluate` and `export` own theirs and register
them with the parser; `common` holds what they share (`UserError`, the engine options,
loading with one-line errors). Heavy imports (torch, transformers) happen inside commands,
so `--help` is instant.
"""
