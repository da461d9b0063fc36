"""Address selection across two network namespaces, with decoy interfaces.

A throw-away LAN (tests/e2e/fleet_netns_lab.py): the agent in namespace 0, the
controller in namespace 1, on a bridge in a third; everything is deleted afterwards,
also on failure. Namespace 0 also has
  eth1     10.77.S.1/24, up: a decoy. The controller has an eth1 on 10.77.S.0/24 too,
           so by subnet the decoy looks like the best address, but the two eth1 are
           separate wires (like the WSL NAT subnet that exists on every Windows PC)
  docker0  a bridge on 172.31.S.1/24 (what Docker makes): never to be announced
  eth2     10.88.S.1/24, link down: never to be announced
The controller's LAN address is a /32 with an on-link route to the lab subnet (a
controller on another subnet, reached by a route), so the agent's real address ranks
below the decoy: the dial order is decoy, then real, whatever order mDNS delivers the
A records in. The agent runs with no --interface (what real users get). Checked: it
announces the decoy and the LAN address and nothing else; the controller (run as
`python tests/e2e/test_fleet_addresses_netns.py controller ...` in namespace 1) dials
the decoy, gives up after its short timeout, reaches the agent on the LAN address and
lists that one first; a CURVE handshake to Peer.endpoint() then reaches the agent's
control port (which refuses our unpaired key: "not paired").
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path


REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from tests.e2e.fleet_netns_lab import NetnsLab, available, lab_env, reap_stale  # noqa: E402

WHY_NOT = available()  # root + ip netns; CI runs as root: a missing one is a failure, not a skip
PORT = 47600
DIAL_TIMEOUT_S = 1.0




def _ip(ns: str, *args: str) -> None:
    subprocess.run(["ip", "-n", ns, *args], check=True, capture_output=True, timeout=20)


def _decoys(lab: NetnsLab, s: int) -> tuple[str, str, str]:
    """Add the decoy interfaces (module docstring); returns (decoy, docker0, down) addresses."""
    agent, ctl = lab.ns(0), lab.ns(1)
    for ns, addr in ((agent, f"10.77.{s}.1/24"), (ctl, f"10.77.{s}.5/24")):
        _ip(ns, "link", "add", "eth1", "type", "veth", "peer", "name", "eth1p")
        _ip(ns, "addr", "add", addr, "dev", "eth1")
        _ip(ns, "link", "set", "eth1", "up")
        _ip(ns, "link", "set", "eth1p", "up")
    _ip(agent, "link", "add", "docker0", "type", "bridge")
    _ip(agent, "addr", "add", f"172.31.{s}.1/24", "dev", "docker0")
    _ip(agent, "link", "set", "docker0", "up")
    _ip(agent, "link", "add", "eth2", "type", "veth", "peer", "name", "eth2p")
    _ip(agent, "addr", "add", f"10.88.{s}.1/24", "dev", "eth2")  # left down
    _ip(ctl, "addr", "del", f"{lab.ip(1)}/24", "dev", "v1")
    _ip(ctl, "addr", "add", f"{lab.ip(1)}/32", "dev", "v1")
    _ip(ctl, "route", "add", f"10.231.{s}.0/24", "dev", "v1")
    return f"10.77.{s}.1", f"172.31.{s}.1", f"10.88.{s}.1"


def test_controller_reaches_the_agent_through_the_address_that_answers(tmp_path):
    assert WHY_NOT is None, f"network namespaces are needed (run as root): {WHY_NOT}"
    reap_stale()
    with NetnsLab(2) as lab:
        s = lab.subnet
        decoy, docker, down = _decoys(lab, s)
        real = lab.ip(0)
        idle = tmp_path / "idle"
        idle.write_text(f"{time.time() - 3600}\n")
        agent = lab.spawn(0, [sys.executable, "-m", "engine.cli.agent_cmd", "--headless", "-v",
                              f"--port={PORT}", f"--idle-source=file:{idle}", "--mdns-ttl=10"],
                          lab_env(tmp_path / "agent"))
        line = agent.wait_for(lambda: [x for x in agent.err if " up: control " in x[1]], 30)
        assert line, agent.err[-10:]
        node = line[0][1].split(" agent ")[1].split()[0]
        announced = [x for _, x in agent.err if "announcing" in x][0]
        listed = announced.split("(")[-1].rstrip(")").split(", ")
        assert sorted(listed) == sorted([decoy, real]), f"the agent announced {listed}"  # no docker0, no eth2

        ctl = lab.spawn(1, [sys.executable, __file__, "controller", f"--interface={lab.ip(1)}",
                            f"--node={node}", "--seconds=25"], lab_env(tmp_path / "ctl"))
        found = ctl.wait_for(lambda: [e for e in ctl.events if e.get("event") == "found"], 30)
        assert found, f"controller: {ctl.events} {ctl.err[-10:]}"
        peer = found[0]
        assert peer["addresses"] == [real, decoy] and peer["reached"] == real, peer
        assert docker not in peer["addresses"] and down not in peer["addresses"]
        # The decoy was dialed first and given up after its short timeout, not a TCP one (minutes).
        assert DIAL_TIMEOUT_S <= peer["dial_s"] < DIAL_TIMEOUT_S + 5.0, peer
        probe = ctl.wait_for(lambda: [e for e in ctl.events if e.get("event") == "probe"], 20)
        assert probe and probe[0]["endpoint"] == f"tcp://{real}:{PORT}", probe
        assert probe[0]["result"] == "not paired", probe  # the control port answered, via the LAN address
        assert ctl.popen.wait(30) == 0, ctl.err[-10:]
        print(f"\naddresses: found {peer['dial_s']:.2f} s after the browser saw the agent "
              f"(decoy timeout {DIAL_TIMEOUT_S:g} s), CURVE probe {probe[0]['probe_s']:.2f} s")


# ----------------------------------------------------------- the controller, in namespace 1


def controller(argv: list[str]) -> int:
    import argparse
    import asyncio

    from engine import aio
    from engine.fleet.client import AgentClient, NotPaired
    from engine.fleet.mdns import MdnsDiscovery
    from engine.transport.security import KeyPair

    ap = argparse.ArgumentParser()
    ap.add_argument("--interface", required=True)
    ap.add_argument("--node", required=True)
    ap.add_argument("--seconds", type=float, default=25)
    a = ap.parse_args(argv)

    def emit(**kw) -> None:
        print(json.dumps(kw), flush=True)

    async def main() -> None:
        seen_at: dict[str, float] = {}
        got: asyncio.Future = asyncio.get_running_loop().create_future()
        disc = MdnsDiscovery([a.interface], dial_timeout=DIAL_TIMEOUT_S)
        real_resolve = disc._resolve

        async def timed_resolve(name: str, epoch: int) -> None:  # when the browser first saw it
            seen_at.setdefault(name, time.monotonic())
            await real_resolve(name, epoch)

        disc._resolve = timed_resolve  # type: ignore[method-assign]

        def on(kind: str, peer) -> None:
            if peer.node_id == a.node and kind == "added" and not got.done():
                got.set_result(peer)

        disc.add_listener(on)
        await disc.async_start()
        try:
            peer = await asyncio.wait_for(got, a.seconds)
            dial_s = time.monotonic() - min(seen_at.values())
            emit(event="found", addresses=list(peer.addresses), reached=peer.reached, dial_s=dial_s)
            client = AgentClient(KeyPair.generate(), peer.endpoint(), peer.info.public_key, timeout=10.0)
            t0 = time.monotonic()
            try:
                await client.async_connect()
                result = "paired?!"
            except NotPaired:
                result = "not paired"
            except Exception as e:  # unreachable: the failure this test is about
                result = f"error: {type(e).__name__}: {e}"
            finally:
                client.close()
            emit(event="probe", endpoint=peer.endpoint(), result=result, probe_s=time.monotonic() - t0)
        finally:
            await disc.async_close()

    aio.run(main())
    return 0


if __name__ == "__main__" and sys.argv[1:2] == ["controller"]:
    sys.exit(controller(sys.argv[2:]))
