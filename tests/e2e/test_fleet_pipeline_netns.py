"""A 2-stage pipeline across network namespaces, CURVE on every socket.

The test builds a throw-away LAN (tests/e2e/fleet_netns_lab.py): agents in
namespaces 0 and 1, the controller in namespace 2, on a bridge in a fourth.
Nothing else is addressed; everything is deleted afterwards. The controller
(tests/e2e/fleet_pipeline_controller.py) finds the agents over real multicast
on its own interface, pairs (the test types the codes on the agents with
`flotilla agent pair --accept`), plans, sends the shards, loads real shard
workers and runs greedy requests through the ring. Checked:
- the answers equal transformers greedy (f32, 32 tokens, 2 interleaved streams);
- a stranger's key is refused by a worker's data socket, a plaintext client
  gets nothing;
- when agent 1's user comes back, the controller reports which stage yielded,
  and the next request fails at once with that reason.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.e2e.fleet_netns_lab import NetnsLab, available, lab_env, reap_stale

pytest.importorskip("openvino")
torch = pytest.importorskip("torch")

REPO = Path(__file__).resolve().parents[2]
WHY_NOT = available()
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=WHY_NOT or "")
PORT = 47600
PROMPTS = ["Tell me about the sea.", "What is the weather like on the lake today, and why?"]
TOKENS = 32




def _reference(prompts: list[str], n: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.models.demo import ensure_demo
    from engine.protocol.messages import ChatMessage
    from engine.runtime.chat import chat_ids

    path = ensure_demo("demo")
    tok = AutoTokenizer.from_pretrained(str(path))
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    out = []
    for p in prompts:
        ids = chat_ids(tok, (ChatMessage("user", p),))
        x = torch.tensor([ids])
        with torch.inference_mode():
            y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False)
        out.append(y[0, len(ids):].tolist())
    return out


def _event(proc, name: str, timeout: float) -> dict:
    got = proc.wait_for(lambda: [e for e in proc.events if e.get("event") in (name, "error")], timeout)
    assert got, f"no {name!r} from the controller; last events {proc.events[-3:]}, stderr {proc.err[-15:]}"
    assert got[0]["event"] == name, got[0]
    return got[0]


def test_pipeline_across_namespaces_with_curve(tmp_path):
    from engine.fleet.policy import SharingPolicy

    reap_stale()
    reference = _reference(PROMPTS, TOKENS)
    with NetnsLab(3) as lab:
        agents, idle, keys = {}, {}, []
        for i in (0, 1):
            cfg = tmp_path / f"a{i}"
            cfg.mkdir()
            SharingPolicy(max_cpu_percent_to_start=100.0, require_ac=False).save(cfg)
            idle[i] = tmp_path / f"idle{i}"
            idle[i].write_text(f"{time.time() - 3600}\n")  # away for an hour
            agents[i] = lab.spawn(i, [sys.executable, "-m", "engine.cli.agent_cmd", "--headless", "-v",
                                      f"--bind={lab.ip(i)}", f"--port={PORT}", f"--interface={lab.ip(i)}",
                                      f"--idle-source=file:{idle[i]}", "--mdns-ttl=10"], lab_env(cfg))
        for i in (0, 1):
            assert agents[i].wait_for(lambda i=i: [x for x in agents[i].err if " up: control " in x[1]], 30), \
                agents[i].err[-10:]
            keys.append((tmp_path / f"a{i}" / "node_key.public").read_text().strip())
        argv = [sys.executable, str(REPO / "tests/e2e/fleet_pipeline_controller.py"),
                f"--interface={lab.ip(2)}", f"--config={tmp_path / 'ctl'}", f"--tokens={TOKENS}",
                *(f"--agent-key={k}" for k in keys), *(f"--prompt={p}" for p in PROMPTS)]
        ctl = lab.spawn(2, argv, lab_env(tmp_path / "ctl"))

        found = _event(ctl, "found", 30)
        assert {p["source"] for p in found["peers"]} == {"mdns"}
        assert {p["addresses"][0] for p in found["peers"]} == {lab.ip(0), lab.ip(1)}
        # The owner of each agent types the code the controller shows.
        ids = {json.loads((tmp_path / f"a{i}" / "identity.json").read_text())["node_id"]: i for i in (0, 1)}
        for _ in range(2):
            pending = [e for e in ctl.events if e.get("event") == "code" and not e.get("done")]
            code = pending[0] if pending else _event(ctl, "code", 10)
            code["done"] = True
            i = ids[code["node_id"]]
            res = subprocess.run([sys.executable, "-m", "engine.cli.agent_cmd", "pair", "--accept", code["code"]],
                                 env=lab_env(tmp_path / f"a{i}"), capture_output=True, text=True, timeout=60)
            assert res.returncode == 0, res.stderr

        launched = _event(ctl, "launched", 120)
        plan = launched["summary"]["plan"]
        assert [st["layers"] for st in plan] == [[0, 4], [4, 8]]
        assert {st["node_id"] for st in plan} == set(ids)
        assert launched["return_endpoint"].startswith(f"tcp://{lab.ip(2)}:")
        refused = _event(ctl, "refused", 30)
        assert refused["stranger"] == "refused" and refused["plaintext"] == "no answer", refused

        answers = _event(ctl, "answers", 120)
        assert answers["ids"] == reference, "fleet pipeline differs from transformers greedy"

        # The user of the agent running stage 1 comes back.
        yielded = ids[plan[1]["node_id"]]
        idle[yielded].write_text(f"{time.time()}\n")
        t0 = time.time()
        ev = _event(ctl, "fleet_event", 20)
        delay = time.time() - t0
        assert ev["kind"] in ("yielding", "yield") and ev["stage"] == 1 and "yield" in ev["message"], ev
        after = _event(ctl, "after_yield", 30)
        assert after["finish_reason"] in ("error", "refused") and "yield" in after["error"], after
        _event(ctl, "done", 30)
        assert ctl.popen.wait(30) == 0, ctl.err[-10:]
        print(f"\nnetns pipeline: launch {launched['summary']['timings_s']}, {answers['tok_s']} tok/s "
              f"(2 streams, f32, CURVE), yield reported in {delay:.2f} s")
