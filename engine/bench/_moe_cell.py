"""One `flotilla bench moe` run in a child process (started inside a capped memory group):

    python -m engine.bench._moe_cell '{"store_dir": ..., "sched": "bevy", "conc": 16, ...}'

Prints one JSON line, [figures, io_info], the result of engine.bench._moe_runs.one_run. With
"handshake": true in the cell it opens the engine first, prints READY, waits for GO on stdin
(its parent caps the memory group in between: engine.sparse.baseline.run_capped_child)
and prints {"figures": ..., "io_info": ...}."""

from __future__ import annotations

import json
import sys


def main(argv: list[str]) -> int:
    from engine.bench._moe_runs import measure, one_run, open_engine

    cell = json.loads(argv[0])
    if not cell.pop("handshake", False):
        figures, io_info = one_run(**cell)
        print(json.dumps([figures, io_info]), flush=True)
        return 0
    tokens = cell.pop("tokens")
    engine = open_engine(**cell)
    print("READY", flush=True)
    if sys.stdin.readline().strip() != "GO":
        engine.close()
        return 1
    figures, io_info = measure(engine, cell["sched"], cell["conc"], tokens)
    print(json.dumps({"figures": figures, "io_info": io_info}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
