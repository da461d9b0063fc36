"""One `flotilla bench moe` run in a child process (started inside a capped memory group):

    python -m engine.bench._moe_cell '{"store_dir": ..., "sched": "bevy", "conc": 16, ...}'

Prints one JSON line, [figures, io_info], the result of engine.bench.moe.one_run."""

from __future__ import annotations

import json
import sys


def main(argv: list[str]) -> int:
    from engine.bench.moe import one_run

    cell = json.loads(argv[0])
    figures, io_info = one_run(**cell)
    print(json.dumps([figures, io_info]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
