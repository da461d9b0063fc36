"""`flotilla bench NAME`: benchmarks (never unit tests).

Each scenario is a module here exposing:
    NAME: str                       # `flotilla bench NAME`
    HELP: str                       # one line for --help
    add_arguments(parser) -> None   # its own options (besides --quick and --json)
    run(args, report) -> dict       # the figures; `report(str)` prints progress
The CLI discovers the modules, so adding a benchmark is adding a file.
Ratios are measured side by side in one run, with medians over repeats,
because this kind of machine is shared and noisy.
"""
