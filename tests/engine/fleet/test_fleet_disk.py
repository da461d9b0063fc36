"""Disk on a peer: a shard bundle is held once (unpacked while it arrives),
resumes after any interruption, is never used half-written or unverified,
and a peer whose disk cannot take it refuses before the transfer starts.

Disk figures come from real small filesystems (tmpfs mounted by the test;
`make test` runs as root), not from a faked shutil.disk_usage.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import io
import os
import subprocess
import tarfile
import time
from pathlib import Path

import pytest

from engine.fleet import bundle
from engine.fleet.client import AgentClient, FleetError
from engine.transport.security import KeyPair
from engine.fleet.shards import DISK_MARGIN, NoRoom, ShardStore
from engine.protocol.errors import ProtocolError
from tests.engine.fleet.fleet_helpers import AgentProc, pair

MiB = 1024 * 1024


@contextlib.contextmanager
def small_fs(path: Path, size: int):
    """A tmpfs of `size` bytes mounted at path for the block."""
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "flotilla-test", str(path)],
                   check=True, capture_output=True)
    try:
        yield path
    finally:
        if subprocess.run(["umount", str(path)], capture_output=True).returncode:
            subprocess.run(["umount", "-l", str(path)], check=True)


def used(path: Path) -> int:
    st = os.statvfs(path)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def make_shard(tmp: Path, bin_bytes: int, *, extra: dict[str, bytes] | None = None) -> Path:
    d = tmp / "shard-src"
    d.mkdir()
    (d / "shard.bin").write_bytes(os.urandom(bin_bytes))
    (d / "shard.xml").write_text("<net>" + "x" * 3000 + "</net>")
    (d / "shard.json").write_text('{"start": 0}')
    for name, data in (extra or {}).items():
        (d / name).write_bytes(data)
    return d


def same_files(a: Path, b: Path) -> bool:
    names = sorted(p.name for p in a.iterdir())
    return names == sorted(p.name for p in b.iterdir()) and all(
        (a / n).read_bytes() == (b / n).read_bytes() for n in names)


async def send(store: ShardStore, data: bytes, sha: str, chunk: int, start: int = 0,
               stop: int | None = None, after=None) -> int:
    """Chunks of data from start (up to stop bytes); returns have_bytes."""
    have = start
    while have < len(data) and (stop is None or have < stop):
        piece = data[have:have + chunk]
        have, done = await store.write_chunk(sha, have, piece, hashlib.sha256(piece).hexdigest())
        if after:
            after(have)
    return have


# ---------------------------------------------------------------- the store on a small disk


def test_bundle_is_held_once_on_a_disk_that_could_not_hold_it_twice(tmp_path):
    src = make_shard(tmp_path, 5 * MiB)
    tar, sha = bundle.pack(src, tmp_path / "b.tar")
    data = tar.read_bytes()
    with small_fs(tmp_path / "fs", 8 * MiB) as fs:  # 5 MB fits, 2 x 5 MB does not
        base = used(fs)
        peaks: list[int] = []

        async def go() -> Path:
            store = ShardStore(fs / "shards", reserve=MiB)
            assert await store.prepare("s/L0-4", sha, len(data)) == (False, 0)
            await send(store, data, sha, 256 * 1024, after=lambda _h: peaks.append(used(fs) - base))
            assert await store.prepare("s/L0-4", sha, len(data)) == (True, len(data))
            folder = await asyncio.to_thread(store.shard_path, sha)  # what Load gives the worker
            peaks.append(used(fs) - base)
            assert [s.state for s in store.list()] == ["cached"]
            return folder

        folder = asyncio.run(go())
        assert folder == fs / "shards" / f"{sha}.d"
        assert same_files(folder, src)
        assert sorted(p.name for p in (fs / "shards").iterdir()) == [f"{sha}.d", f"{sha}.json"]
        assert max(peaks) <= 1.1 * len(data), (max(peaks), len(data))


def test_no_room_is_refused_before_anything_is_written(tmp_path):
    with small_fs(tmp_path / "fs", 8 * MiB) as fs:
        async def go() -> None:
            store = ShardStore(fs / "shards", reserve=MiB)
            with pytest.raises(NoRoom) as err:
                await store.prepare("big", "a" * 64, 7 * MiB + 1)
            assert err.value.code == "refused" and err.value.refusal.reason == "disk"
            assert err.value.need == 7 * MiB + 1 and err.value.reserve == MiB
            # On the wire: what must be free (to receive + kept free) against what is.
            assert err.value.refusal.need_bytes == 8 * MiB + 1
            assert err.value.refusal.limit_bytes == err.value.free and err.value.free <= 8 * MiB
            assert "7.3 MB to receive + 1.0 MB kept free" in str(err.value) and "MB free" in str(err.value)
            assert list((fs / "shards").iterdir()) == [] and store.list() == []
            # Room already promised to a transfer in flight counts too.
            assert await store.prepare("a", "b" * 64, 4 * MiB) == (False, 0)
            with pytest.raises(NoRoom, match="4.2 MB for transfers in progress"):
                await store.prepare("c", "c" * 64, 7 * MiB // 2)

        asyncio.run(go())


def test_a_disk_that_fills_up_meanwhile_stops_the_transfer_resumably(tmp_path):
    src = make_shard(tmp_path, 5 * MiB)
    tar, sha = bundle.pack(src, tmp_path / "b.tar")
    data = tar.read_bytes()
    with small_fs(tmp_path / "fs", 8 * MiB) as fs:
        async def go() -> None:
            store = ShardStore(fs / "shards", reserve=0)
            assert await store.prepare("s", sha, len(data)) == (False, 0)
            have = await send(store, data, sha, 256 * 1024, stop=MiB)
            (fs / "other-program").write_bytes(b"x" * (5 * MiB))  # someone else fills the disk
            with pytest.raises(NoRoom) as err:
                await send(store, data, sha, 256 * 1024, start=have)
            assert err.value.code == "refused" and err.value.refusal.reason == "disk"
            (fs / "other-program").unlink()
            cached, resume_at = await store.prepare("s", sha, len(data))
            assert not cached and have < resume_at < len(data)  # what reached the disk is kept
            await send(store, data, sha, 256 * 1024, start=resume_at)
            assert same_files(store.shard_path(sha), src)

        asyncio.run(go())


# ---------------------------------------------------------------- resume and content addressing


def _awkward_bundle(tmp: Path) -> tuple[Path, bytes, str]:
    """Members that exercise every kind of stream byte: an empty file, a name
    long enough for a pax header, data that is not a multiple of 512."""
    src = make_shard(tmp, 40_001, extra={"empty.txt": b"", "n" * 120: os.urandom(700)})
    tar, sha = bundle.pack(src, tmp / "b.tar")
    return src, tar.read_bytes(), sha


def test_bundle_resumes_after_a_restart_at_any_byte(tmp_path):
    src, data, sha = _awkward_bundle(tmp_path)
    root = tmp_path / "shards"

    async def go() -> None:
        have, chunk = 0, 333  # boundaries land inside headers, padding, data and the end blocks
        while have < len(data):
            store = ShardStore(root, reserve=0)  # a restarted agent every chunk
            assert await store.prepare("s", sha, len(data)) == (False, have)
            have = await send(store, data, sha, chunk, start=have, stop=have + 1)
            chunk = chunk * 7 % 1500 + 1
        assert (await ShardStore(root, reserve=0).prepare("s", sha, len(data)))[0]

    asyncio.run(go())
    assert same_files(root / f"{sha}.d", src)
    assert sorted(p.name for p in root.iterdir()) == [f"{sha}.d", f"{sha}.json"]


def test_a_torn_write_resumes_from_what_reached_the_disk(tmp_path):
    src, data, sha = _awkward_bundle(tmp_path)
    root = tmp_path / "shards"

    async def go() -> None:
        store = ShardStore(root, reserve=0)
        await store.prepare("s", sha, len(data))
        have = await send(store, data, sha, 4096, stop=30_000)  # inside shard.bin's data
        staging = root / f"{sha}.d.part"
        size = (staging / "shard.bin").stat().st_size
        os.truncate(staging / "shard.bin", size - 100)  # the agent died half-way through a write
        store = ShardStore(root, reserve=0)
        assert await store.prepare("s", sha, len(data)) == (False, have - 100)
        await send(store, data, sha, 4096, start=have - 100)
        assert await store.prepare("s", sha, len(data)) == (True, len(data))

    asyncio.run(go())
    assert same_files(root / f"{sha}.d", src)


def test_files_that_disagree_with_the_journal_start_over(tmp_path):
    _src, data, sha = _awkward_bundle(tmp_path)
    root = tmp_path / "shards"

    async def go() -> None:
        store = ShardStore(root, reserve=0)
        await store.prepare("s", sha, len(data))
        await send(store, data, sha, 4096, stop=30_000)
        with open(root / f"{sha}.d.part" / "shard.json", "ab") as f:  # longer than its header says
            f.write(b"tampered")
        store = ShardStore(root, reserve=0)
        assert await store.prepare("s", sha, len(data)) == (False, 0)
        assert not (root / f"{sha}.d.part").exists()

    asyncio.run(go())


def test_a_corrupted_partial_is_never_used(tmp_path):
    src, data, sha = _awkward_bundle(tmp_path)
    root = tmp_path / "shards"

    async def go() -> None:
        store = ShardStore(root, reserve=0)
        await store.prepare("s", sha, len(data))
        have = await send(store, data, sha, 4096, stop=30_000)
        raw = bytearray((root / f"{sha}.d.part" / "shard.bin").read_bytes())
        raw[1000] ^= 0xFF  # bit rot while the agent was down
        (root / f"{sha}.d.part" / "shard.bin").write_bytes(bytes(raw))
        store = ShardStore(root, reserve=0)
        assert await store.prepare("s", sha, len(data)) == (False, have)
        with pytest.raises(ProtocolError, match="sha256 mismatch"):
            await send(store, data, sha, 4096, start=have)
        assert store.cached_path(sha) is None
        assert sorted(p.name for p in root.iterdir()) == [f"{sha}.json"]  # nothing half-written kept
        assert await store.prepare("s", sha, len(data)) == (False, 0)
        await send(store, data, sha, 4096)
        assert same_files(store.shard_path(sha), src)

    asyncio.run(go())


@pytest.mark.parametrize("member", ["../escape", "sub/shard.bin", "link"])
def test_a_hostile_bundle_is_refused_while_streaming(tmp_path, member):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        ok = tarfile.TarInfo("shard.json")
        ok.size = 2
        tar.addfile(ok, io.BytesIO(b"{}"))
        bad = tarfile.TarInfo(member)
        if member == "link":
            bad.type, bad.linkname = tarfile.SYMTYPE, "/etc/shadow"
        else:
            bad.size = 1
        tar.addfile(bad, io.BytesIO(b"x") if bad.isreg() else None)
    data = buf.getvalue()
    sha = hashlib.sha256(data).hexdigest()
    root = tmp_path / "shards"

    async def go() -> None:
        store = ShardStore(root, reserve=0)
        await store.prepare("evil", sha, len(data))
        with pytest.raises(ProtocolError, match="cannot unpack the shard"):
            await send(store, data, sha, 300)

    asyncio.run(go())
    assert sorted(p.name for p in root.iterdir()) == [f"{sha}.json"]
    assert not (tmp_path / "escape").exists()


def test_an_archive_left_by_an_older_agent_is_unpacked_once_and_dropped(tmp_path):
    src = make_shard(tmp_path, 10_000)
    root = tmp_path / "shards"
    root.mkdir()
    _tar, sha = bundle.pack(src, root / "x.tar")
    (root / "x.tar").rename(root / sha)
    (root / f"{sha}.json").write_text(f'{{"shard_id": "s", "size": {(root / sha).stat().st_size}}}')
    store = ShardStore(root, reserve=0)
    assert same_files(store.shard_path(sha), src)
    assert not (root / sha).exists() and store.cached_path(sha) == root / f"{sha}.d"


# ---------------------------------------------------------------- real agents


def test_an_agent_holds_a_shard_once_on_its_disk(tmp_path):
    src = make_shard(tmp_path, 24 * MiB)
    tar, sha = bundle.pack(src, tmp_path / "b.tar")
    size = tar.stat().st_size
    me = KeyPair.generate()
    shards = tmp_path / "n0" / "agent" / "data" / "shards"
    with small_fs(shards, DISK_MARGIN + 48 * MiB) as fs:  # its reserve + 2 x 24 MB would not fit
        agent = AgentProc(tmp_path / "n0").start()
        try:
            base, peaks = used(fs), []

            async def go():
                await pair(agent, me)
                c = await AgentClient(me, agent.control, agent.public_key).async_connect()
                try:
                    done = await c.send_shard(tar, "s/L0-4", sha=sha, chunk=MiB,
                                              progress=lambda _h, _t: peaks.append(used(fs) - base))
                    return done, await c.status()
                finally:
                    c.close()

            done, status = asyncio.run(go())
        finally:
            agent.stop()
        assert done.complete and [(s.sha256, s.state) for s in status.shards] == [(sha, "cached")]
        assert same_files(fs / f"{sha}.d", src)
        assert max(peaks) <= 1.1 * size, (max(peaks), size)


def test_a_peer_without_disk_space_refuses_before_the_transfer(tmp_path, demo_dir):
    pytest.importorskip("openvino")
    pytest.importorskip("torch")
    from engine.fleet.discovery import INFO_OFFSET, Peer, async_query_info
    from engine.fleet.launch import launch_fleet
    from engine.fleet.launch_config import LaunchConfig
    from engine.fleet.refusal import StageRefused

    demo_dir("demo")
    me = KeyPair.generate()
    full = tmp_path / "n1" / "agent" / "data" / "shards"
    with small_fs(full, DISK_MARGIN + 256 * 1024) as _fs:  # a demo shard is a few MB
        procs = [AgentProc(tmp_path / f"n{i}").start() for i in range(2)]
        try:
            async def setup() -> list[Peer]:
                import zmq.asyncio

                ctx = zmq.asyncio.Context()
                peers = []
                try:
                    for a in procs:
                        await pair(a, me)
                        info = await async_query_info(ctx, "127.0.0.1", a.base + INFO_OFFSET)
                        peers.append(Peer(info, ("127.0.0.1",), "manual", time.time()))
                finally:
                    ctx.term()
                return peers

            peers = asyncio.run(setup())
            cfg = LaunchConfig(model="demo", stages=2, device_preference=("CPU",),
                               controller_host="127.0.0.1", recover=False)
            with pytest.raises(StageRefused) as err:
                launch_fleet(me, peers, cfg)

            async def statuses():
                out = []
                for a in procs:
                    c = await AgentClient(me, a.control, a.public_key).async_connect()
                    try:
                        out.append(await c.status())
                    finally:
                        c.close()
                return out

            ok, refused = asyncio.run(statuses())
        finally:
            for a in procs:
                a.stop()
    # The agent's Refusal reached the launcher as fields: the stage, its peer, disk, the bytes.
    assert isinstance(err.value, FleetError)  # and a PlanError: the plan cannot run on this fleet
    [r] = err.value.refusals
    assert (r.peer, r.fingerprint, r.step, r.refusal.reason) == (peers[1].info.hostname,
                                                                 peers[1].info.fingerprint, "prepare", "disk")
    free = r.refusal.limit_bytes
    assert 0 < free <= 256 * 1024 + DISK_MARGIN < r.refusal.need_bytes  # the tmpfs's room, against shard + margin
    assert [(i.stage, i.code, i.shortfall_bytes) for i in err.value.issues] == [
        (r.stage, "disk", r.refusal.need_bytes - free)]
    msg = str(err.value)  # one line from those fields
    assert "\n" not in msg and msg == r.line()
    assert msg.startswith(f"{peers[1].info.hostname} ({peers[1].info.fingerprint}) refused stage {r.stage} "
                          f"(layers {r.start}–{r.end} on CPU): not enough free disk for the shard: needs ")
    assert f"{free / 1e6:.1f} MB free" in msg
    assert peers[0].info.fingerprint not in msg
    assert refused.shards == ()  # nothing announced or written on the full peer
    assert all(s.have_bytes == 0 for s in ok.shards)  # and no chunk went anywhere
