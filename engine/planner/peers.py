"""The fleet a plan is made for: peers, the devices they offer, the links between them."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Mapping, Sequence

from engine.planner.json_form import _from_dict, _tuple_of
from engine.planner.memory import _floats, _is_int, _is_num, _need, os_reserve

DEVICE_KINDS = ("CPU", "GPU", "NPU")
# Effective decode bandwidth (bytes/s) when a device was never calibrated:
# conservative figures for an AI PC sharing LPDDR5 between CPU, iGPU and NPU.
DEFAULT_BANDWIDTH_BYTES_PER_S = {"CPU": 40e9, "GPU": 60e9, "NPU": 30e9}


@dataclass(frozen=True)
class LinkProfile:
    latency_ms: float  # one-way latency of a small message, milliseconds
    bandwidth_mbit_s: float  # sustained throughput, megabits (1e6 bit) per second

    def __post_init__(self) -> None:
        _need(_is_num(self.latency_ms) and self.latency_ms >= 0, "latency_ms must be >= 0")
        _need(_is_num(self.bandwidth_mbit_s) and self.bandwidth_mbit_s > 0,
              "bandwidth_mbit_s must be > 0")
        _floats(self, "latency_ms", "bandwidth_mbit_s")

    def transfer_ms(self, nbytes: float) -> float:
        """Time to send nbytes: latency + serialisation."""
        return self.latency_ms + nbytes * 8 / (self.bandwidth_mbit_s * 1000.0)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> LinkProfile:
        return _from_dict(cls, d)


DEFAULT_LINK = LinkProfile(1.0, 1000.0)  # an unknown pair of peers: gigabit LAN
LOOPBACK_LINK = LinkProfile(0.0, 100_000.0)  # a peer talking to itself

Links = Mapping[tuple[str, str], LinkProfile]


def link_between(links: Links | None, a: str, b: str) -> LinkProfile:
    """The link a -> b: loopback if a == b, else (a, b), else (b, a), else LAN."""
    if a == b:
        return LOOPBACK_LINK
    links = links or {}
    return links.get((a, b)) or links.get((b, a)) or DEFAULT_LINK


def links_to_list(links: Links) -> list[dict]:
    """JSON form of a link mapping, sorted by (from, to)."""
    return [{"from": a, "to": b, **links[(a, b)].to_dict()} for a, b in sorted(links)]


def links_from_list(items: Sequence[Mapping[str, Any]]) -> dict[tuple[str, str], LinkProfile]:
    out = {}
    for it in items:
        _need(isinstance(it, Mapping) and isinstance(it.get("from"), str)
              and isinstance(it.get("to"), str), "a link needs 'from' and 'to' peer ids")
        rest = {k: v for k, v in it.items() if k not in ("from", "to")}
        out[(it["from"], it["to"])] = LinkProfile.from_dict(rest)
    return out


@dataclass(frozen=True)
class DeviceProfile:
    kind: str  # "CPU" | "GPU" | "NPU"
    name: str  # OpenVINO device id, unique on its peer: "CPU", "GPU.0", "NPU"
    # Measured decode ms per average layer per token (calibration run at the
    # requested precision); None = estimate from bandwidth below.
    ms_per_layer_token: float | None = None
    # Effective memory bandwidth for the estimate, bytes/s; None = by kind.
    bandwidth_bytes_per_s: float | None = None

    def __post_init__(self) -> None:
        _need(self.kind in DEVICE_KINDS, f"device kind must be one of {', '.join(DEVICE_KINDS)}")
        _need(isinstance(self.name, str) and self.name != "", "device name must be non-empty")
        for n in ("ms_per_layer_token", "bandwidth_bytes_per_s"):
            v = getattr(self, n)
            _need(v is None or (_is_num(v) and v > 0), f"{n} must be > 0 or null")
            _floats(self, n)

    def bytes_per_ms(self, mean_layer_bytes: float) -> float:
        """Effective bandwidth in bytes per millisecond."""
        if self.ms_per_layer_token is not None:
            return mean_layer_bytes / self.ms_per_layer_token
        bw = self.bandwidth_bytes_per_s or DEFAULT_BANDWIDTH_BYTES_PER_S[self.kind]
        return bw / 1000.0

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> DeviceProfile:
        return _from_dict(cls, d)


@dataclass(frozen=True)
class PeerProfile:
    peer_id: str  # stable node id (mDNS TXT)
    name: str  # human name shown in the UI, e.g. "laptop-2"
    devices: tuple[DeviceProfile, ...]  # OpenVINO devices it offers
    # min(free RAM now, its agent's sharing-policy cap): what the stage must fit, the OS
    # reserve included (the planner adds that reserve to the stage's need)
    ram_free_bytes: int
    ram_total_bytes: int = 0  # installed RAM (sizes the OS reserve); 0 = unknown: ram_free_bytes

    def __post_init__(self) -> None:
        _need(isinstance(self.peer_id, str) and self.peer_id != "", "peer_id must be non-empty")
        _need(isinstance(self.name, str), "peer name must be a string")
        object.__setattr__(self, "devices", tuple(self.devices))
        _need(all(isinstance(d, DeviceProfile) for d in self.devices), "devices must be DeviceProfile")
        names = [d.name for d in self.devices]
        _need(len(set(names)) == len(names), f"peer {self.peer_id}: device names repeat")
        _need(_is_int(self.ram_free_bytes) and self.ram_free_bytes >= 0, "ram_free_bytes must be >= 0")
        _need(_is_int(self.ram_total_bytes) and self.ram_total_bytes >= 0, "ram_total_bytes must be >= 0")

    def device(self, name: str) -> DeviceProfile | None:
        return next((d for d in self.devices if d.name == name), None)

    def os_reserve_bytes(self) -> int:
        return os_reserve(self.ram_total_bytes or self.ram_free_bytes)

    def to_dict(self) -> dict:
        return {**asdict(self), "devices": [d.to_dict() for d in self.devices]}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> PeerProfile:
        return _from_dict(cls, d, devices=_tuple_of(DeviceProfile.from_dict))
