"""Units of the fleet launcher: shard bundles, demo mode's gate, worker command
rendering, peer profiles, data-plane CURVE and the new wire fields."""

from __future__ import annotations

import io
import json
import os
import tarfile
import time
from pathlib import Path

import msgpack
import pytest
import zmq

from engine.fleet import bundle, demo_mode
from engine.transport.curve_data import CurveEnd, LocalRingKeys, write_curve_file
from engine.fleet.discovery import Peer
from engine.fleet.launch_plan import peer_links, peer_profile
from engine.transport.security import KeyPair
from engine.fleet.workers import pipeline_worker_command, render_command
from engine.protocol.codec import decode, encode
from engine.protocol.control import AgentInfo, DeviceInfo, LoadReply, LoadRequest, ShardInfo
from engine.protocol.errors import ProtocolError
from engine.protocol.pipeline import StageConfigure

SHA = "ab" * 32


# ---------------------------------------------------------------- bundles


def _shard(tmp: Path) -> Path:
    d = tmp / "shard"
    d.mkdir()
    (d / "shard.xml").write_text("<net/>")
    (d / "shard.bin").write_bytes(os.urandom(3000))
    (d / "shard.json").write_text("{}")
    return d


def test_bundle_is_deterministic_and_round_trips(tmp_path):
    d = _shard(tmp_path)
    a, sha_a = bundle.pack(d, tmp_path / "a.tar")
    os.utime(d / "shard.bin", (1, 1))  # times and owners do not enter the bundle
    b, sha_b = bundle.pack(d, tmp_path / "b.tar")
    assert sha_a == sha_b and a.read_bytes() == b.read_bytes()
    out = bundle.unpack(a, tmp_path / "x.d")
    assert sorted(p.name for p in out.iterdir()) == ["shard.bin", "shard.json", "shard.xml"]
    assert (out / "shard.bin").read_bytes() == (d / "shard.bin").read_bytes()
    view, sha = bundle.cached_bundle(d, tmp_path / "cache")
    assert sha == sha_a and view.size == a.stat().st_size
    assert not list((tmp_path / "cache").glob("*.tar"))  # no archive on the controller's disk
    assert bundle.cached_bundle(d, tmp_path / "cache")[1] == sha  # the kept hash


def _evil_tar(path: Path, member: tarfile.TarInfo, data: bytes = b"x") -> Path:
    with tarfile.open(path, "w") as tar:
        member.size = len(data) if member.isreg() else 0
        tar.addfile(member, io.BytesIO(data) if member.isreg() else None)
    return path


@pytest.mark.parametrize("make", [
    lambda: tarfile.TarInfo("../escape"),
    lambda: tarfile.TarInfo("/etc/passwd"),
    lambda: tarfile.TarInfo("sub/shard.bin"),
    lambda: _link("shard.bin", "/etc/shadow", tarfile.SYMTYPE),
    lambda: _link("shard.bin", "/etc/shadow", tarfile.LNKTYPE),
])
def test_bundle_refuses_anything_but_plain_files(tmp_path, make):
    evil = _evil_tar(tmp_path / "evil.tar", make())
    with pytest.raises(bundle.BundleError):
        bundle.unpack(evil, tmp_path / "out.d")
    assert not (tmp_path / "out.d").exists() and not (tmp_path.parent / "escape").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["evil.tar"]  # no temp folder left


def _link(name: str, target: str, kind: bytes) -> tarfile.TarInfo:
    t = tarfile.TarInfo(name)
    t.type, t.linkname = kind, target
    return t


def test_not_a_bundle_is_not_unpacked(tmp_path):
    raw = tmp_path / "raw"
    raw.write_bytes(os.urandom(10000))
    assert not bundle.is_bundle(raw)
    with pytest.raises(bundle.BundleError):
        bundle.unpack(raw, tmp_path / "raw.d")


# ---------------------------------------------------------------- demo mode


