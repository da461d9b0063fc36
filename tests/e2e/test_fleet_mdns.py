"""Discovery over real multicast between agent processes in separate network
namespaces on a bridge this test builds (tests/e2e/fleet_netns_lab.py).

Nodes 0-2 share a multicast-capable LAN; node 3's multicast is dropped at the
bridge. In every namespace an agent advertises and a browser (the controller's
view, `python -m engine.fleet.mdns browse`) prints events. Checked: each of
0-2 finds the other agents within 3 s of their announcement; a TXT change
(the user returns on node 0) reaches the others; a stopped agent disappears;
node 3 is invisible to mDNS but found by manual host:port, both ways.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from tests.e2e.fleet_netns_lab import NetnsLab, available, lab_env, reap_stale

REPO = Path(__file__).resolve().parents[2]
WHY_NOT = available()
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=WHY_NOT or "")
PORT = 47600




def _mdns_ids(browser, kind="added") -> dict[str, float]:
    return {e["node_id"]: e["t"] for e in list(browser.events)
            if e.get("event") == kind and e.get("source") == "mdns"}


def test_agents_in_namespaces_discover_each_other(tmp_path):
    reap_stale()
    with NetnsLab(4, blocked=(3,)) as lab:
        browsers, agents, idle = {}, {}, {}
        for i in range(4):
            manual = {0: [f"--manual={lab.ip(3)}:{PORT}"], 3: [f"--manual={lab.ip(0)}:{PORT}"]}.get(i, [])
            browsers[i] = lab.spawn(i, [sys.executable, "-m", "engine.fleet.mdns", "browse",
                                        f"--interface={lab.ip(i)}", "--poll=0.5", *manual],
                                    lab_env(tmp_path / f"b{i}"))
        for i in range(4):
            assert browsers[i].wait_for(lambda i=i: browsers[i].events, 20), browsers[i].err[-5:]
        for i in range(4):
            idle[i] = tmp_path / f"idle{i}"
            idle[i].write_text(f"{time.time() - 3600}\n")  # away for an hour: idle
            agents[i] = lab.spawn(i, [sys.executable, "-m", "engine.cli.agent_cmd", "--headless", "-v",
                                      f"--bind={lab.ip(i)}", f"--port={PORT}", f"--interface={lab.ip(i)}",
                                      f"--idle-source=file:{idle[i]}", "--mdns-ttl=10"],
                                  lab_env(tmp_path / f"a{i}"))
        node, up_at = {}, {}
        for i in range(4):
            line = agents[i].wait_for(lambda i=i: [x for x in agents[i].err if " up: control " in x[1]], 30)
            assert line, agents[i].err[-10:]
            node[i] = line[0][1].split(" agent ")[1].split()[0]
            up_at[i] = [t for t, x in agents[i].err if "announcing" in x][0]

        # 1. Each of 0-2 sees the two others over multicast within 3 s of their announcement.
        figures = []
        for i in range(3):
            others = {node[j]: j for j in range(3) if j != i}
            got = browsers[i].wait_for(lambda i=i, o=others: set(o) <= set(_mdns_ids(browsers[i])), 8)
            assert got, f"browser {i} saw {browsers[i].events}"
            for nid, j in others.items():
                delay = _mdns_ids(browsers[i])[nid] - up_at[j]
                figures.append(delay)
                assert delay < 3.0, f"node {j} took {delay:.2f} s to reach node {i}"

        # 2. A TXT update: the user of node 0 comes back; 1 and 2 see idle go false.
        idle[0].write_text(f"{time.time()}\n")
        t0 = time.time()
        for i in (1, 2):
            assert browsers[i].wait_for(lambda i=i: [e for e in browsers[i].events
                                                     if e.get("event") == "updated"
                                                     and e.get("node_id") == node[0]
                                                     and e.get("idle") is False], 5)
        txt_delay = time.time() - t0

        # 3. Node 3 (multicast dropped) is found by manual host:port, both ways,
        #    and never over mDNS.
        assert browsers[0].wait_for(lambda: [e for e in browsers[0].events if e.get("node_id") == node[3]
                                             and e.get("source") == "manual"], 5)
        assert browsers[3].wait_for(lambda: [e for e in browsers[3].events if e.get("node_id") == node[0]
                                             and e.get("source") == "manual"], 5)
        for i in (1, 2):
            assert node[3] not in _mdns_ids(browsers[i]), "multicast leaked past the blocked port"
        assert set(_mdns_ids(browsers[3])) <= {node[3]}, "node 3 should hear only itself"

        # 4. A stopped agent disappears (goodbye packets).
        agents[2].popen.terminate()
        t0 = time.time()
        for i in (0, 1):
            assert browsers[i].wait_for(lambda i=i: node[2] in _mdns_ids(browsers[i], "removed"), 5), \
                f"browser {i} still lists node 2: {browsers[i].events[-3:]} agent: {agents[2].err[-8:]}"
        gone_delay = time.time() - t0
        assert agents[2].popen.wait(10) == 0

        print(f"\nmDNS: discovery {min(figures):.2f}-{max(figures):.2f} s after the agent starts announcing "
              f"(6 pairs); TXT update {txt_delay:.2f} s; removal {gone_delay:.2f} s")
