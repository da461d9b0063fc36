"""Private network namespaces for benchmarks: a bridge, one veth per node, tc netem.

    with NetLab(["c", "s0", "s1"], delay_ms=2.5, rate_mbit=300) as lab:
        lab.exec_prefix("s0")   # ["ip", "netns", "exec", "flb1234-s0"]
        lab.address("s0")       # "10.213.7.2"

Delay: this machine's kernel has no sch_netem (CONFIG_NET_SCH_NETEM unset;
only fifo, tbf, htb, ingress), so `delay_ms` here is applied with netem only
where the kernel has it; the pipeline benchmark instead passes delay 0 and
puts `relay_main` (a TCP relay that releases bytes D ms after they arrived, in
both directions, in order) in front of each node's sockets. Rate limits use
tbf, which this kernel has.

Topology (nothing touches the root namespace or any existing interface):

    netns <tag>-br:  bridge br0  -- v<i> ... (one port per node)
    netns <tag>-<node>: eth0 (veth peer of v<i>), 10.213.7.<i+1>/24, lo up,
                        root qdisc: netem delay D [rate R] on eth0 egress

Both ends of each veth are created directly inside their namespaces
(`ip link add eth0 netns A type veth peer name vI netns B`). Every packet
between two nodes leaves one eth0 and enters another, so a node-to-node hop
costs one netem delay D (RTT 2D) and is shaped to R. Namespaces are named
<tag>-..., tag = "flb<pid>" by default, and all of them are deleted on exit
(also after an error, and at interpreter exit if __exit__ never ran); deleting
a namespace deletes its veth ends and the bridge with it.
"""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
from typing import Sequence

SUBNET = "10.213.7"  # private /24 used only inside the lab's namespaces


class NetLabError(RuntimeError):
    """The lab could not be set up (no root, no iproute2, no netem)."""


def available() -> str | None:
    """None when a lab can be built here, else the reason it cannot."""
    if os.name != "posix" or not os.path.isdir("/proc/self/ns"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"{tool} (iproute2) is not installed"
    return None


def _run(*cmd: str) -> None:
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise NetLabError(f"{' '.join(cmd)} failed: {res.stderr.strip() or res.returncode}")


class NetLab:
    def __init__(self, nodes: Sequence[str], *, delay_ms: float = 0.0, rate_mbit: float | None = None,
                 tag: str | None = None, subnet: str = SUBNET):
        if not nodes or len(nodes) > 250:
            raise ValueError("a lab has 1..250 nodes")
        self.nodes = list(nodes)
        self.delay_ms = float(delay_ms)
        self.rate_mbit = rate_mbit
        self.tag = tag or f"flb{os.getpid()}"
        self.subnet = subnet
        self.bridge_ns = f"{self.tag}-br"
        self._created: list[str] = []

    def ns(self, node: str) -> str:
        return f"{self.tag}-{node}"

    def address(self, node: str) -> str:
        return f"{self.subnet}.{self.nodes.index(node) + 1}"

    def exec_prefix(self, node: str) -> list[str]:
        """Prepend to a command to run it inside `node`'s namespace."""
        return ["ip", "netns", "exec", self.ns(node)]

    def _add_ns(self, name: str) -> None:
        _run("ip", "netns", "add", name)
        self._created.append(name)
        _run("ip", "-n", name, "link", "set", "lo", "up")

    def __enter__(self) -> "NetLab":
        why = available()
        if why:
            raise NetLabError(why)
        atexit.register(self.close)
        try:
            self._add_ns(self.bridge_ns)
            _run("ip", "-n", self.bridge_ns, "link", "add", "br0", "type", "bridge")
            _run("ip", "-n", self.bridge_ns, "link", "set", "br0", "up")
            for i, node in enumerate(self.nodes):
                ns = self.ns(node)
                self._add_ns(ns)
                port = f"v{i}"
                _run("ip", "link", "add", "eth0", "netns", ns, "type", "veth",
                     "peer", "name", port, "netns", self.bridge_ns)
                _run("ip", "-n", self.bridge_ns, "link", "set", port, "master", "br0")
                _run("ip", "-n", self.bridge_ns, "link", "set", port, "up")
                _run("ip", "-n", ns, "addr", "add", f"{self.address(node)}/24", "dev", "eth0")
                _run("ip", "-n", ns, "link", "set", "eth0", "up")
                self._shape(ns)
        except BaseException:
            self.close()
            raise
        return self

    def _shape(self, ns: str) -> None:
        if self.delay_ms <= 0 and not self.rate_mbit:
            return
        if self.delay_ms > 0:
            cmd = ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "eth0", "root", "netem",
                   "limit", "100000", "delay", f"{self.delay_ms}ms"]
            if self.rate_mbit:
                cmd += ["rate", f"{self.rate_mbit}mbit"]
        else:  # rate only: a token bucket (burst 256 KB, at most 50 ms of queue)
            cmd = ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "eth0", "root", "tbf",
                   "rate", f"{self.rate_mbit}mbit", "burst", "256kb", "latency", "50ms"]
        _run(*cmd)

    def close(self) -> None:
        """Delete every namespace this lab created (idempotent, never raises)."""
        while self._created:
            name = self._created.pop()
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        try:
            atexit.unregister(self.close)
        except Exception:
            pass

    def __exit__(self, *exc) -> None:
        self.close()

    def ping_ms(self, src: str, dst: str, count: int = 3) -> float | None:
        """Median RTT in ms from src to dst (None if ping is missing or fails)."""
        if shutil.which("ping") is None:
            return None
        res = subprocess.run([*self.exec_prefix(src), "ping", "-c", str(count), "-i", "0.2", "-q",
                              self.address(dst)], capture_output=True, text=True)
        for line in res.stdout.splitlines():
            if "min/avg/max" in line:
                return float(line.split("=")[1].split("/")[1])
        return None


