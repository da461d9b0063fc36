"""Unit tests of the fleet's pure parts: messages, pairing codes, keys,
identity/clone repair, policy rules, TXT records, the shard store."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import os
import stat

import msgpack
import msgspec
import pytest

from engine.fleet.discovery import ManualPeers, parse_hostport
from engine.fleet.idle import FileIdleSource
from engine.fleet.identity import Fingerprint, NodeIdentity
from engine.fleet.policy import MachineState, SharingPolicy, check_start, evaluate
from engine.transport.security import KeyBook, KeyPair, PairingBook, fingerprint, pairing_code
from engine.fleet.shards import ShardStore
from engine.fleet.txt import from_txt, to_txt
from engine.protocol.codec import decode, encode
from engine.protocol.control import AgentInfo, DeviceInfo, LoadRequest, PairReply, ShardInfo
from engine.protocol.errors import ProtocolError

KEY = KeyPair.generate()


def _info(**kw) -> AgentInfo:
    base = dict(node_id="a" * 32, hostname="pc-1", os="Linux 6.8", version="0.1.0", protocol=1,
                devices=(DeviceInfo("CPU", "Intel Core Ultra 7"), DeviceInfo("GPU.0", "Arc")),
                ram_total=32 * 2**30, ram_available=20 * 2**30, idle=True, idle_since=1.7e9,
                on_ac=True, control_port=47600, pair_port=47601, info_port=47602,
                public_key=KEY.public, fingerprint=KEY.fingerprint)
    base.update(kw)
    return AgentInfo(**base)


def test_control_messages_round_trip_and_validate():
    info = _info()
    assert decode(encode(info)) == info
    shard = ShardInfo("m/L0-8", "0" * 64, 10, 10, "running", 42, None, "CPU")
    assert decode(encode(shard)) == shard
    for bad in (dict(node_id="x"), dict(public_key="short"), dict(control_port=0)):
        with pytest.raises(ProtocolError):
            _info(**bad)
    env = msgpack.unpackb(encode(info))
    env["b"]["idle"] = 1  # a value of the wrong type is the wire's to refuse (and mypy's in code)
    with pytest.raises(ProtocolError):
        decode(msgpack.packb(env))
    with pytest.raises(ProtocolError):
        LoadRequest("r", "0" * 64, "CPU; rm -rf /", 0)
    with pytest.raises(ProtocolError):
        PairReply("r", "maybe", "123456", "pc")
    with pytest.raises(ProtocolError):
        ShardInfo("x", "0" * 64, 1, 1, "flying", None, None, None)


def test_txt_round_trip_and_strictness():
    info = _info()
    txt = to_txt(info)
    assert all(len(k) + len(v) + 1 <= 255 for k, v in txt.items())
    assert sum(len(k) + len(v) + 2 for k, v in txt.items()) < 1300  # fits one packet
    back = from_txt({k.encode(): v.encode() for k, v in txt.items()})
    assert back == msgspec.structs.replace(info, idle_since=float(int(info.idle_since)))
    txt["cp"] = "99999999"
    with pytest.raises(ProtocolError):
        from_txt({k.encode(): v.encode() for k, v in txt.items()})
    with pytest.raises(ProtocolError):
        from_txt({b"id": b"\xff"})


def test_pairing_code_is_symmetric_six_digits_and_key_bound():
    a, b, c = KeyPair.generate(), KeyPair.generate(), KeyPair.generate()
    code = pairing_code(a.public, b.public)
    assert code == pairing_code(b.public, a.public) and len(code) == 6 and code.isdigit()
    assert pairing_code(a.public, c.public) != code or pairing_code(c.public, b.public) != code


def test_keys_are_private_files_and_stable(tmp_path):
    k1 = KeyPair.load_or_create(tmp_path)
    assert stat.S_IMODE((tmp_path / "node_key.secret").stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "node_key.public").stat().st_mode) == 0o600
    assert KeyPair.load_or_create(tmp_path) == k1


def test_identity_survives_restarts_and_is_repaired_on_clone(tmp_path):
    here = Fingerprint("m1", ("mac-a", "mac-b"))
    first = NodeIdentity.load(tmp_path, here)
    PairingBook(tmp_path).allowed.add(KEY.public, "admin")
    assert NodeIdentity.load(tmp_path, here).node_id == first.node_id
    nic_added = NodeIdentity.load(tmp_path, Fingerprint("m1", ("mac-a", "mac-b", "mac-c")))
    assert nic_added.node_id == first.node_id and not nic_added.repaired
    clone = NodeIdentity.load(tmp_path, Fingerprint("m2", ("mac-z",)))
    assert clone.repaired and clone.node_id != first.node_id and clone.keys != first.keys
    assert KEY.public in PairingBook(tmp_path).allowed  # the allow-list is kept
    vm_clone = NodeIdentity.load(tmp_path, Fingerprint("m2", ("mac-new",)))  # same machine-id, new MACs
    assert vm_clone.repaired


def test_pairing_book_accept_revoke_and_flood_cap(tmp_path):
    book = PairingBook(tmp_path)
    ctl = KeyPair.generate()
    state, code = book.request(ctl.public, "laptop", KEY.public)
    assert state == "pending" and code == pairing_code(KEY.public, ctl.public)
    with pytest.raises(LookupError):
        book.accept("000000" if code != "000000" else "111111")
    assert book.accept(code) == "laptop"
    assert book.request(ctl.public, "laptop", KEY.public)[0] == "accepted"
    assert KeyBook(tmp_path / "paired_controllers.json").revoke(fingerprint(ctl.public)[:8]) == ["laptop"]
    assert ctl.public not in book.allowed
    for _ in range(40):
        book.request(KeyPair.generate().public, "spam", KEY.public)
    assert len(book.pending()) == 16


def _state(idle_s=3600.0, on_ac=True, avail=16 * 10**9, cpu=5.0) -> MachineState:
    return MachineState(idle_s, on_ac, 32 * 10**9, avail, cpu, 1.7e9)


def test_policy_rules():
    p = SharingPolicy(idle_minutes=5, require_ac=True, max_ram_gb=8, devices=("CPU", "GPU"))
    assert evaluate(p, _state()).share
    assert evaluate(p, _state(idle_s=10)).reason == "user active"
    assert evaluate(p, _state(idle_s=None)).reason == "idle time unknown"
    assert evaluate(p, _state(on_ac=False)).reason == "on battery"
    assert evaluate(dataclasses.replace(p, require_ac=False), _state(on_ac=False)).share
    assert evaluate(p, _state(on_ac=None)).share
    assert not evaluate(dataclasses.replace(p, enabled=False), _state()).share
    assert check_start(p, _state(), "GPU.1", 10**9, 0).share
    assert "not shared" in check_start(p, _state(), "NPU", 10**9, 0).reason
    assert "RAM limit" in check_start(p, _state(), "CPU", 5 * 10**9, 4 * 10**9).reason
    assert "free RAM" in check_start(p, _state(avail=10**9), "CPU", 2 * 10**9, 0).reason
    assert "CPU busy" in check_start(p, _state(cpu=99), "CPU", 10**9, 0).reason


def test_policy_persists_and_survives_a_corrupt_file(tmp_path):
    SharingPolicy(idle_minutes=1.5, devices=("gpu",)).save(tmp_path)
    assert SharingPolicy.load(tmp_path) == SharingPolicy(idle_minutes=1.5, devices=("GPU",))
    (tmp_path / "sharing_policy.json").write_text("{not json")
    assert SharingPolicy.load(tmp_path) == SharingPolicy()
    (tmp_path / "sharing_policy.json").write_text('{"idle_minutes": -3}')
    assert SharingPolicy.load(tmp_path) == SharingPolicy()


def test_file_idle_source(tmp_path):
    src = FileIdleSource(tmp_path / "idle")
    assert src.idle_seconds() is None
    (tmp_path / "idle").write_text("0")
    assert src.idle_seconds() > 1e9


def test_manual_peers_persist_and_parse(tmp_path):
    m = ManualPeers(tmp_path)
    m.add("10.0.0.5")
    m.add("[fe80::1]:5000")
    assert ManualPeers(tmp_path).entries() == ["10.0.0.5:47600", "[fe80::1]:5000"]
    for bad in ("", "host:0", "a b:1", "h:99999"):
        with pytest.raises(ValueError):
            parse_hostport(bad)


def test_shard_store_resume_order_and_hash(tmp_path):
    data = os.urandom(300_000)
    sha = hashlib.sha256(data).hexdigest()

    async def go():
        store = ShardStore(tmp_path)
        assert await store.prepare("s", sha, len(data)) == (False, 0)
        piece = data[:100_000]
        assert await store.write_chunk(sha, 0, piece, hashlib.sha256(piece).hexdigest()) == (100_000, False)
        with pytest.raises(ProtocolError, match="expected 100000"):
            await store.write_chunk(sha, 0, piece, hashlib.sha256(piece).hexdigest())
        store2 = ShardStore(tmp_path)  # a restarted agent
        assert await store2.prepare("s", sha, len(data)) == (False, 100_000)
        rest = data[100_000:]
        assert await store2.write_chunk(sha, 100_000, rest, hashlib.sha256(rest).hexdigest()) == (300_000, True)
        assert await store2.prepare("s", sha, len(data)) == (True, len(data))
        assert [s.state for s in store2.list()] == ["cached"]

    asyncio.run(go())
