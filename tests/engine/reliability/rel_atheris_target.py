"""Atheris (libFuzzer) target for the protocol decoders; run by test_rel_fuzz_protocol.py.

    python rel_atheris_target.py -runs=N -max_len=4096 -rss_limit_mb=1024 -timeout=5 CORPUS

Input byte 0 picks the decoder: even = decode(rest), odd = decode_frames(rest
split at b"\\xff\\xfe" into frames). Anything but a valid message or a
ProtocolError -- another exception, a hang (-timeout) or RSS over the limit
(-rss_limit_mb) -- is a finding: libFuzzer exits non-zero and saves the input.
Accepted input must re-encode to a message that decodes equal (stable).
"""

import sys

import atheris

with atheris.instrument_imports(include=["engine.protocol"]):
    import engine.protocol.control  # noqa: F401  (registers the control-plane messages)
    import engine.protocol.pipeline  # noqa: F401  (registers the data-plane messages)
    from engine.protocol import ProtocolError, decode, decode_frames, encode, encode_frames

SEP = b"\xff\xfe"


def TestOneInput(data: bytes) -> None:  # noqa: N802 - atheris' name
    if not data:
        return
    mode, body = data[0], data[1:]
    try:
        if mode % 2 == 0:
            msg = decode(body)
            assert decode(encode(msg)) == msg
        else:
            msg, arrays = decode_frames(body.split(SEP))
            again, _ = decode_frames([bytes(f) for f in encode_frames(msg, arrays)])
            assert again == msg
    except ProtocolError as e:
        assert str(e) and "\n" not in str(e)


if __name__ == "__main__":
    atheris.Setup(sys.argv, TestOneInput)
    atheris.Fuzz()