def existing(tag: str) -> list[str]:
    """Namespaces named <tag>-... (for tests checking that nothing is left behind)."""
    res = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    return [ln.split()[0] for ln in res.stdout.splitlines() if ln.startswith(tag + "-")]


# -- delaying relay (this kernel has no sch_netem) ---------------------------


async def _pump(reader, writer, delay_s: float) -> None:
    """Copy reader -> writer, releasing each chunk `delay_s` after it arrived (order kept)."""
    import asyncio

    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()

    async def release() -> None:
        while True:
            due, data = await queue.get()
            if data is None:
                break
            wait = due - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            writer.write(data)
            await writer.drain()
        writer.close()

    sender = asyncio.create_task(release())
    try:
        while True:
            data = await reader.read(1 << 16)
            if not data:
                break
            queue.put_nowait((loop.time() + delay_s, data))
    except (ConnectionError, OSError):
        pass
    finally:
        queue.put_nowait((0.0, None))
        try:
            await sender
        except (ConnectionError, OSError):
            pass


async def _relay(listen_host: str, listen_port: int, to_host: str, to_port: int, delay_s: float) -> None:
    import asyncio
    import json
    import socket
    import sys

    async def handle(reader, writer) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(to_host, to_port)
        except OSError:
            writer.close()
            return
        for w in (writer, up_writer):
            sock = w.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        await asyncio.gather(_pump(reader, up_writer, delay_s), _pump(up_reader, writer, delay_s))

    from engine.platform.process import parent_ref, watch

    # No orphans: exit when the process that started us is gone (pid + creation time).
    watch(parent_ref(os.getppid()), lambda: os._exit(3), name="relay-parent-watch")
    server = await asyncio.start_server(handle, listen_host, listen_port)
    port = server.sockets[0].getsockname()[1]
    print(json.dumps({"event": "bound", "endpoint": f"tcp://{listen_host}:{port}", "pid": os.getpid()}), flush=True)
    sys.stdout.close()
    async with server:
        await server.serve_forever()


def relay_main(argv: list[str] | None = None) -> int:
    """python -m engine.bench._netns relay --listen HOST:PORT --to HOST:PORT --delay-ms D"""
    import argparse

    from engine import aio

    p = argparse.ArgumentParser(prog="python -m engine.bench._netns relay")
    p.add_argument("--listen", required=True, help="HOST:PORT to listen on (PORT 0 = a free one)")
    p.add_argument("--to", required=True, help="HOST:PORT to forward to")
    p.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay added to every byte, both directions")
    a = p.parse_args(argv)
    lh, lp = a.listen.rsplit(":", 1)
    th, tp = a.to.rsplit(":", 1)
    try:
        aio.run(_relay(lh, int(lp), th, int(tp), a.delay_ms / 1000.0))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    import sys

    if len(sys.argv) > 1 and sys.argv[1] == "relay":
        sys.exit(relay_main(sys.argv[2:]))
    sys.exit("usage: python -m engine.bench._netns relay --listen HOST:PORT --to HOST:PORT --delay-ms D")
