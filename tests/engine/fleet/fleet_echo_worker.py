"""A tiny real shard worker for the fleet tests (the pipeline worker is not
ready yet): hashes the shard file it was given, then answers every request on
its data port with b"ready <sha256> <device>", until SIGTERM."""

from __future__ import annotations

import argparse
import hashlib
import signal
import sys

import zmq


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--shard", required=True)
    p.add_argument("--device", default="CPU")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--ignore-term", action="store_true", help="act hung: only SIGKILL ends it")
    args = p.parse_args()
    h = hashlib.sha256()
    with open(args.shard, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    if args.ignore_term:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.REP)
    sock.linger = 0
    sock.bind(f"tcp://127.0.0.1:{args.port}")
    print(f"worker ready {h.hexdigest()}", flush=True)
    while True:
        if sock.poll(200):
            sock.recv()
            sock.send(f"ready {h.hexdigest()} {args.device}".encode())


if __name__ == "__main__":
    sys.exit(main())
