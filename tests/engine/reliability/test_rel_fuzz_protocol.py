"""Hostile input on the wire: the protocol decoders under atheris (coverage-
guided, bounded runs, RSS limit, per-input timeout) and with memory bounds:
a few bytes that claim gigabytes never make the decoder allocate them."""

from __future__ import annotations

import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.protocol import ProtocolError, decode, decode_frames, encode, encode_frames
from engine.protocol.messages import ChatMessage, GenerateRequest, SamplingParams
from engine.protocol.pipeline import StageConfigure, StageFree, StagePing, StageResult, StageStep
from engine.protocol.version import PROTOCOL_VERSION

HERE = Path(__file__).parent
SEP = b"\xff\xfe"
RUNS = 200_000  # atheris iterations (~10 s here)


def _seeds() -> list[bytes]:
    """Valid inputs of both decoders: the fuzzer mutates from real messages."""
    msgs = [GenerateRequest("r1", messages=(ChatMessage("user", "hello"),), sampling=SamplingParams(max_tokens=5)),
            StageConfigure("tcp://127.0.0.1:5555", 0, 2, "stage 0"), StagePing(3),
            StageFree(("s1", "s2")), StageResult("s1", 4, 17, (1.0, 2.5))]
    out = [b"\x00" + encode(m) for m in msgs]
    step = StageStep("s1", 0, 0, reset=True, want_token=True, want_logits=False)
    for tensors in ([np.array([[1, 2, 3]], np.int64)], [np.zeros((1, 2, 8), np.float32)], []):
        out.append(b"\x01" + SEP.join(bytes(f) for f in encode_frames(step, tensors)))
    return out


def test_atheris_finds_no_crash_hang_or_memory_blowup(tmp_path):
    pytest.importorskip("atheris")
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i, seed in enumerate(_seeds()):
        (corpus / f"seed{i}").write_bytes(seed)
    t = time.monotonic()
    # Through `sh -c '...; exit'`, which forks the fuzzer from a small shell: a
    # child spawned straight from pytest (vfork + exec) inherits pytest's peak
    # RSS as its own ru_maxrss (1.7 GB once the suite has loaded models), and
    # libFuzzer's -rss_limit_mb reads exactly that.
    res = subprocess.run(
        ["sh", "-c", '"$@"; exit $?', "sh",
         sys.executable, str(HERE / "rel_atheris_target.py"), f"-runs={RUNS}", "-max_len=4096",
         "-rss_limit_mb=1024", "-malloc_limit_mb=256", "-timeout=5", "-seed=1",
         f"-artifact_prefix={tmp_path}/", str(corpus)],
        capture_output=True, text=True, timeout=240, cwd=str(HERE.parents[2]))
    tail = "\n".join(res.stderr.splitlines()[-15:])
    assert res.returncode == 0, f"atheris found a problem (artifacts in {tmp_path}):\n{tail}"
    assert f"Done {RUNS} runs" in res.stderr, tail
    print(f"\natheris: {RUNS} runs in {time.monotonic() - t:.1f} s; {res.stderr.splitlines()[-1]}")


def _peak(fn, *args) -> int:
    tracemalloc.start()
    try:
        try:
            fn(*args)
        except ProtocolError:
            pass
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def _env(kind: str, body) -> bytes:
    return msgpack.packb({"v": PROTOCOL_VERSION, "k": kind, "b": body}, use_bin_type=True)


@pytest.mark.parametrize("data", [
    b"\xdd\xff\xff\xff\xff",  # an array header claiming 4 billion items
    b"\xdf\xff\xff\xff\xff",  # a map claiming 4 billion pairs
    b"\xdb\xff\xff\xff\xff" + b"a" * 8,  # a 4 GB string, 8 bytes given
    b"\xc6\xff\xff\xff\xff" + b"a" * 8,  # a 4 GB bin
    b"\x91" * 100_000,  # deep nesting
    _env("pipeline_free", {"stream_ids": ["x"] * 5000}),  # over MAX_FREE
], ids=["array", "map", "str", "bin", "nesting", "free-list"])
def test_claims_of_huge_sizes_allocate_nothing_big(data):
    assert _peak(decode, data) < 1_000_000 + 4 * len(data)


def test_a_tensor_header_claiming_a_gigabyte_is_refused_cheaply():
    from engine.protocol.frames import FramedHeader, TensorSpec

    step = StageStep("s1", 0, 0, reset=True, want_token=True, want_logits=False)
    big = TensorSpec("float32", (1, 2**14, 2**14), 4 * 2**28)  # 1 GiB claimed
    frames = [encode(FramedHeader(encode(step), (big,))), b"\x00" * 16]
    with pytest.raises(ProtocolError):
        decode_frames(frames)
    assert _peak(decode_frames, frames) < 200_000


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(min_size=1, max_size=65_536))
def test_decoder_memory_is_linear_in_the_input(data):
    assert _peak(decode, data) < 300_000 + 8 * len(data)
    t = time.perf_counter()
    try:
        decode_frames(data.split(SEP))
    except ProtocolError:
        pass
    assert time.perf_counter() - t < 1.0  # no super-linear work on 64 KB