def test_demo_auto_pair_only_in_a_demo_dir():
    key = KeyPair.generate().public
    root = demo_mode.make_demo_root()
    try:
        cfg = demo_mode.make_agent_dir(root, "agent-0", key)
        grant = demo_mode.check_demo_dir(cfg, "127.0.0.1")
        assert grant.controller_key == key and grant.parent_pid == os.getpid()
        with pytest.raises(ValueError, match="127.0.0.1"):
            demo_mode.check_demo_dir(cfg, "*")  # never reachable from the LAN
        os.chmod(cfg / demo_mode.MARKER, 0o644)
        with pytest.raises(ValueError, match="private config dir"):
            demo_mode.check_demo_dir(cfg, "127.0.0.1")
        os.chmod(cfg / demo_mode.MARKER, 0o600)
        os.chmod(root, 0o755)
        with pytest.raises(ValueError, match="private config dir"):
            demo_mode.check_demo_dir(cfg, "127.0.0.1")
        os.chmod(root, 0o700)
        (cfg / demo_mode.MARKER).write_text(json.dumps({"controller_key": key, "parent_pid": 1,
                                                         "created": time.time() - 3 * 86400}))
        os.chmod(cfg / demo_mode.MARKER, 0o600)
        with pytest.raises(ValueError, match="stale"):
            demo_mode.check_demo_dir(cfg, "127.0.0.1")
    finally:
        import shutil

        shutil.rmtree(root)


def test_demo_auto_pair_refuses_an_ordinary_config_dir(tmp_path):
    cfg = tmp_path / "agent"
    cfg.mkdir(mode=0o700)
    with pytest.raises(ValueError, match="flotilla demo"):
        demo_mode.check_demo_dir(cfg, "127.0.0.1")
    # Even with a marker copied in: the folder is not a demo root under the temp dir.
    (cfg / demo_mode.MARKER).write_text(json.dumps({"controller_key": KeyPair.generate().public,
                                                     "parent_pid": os.getpid(), "created": time.time()}))
    os.chmod(cfg / demo_mode.MARKER, 0o600)
    with pytest.raises(ValueError, match="flotilla demo"):
        demo_mode.check_demo_dir(cfg, "127.0.0.1")


def test_agent_cli_refuses_demo_flag_outside_demo(tmp_path):
    import subprocess
    import sys

    from fleet_helpers import REPO, fleet_env

    res = subprocess.run([sys.executable, "-m", "engine.cli.agent_cmd", "--headless", "--bind", "127.0.0.1",
                          "--port", "0", "--no-mdns", "--demo-auto-pair"], env=fleet_env(tmp_path / "cfg"),
                         cwd=REPO, capture_output=True, text=True, timeout=60)
    assert res.returncode == 1 and "flotilla demo" in res.stderr


# ---------------------------------------------------------------- worker command


def test_pipeline_worker_command_renders_every_placeholder(tmp_path):
    argv = render_command(pipeline_worker_command(), shard=tmp_path / "s.d", sha256=SHA, device="GPU.0", port=0,
                          bind_host="10.0.0.2", exact=False, curve=tmp_path / "c.json", cache=tmp_path / "ov")
    assert argv[1:3] == ["-m", "engine.shards.worker"]
    assert argv[argv.index("--bind") + 1] == "tcp://10.0.0.2:*"
    assert argv[argv.index("--curve") + 1] == str(tmp_path / "c.json")
    assert argv[argv.index("--parent-pid") + 1] == str(os.getpid())
    assert "--exact" not in argv and "" not in argv
    exact = render_command(pipeline_worker_command(), shard=tmp_path, sha256=SHA, device="CPU", port=5000,
                           exact=True)
    assert exact[-1] == "--exact" and exact[exact.index("--bind") + 1] == "tcp://*:5000"
    kv = render_command(pipeline_worker_command(), shard=tmp_path, sha256=SHA, device="CPU", port=0,
                        curve=tmp_path / "c.json", cache=tmp_path / "ov",
                        kv_precision="f16")  # LoadRequest.kv_precision: the exact prompt cache's
    assert kv[-1] == "--kv-precision=f16" and "--kv-precision=f16" not in argv
    # The worker accepts what the agent renders.
    from engine.shards.worker import parse_args

    cfg = parse_args(argv[3:])
    assert cfg.bind == "tcp://10.0.0.2:*" and cfg.curve == tmp_path / "c.json" and cfg.device == "GPU.0"
    assert cfg.kv_precision is None and parse_args(kv[3:]).kv_precision == "f16"


