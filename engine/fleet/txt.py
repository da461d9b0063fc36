"""AgentInfo <-> mDNS TXT record.

Short keys keep the record well under the ~1300 bytes that fit one packet;
every value is under the 255-byte limit of one TXT string (device names are
split over dev0, dev1, ...). Parsing is strict: a record that does not make a
valid AgentInfo is a ProtocolError and the peer is ignored, never half-trusted.
"""

from __future__ import annotations

from engine.protocol.control import AgentInfo, DeviceInfo
from engine.protocol.errors import ProtocolError

MAX_TXT_VALUE = 255 - 6  # minus "devNN=" etc.


def to_txt(info: AgentInfo) -> dict[str, str]:
    txt = {
        "id": info.node_id, "v": info.version, "pv": str(info.protocol), "host": info.hostname[:200],
        "os": info.os[:200], "ram": str(info.ram_total), "free": str(info.ram_available),
        "idle": "1" if info.idle else "0",
        "isince": "" if info.idle_since is None else str(int(info.idle_since)),
        "ac": "" if info.on_ac is None else ("1" if info.on_ac else "0"),
        "cp": str(info.control_port), "pp": str(info.pair_port), "ip": str(info.info_port),
        "pk": info.public_key, "fp": info.fingerprint,
    }
    for i, d in enumerate(info.devices):
        txt[f"dev{i}"] = f"{d.name}={d.full_name}"[:MAX_TXT_VALUE]
    return txt


def from_txt(props: dict[bytes, bytes | None]) -> AgentInfo:
    try:
        t = {k.decode(): (v or b"").decode() for k, v in props.items()}
    except UnicodeDecodeError:
        raise ProtocolError("TXT record is not UTF-8") from None

    def num(key: str) -> int:
        value = t.get(key, "")
        if not value.isdigit() or len(value) > 20:
            raise ProtocolError(f"TXT {key} is not a number")
        return int(value)

    devices = []
    for i in range(32):
        raw = t.get(f"dev{i}")
        if raw is None:
            break
        name, _, full = raw.partition("=")
        devices.append(DeviceInfo(name, full))
    try:
        return AgentInfo(
            node_id=t.get("id", ""), hostname=t.get("host", ""), os=t.get("os", ""),
            version=t.get("v", ""), protocol=num("pv"), devices=tuple(devices),
            ram_total=num("ram"), ram_available=num("free"), idle=t.get("idle") == "1",
            idle_since=float(num("isince")) if t.get("isince") else None,
            on_ac=None if not t.get("ac") else t["ac"] == "1",
            control_port=num("cp"), pair_port=num("pp"), info_port=num("ip"),
            public_key=t.get("pk", ""), fingerprint=t.get("fp", ""))
    except ProtocolError:
        raise
    except Exception as e:
        raise ProtocolError(f"bad TXT record: {e}") from None