# ---------------------------------------------------------------- profiles


def _info(node: str, key: str, ram: int, devices=("CPU",)) -> AgentInfo:
    return AgentInfo(node, "pc", "Linux", "0", 1, tuple(DeviceInfo(d, "") for d in devices), ram * 2, ram,
                     True, None, True, 1, 2, 3, key, "0" * 16)


def test_peer_profiles_and_links():
    a = Peer(_info("a" * 32, KeyPair.generate().public, 10**9, ("CPU", "GPU.0", "FPGA")), ("10.0.0.1",), "mdns", 0)
    b = Peer(_info("b" * 32, KeyPair.generate().public, 2 * 10**9), ("10.0.0.1",), "mdns", 0)
    c = Peer(_info("c" * 32, KeyPair.generate().public, 10**9), ("10.0.0.2",), "manual", 0)
    prof = peer_profile(a)
    assert [(d.kind, d.name) for d in prof.devices] == [("CPU", "CPU"), ("GPU", "GPU.0")]
    assert prof.ram_free_bytes == 10**9 and prof.peer_id == "a" * 32
    links = peer_links([a, b, c])
    assert list(links) == [("a" * 32, "b" * 32)]  # same address: loopback; c is over the LAN


# ---------------------------------------------------------------- CURVE on the data plane


def test_data_plane_curve_admits_listed_keys_only(tmp_path):
    ring = LocalRingKeys(1, tmp_path / "keys")
    worker = CurveEnd.load(ring.curve_files[0])
    assert worker.public == ring.public_keys[0]
    assert oct(ring.curve_files[0].stat().st_mode & 0o777) == "0o600"
    ctx = zmq.Context()
    srv = ctx.socket(zmq.ROUTER)
    zap = worker.serve(ctx, srv)
    port = srv.bind_to_random_port("tcp://127.0.0.1")
    socks = [srv]
    try:
        def talk(keys: KeyPair | None) -> bool:
            s = ctx.socket(zmq.DEALER)
            s.linger = 0
            socks.append(s)
            if keys is not None:
                CurveEnd(keys).client(s, worker.public)
            s.connect(f"tcp://127.0.0.1:{port}")
            s.send(b"hello")
            return bool(srv.poll(1500))

        assert not talk(KeyPair.generate())  # a stranger
        assert not talk(None)  # plaintext
        assert talk(ring.coordinator.keys)  # the coordinator of this ring
        assert zap.denied >= 1
        with pytest.raises(ValueError, match="no CURVE key"):
            CurveEnd(KeyPair.generate()).client(ctx.socket(zmq.DEALER), "")
    finally:
        for s in socks:
            s.close(0)
        zap.stop()
        ctx.term()
        ring.cleanup()
    assert not ring.folder.exists()


def test_curve_file_names_the_secret_file_and_never_holds_the_secret(tmp_path):
    keys = KeyPair.generate()
    secret = tmp_path / "node_key.secret"
    secret.write_text(keys.secret)
    path = write_curve_file(tmp_path / "w.json", secret, ["not a key", keys.public], tmp_path / "allow.json")
    text = path.read_text()
    assert keys.secret not in text and json.loads(text)["allow"] == [keys.public]
    assert CurveEnd.load(path).keys == keys


# ---------------------------------------------------------------- wire fields


def test_new_wire_fields_are_validated():
    key = KeyPair.generate().public
    req = LoadRequest("r", SHA, "CPU", 0, True, (key,))
    assert decode(encode(req)) == req
    with pytest.raises(ProtocolError):
        LoadRequest("r", SHA, "CPU", 0, False, ("not-a-key",))
    env = msgpack.unpackb(encode(req))
    env["b"]["exact"] = "yes"  # a value of the wrong type is the wire's to refuse (and mypy's in code)
    with pytest.raises(ProtocolError):
        decode(msgpack.packb(env))
    reply = LoadReply("r", ShardInfo("s", SHA, 1, 1, "running", 5, None, "CPU"), 40000)
    assert decode(encode(reply)).data_port == 40000
    with pytest.raises(ProtocolError):
        LoadReply("r", reply.shard, 70000)
    conf = StageConfigure("tcp://10.0.0.1:5000", 0, 2, "stage 0", key)
    assert decode(encode(conf)) == conf
    assert StageConfigure("tcp://10.0.0.1:5000", 0, 2, "stage 0").next_key == ""
    with pytest.raises(ProtocolError):
        StageConfigure("tcp://10.0.0.1:5000", 0, 2, "stage 0", "short")


# ---------------------------------------------------------------- refusals


def test_a_refused_stage_is_reported_from_the_refusal_fields():
    """The launcher's error for a stage an agent refused comes from the Refusal's
    fields (the agent's text is for its log), names stage, peer, device, reason and
    numbers on one line, and reports every refusing stage at once."""
    from engine.fleet.client import AgentRefused, FleetError
    from engine.fleet.launch_errors import _raise_refusals, _refused
    from engine.fleet.ring_stage import _Stage
    from engine.fleet.refusal import StageRefused, describe
    from engine.planner.plan import PlanError
    from engine.protocol.errors import BYTE_REASONS, REFUSAL_REASONS, Refusal
    from engine.protocol.messages import ErrorReply

    def refused(refusal: Refusal, text: str = "needs 3.12 GB [ram] 9 GB") -> AgentRefused:
        return AgentRefused(ErrorReply("r", "refused", text, refusal))

    laptop = Peer(_info("a" * 32, KeyPair.generate().public, 10**9), ("10.0.0.1",), "manual", 0)
    st1 = _Stage(1, laptop, "GPU.0", 16, 32)
    e = _refused(st1, refused(Refusal("policy_cap", 3_120_000_000, 2_000_000_000)), "load")
    assert isinstance(e, StageRefused) and isinstance(e, PlanError) and isinstance(e, FleetError)
    assert str(e) == ("pc (0000000000000000) refused stage 1 (layers 16–32 on GPU.0): over its owner's "
                      "RAM limit for fleet work: needs 3.12 GB, the limit leaves 2.00 GB")
    [r] = e.refusals
    assert (r.stage, r.step, r.device, r.refusal.reason) == (1, "load", "GPU.0", "policy_cap")
    assert [(i.stage, i.code, i.shortfall_bytes) for i in e.issues] == [(1, "policy_cap", 1_120_000_000)]

    st0 = _Stage(0, laptop, "CPU", 0, 16)
    disk = _refused(st0, refused(Refusal("disk", 9_000_000_000, 512_300_000)), "prepare")
    with pytest.raises(StageRefused) as both:
        _raise_refusals([None, e, disk])
    assert [(r.stage, r.refusal.reason) for r in both.value.refusals] == [(0, "disk"), (1, "policy_cap")]
    assert str(both.value) == f"{disk}; {e}" and "\n" not in str(both.value)
    assert "not enough free disk for the shard: needs 9.00 GB, 512.3 MB free" in str(disk)

    # Any other answer names the peer with the agent's line and code, and is no refusal.
    lost = _refused(st0, AgentRefused(ErrorReply("r", "not_found", "shard not cached here")), "load")
    assert type(lost) is FleetError
    assert str(lost) == "pc (0000000000000000) cannot take stage 0 (layers 0–16): shard not cached here (not_found)"
    with pytest.raises(FleetError) as mixed:
        _raise_refusals([e, lost])
    assert not isinstance(mixed.value, StageRefused) and str(mixed.value) == f"{e}; {lost}"
    _raise_refusals([None, None])  # no stage failed

    # Every reason reads as words; only the byte reasons have numbers.
    for reason in REFUSAL_REASONS:
        text = describe(Refusal(reason, *((2_000_000, 1_000_000) if reason in BYTE_REASONS else (0, 0))))
        assert text and ("needs 2.0 MB" in text) == (reason in BYTE_REASONS)
    assert describe(Refusal("ram", 3_100_000_000, 2_000_000_000)) == (
        "not enough free RAM: needs 3.10 GB, 2.00 GB free after the OS reserve")
