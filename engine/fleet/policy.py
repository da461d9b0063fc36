"""When the owner lets this PC be used, and the agent's read of the machine.

The policy is a small persisted dataclass (sharing_policy.json in the config
dir, edited by the tray or by hand; the agent reloads it when it changes).
evaluate() is a pure function of (policy, machine state) -> Decision, so every
rule is tested without a machine in the state it describes.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from engine.fleet import sysinfo
from engine.fleet.idle import IdleSource
from engine.fleet.paths import read_json, write_json
from engine.protocol.errors import Refusal

POLICY_FILE = "sharing_policy.json"
GB = 10**9


@dataclass(frozen=True)
class SharingPolicy:
    enabled: bool = True  # the owner's master switch
    idle_minutes: float = 5.0  # share only after this long without user input
    require_ac: bool = True  # never share on battery
    max_ram_gb: float = 8.0  # shards on this PC together may use at most this much
    devices: tuple[str, ...] = ("CPU", "GPU", "NPU")  # device families a worker may use
    yield_on_return: bool = True  # stop workers within 2 s when the user comes back
    # before stopping them, tell controllers ("yielding") and give them up to this long to migrate
    # the shards away and unload them; capped so the workers are still gone within 2 s. 0 = stop at once
    yield_grace_s: float = 1.5
    max_cpu_percent_to_start: float = 90.0  # do not start work on a PC this busy

    def __post_init__(self) -> None:
        if not (self.idle_minutes >= 0 and self.max_ram_gb >= 0 and 0 < self.max_cpu_percent_to_start <= 100):
            raise ValueError("idle_minutes and max_ram_gb must be >= 0, max_cpu_percent_to_start in (0, 100]")
        object.__setattr__(self, "devices", tuple(str(d).upper() for d in self.devices))
        object.__setattr__(self, "yield_grace_s", max(0.0, float(self.yield_grace_s)))  # never breaks a yield

    def allows_device(self, device: str) -> bool:
        """"GPU.1" is allowed by "GPU"; "AUTO" only if every family is allowed."""
        family = device.split(".")[0].upper()
        if family in ("AUTO", "HETERO", "MULTI"):
            return {"CPU", "GPU", "NPU"} <= set(self.devices)
        return family in self.devices or device.upper() in self.devices

    @classmethod
    def load(cls, config: Path) -> SharingPolicy:
        raw = read_json(config / POLICY_FILE, {})
        names = {f.name for f in dataclasses.fields(cls)}
        try:
            kwargs = {k: (tuple(v) if k == "devices" else v) for k, v in raw.items() if k in names}
            return cls(**kwargs)
        except (TypeError, ValueError, AttributeError):
            return cls()  # a broken file: safe defaults, not a dead agent

    def save(self, config: Path) -> None:
        write_json(config / POLICY_FILE, dataclasses.asdict(self))


@dataclass(frozen=True)
class MachineState:
    idle_s: float | None  # seconds since last user input; None = unknown
    on_ac: bool | None  # mains power; None = unknown
    ram_total: int  # bytes
    ram_available: int  # bytes
    cpu_percent: float  # whole-machine load, 0..100
    time: float  # unix time of the reading

    @property
    def idle_since(self) -> float | None:
        return None if self.idle_s is None else self.time - self.idle_s


@dataclass(frozen=True)
class Decision:
    share: bool  # new work may start and running work may stay
    reason: str  # why not ("" when share), with the numbers
    # why not, for programs: "" when share, else one of engine.protocol.errors.REFUSAL_REASONS
    # (not_sharing | device | policy_cap | ram | cpu_busy), the reason of the Refusal sent
    code: str = ""
    need_bytes: int = 0  # policy_cap / ram: what the new worker needs
    limit_bytes: int = 0  # policy_cap: what the cap leaves; ram: free RAM less the OS reserve

    def refusal(self) -> Refusal:
        """The wire form of a refusal, for ErrorReply.refusal (ValueError when share)."""
        if self.share:
            raise ValueError("a decision to share is no refusal")
        return Refusal(self.code, self.need_bytes, self.limit_bytes)

    def message(self) -> str:
        """The refusal's one line for people, with the numbers."""
        return f"not sharing now: {self.reason}" if self.code == "not_sharing" else self.reason


@dataclass(frozen=True)
class StartNeed:
    """What a worker will hold, sized by the agent before it starts one (the same
    memory model as the planner's stage, engine/planner/memory.py)."""

    weights: int  # the shard's bytes the worker holds (less an embedding read from the mapped file)
    kv: int  # KV for context x streams tokens over its layers, at the runtime's KV width and peak
    runtime: int  # measured runtime reserve + the prefill chunk's activations

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.runtime


def start_need(shard_bytes: int, manifest: dict | None, device: str, exact: bool,
               context_length: int, streams: int, kv_precision: str = "") -> StartNeed:
    """A worker's memory from its shard manifest (shard.json: layer range, KV heads,
    head dim, hidden size); no manifest: weights and the fixed runtime reserve only.
    kv_precision: the worker's KV cache precision ("" = the device's default)."""
    from engine.planner import plan

    if not manifest:
        return StartNeed(int(shard_bytes), 0, plan.RUNTIME_RESERVE_BYTES)
    kind = device.split(".")[0].upper()
    kind = kind if kind in plan.DEVICE_KINDS else "CPU"
    layers = int(manifest["end"]) - int(manifest["start"])
    head_dim, kv_heads = int(manifest["head_dim"]), int(manifest["num_kv_heads"])
    elements = 2 * kv_heads * head_dim  # K + V of one token in one layer
    el = plan.kv_element_bytes(kind, exact, head_dim=head_dim, ir_precision=kv_precision or None)
    u8 = not exact and (kv_precision or plan.KV_DEFAULT_PRECISION.get(kind)) == "u8"
    grow = plan.KV_U8_GROWTH if u8 else 1.0  # a u8 CPU cache grows by doubling (plan.kv_growth)
    kv = int(elements * layers * context_length * streams * el * grow)
    hidden = int(manifest.get("hidden_size") or head_dim)
    # The manifest names no query heads or MLP width: hidden / head_dim and 4 x hidden
    # (Llama-3 8B: 32 heads, 3.5 x hidden), the scratch's usual shape.
    scratch = plan.prefill_scratch(max(1, hidden // head_dim), 4 * hidden, context_length,
                                   dequant_kv_elements=elements if u8 else 0)
    # A first stage's embedding table stays in the mapped file on this device (the planner's rule)
    mapped = 0
    if (int(manifest["start"]) == 0 and plan.embedding_mapped(kind) and manifest.get("vocab_size")
            and manifest.get("precision") in plan.PRECISION_BYTES):
        mapped = plan.embedding_table_bytes(int(manifest["vocab_size"]), hidden, str(manifest.get("precision")))
    # MoE: the device's runtime holds the routed experts again (the planner's rule)
    experts = int((plan.expert_copies(kind) - 1) * int(manifest.get("expert_bytes") or 0))
    return StartNeed(max(0, int(shard_bytes) - mapped), kv, plan.RUNTIME_RESERVE_BYTES + scratch + experts)


def _gb(n: float) -> str:
    return f"{n / GB:.1f} GB"


def evaluate(policy: SharingPolicy, state: MachineState) -> Decision:
    """May this PC work for the fleet right now? Unknown idle time counts as
    "user present" (we cannot promise to yield to someone we cannot see);
    unknown power counts as AC (desktops often report nothing)."""
    if not policy.enabled:
        return Decision(False, "sharing is switched off", "not_sharing")
    if state.idle_s is None:
        return Decision(False, "idle time unknown", "not_sharing")
    if state.idle_s < policy.idle_minutes * 60:
        return Decision(False, "user active", "not_sharing")
    if policy.require_ac and state.on_ac is False:
        return Decision(False, "on battery", "not_sharing")
    return Decision(True, "")


def check_start(policy: SharingPolicy, state: MachineState, device: str, shard_bytes: int,
                used_bytes: int, need: StartNeed | None = None) -> Decision:
    """May a worker for a shard of shard_bytes start on device, with used_bytes
    already taken by running workers? need (start_need) adds its KV and runtime
    reserve; the worker must fit both the policy's RAM cap and free RAM less the
    OS reserve (engine.planner.plan.os_reserve)."""
    from engine.planner.plan import os_reserve

    base = evaluate(policy, state)
    if not base.share:
        return base
    if not policy.allows_device(device):
        return Decision(False, f"device {device} is not shared (policy: {', '.join(policy.devices)})", "device")
    need = need or StartNeed(int(shard_bytes), 0, 0)
    parts = f"weights {_gb(need.weights)} + KV {_gb(need.kv)} + runtime {_gb(need.runtime)}"
    cap = int(policy.max_ram_gb * GB)
    left = max(0, cap - used_bytes)
    if need.total > left:
        return Decision(False, f"needs {_gb(need.total)} ({parts}) but the RAM limit of {policy.max_ram_gb:g} GB "
                               f"leaves {_gb(left)} ({_gb(used_bytes)} in use)", "policy_cap", need.total, left)
    reserve = os_reserve(state.ram_total)
    free = max(0, state.ram_available - reserve)
    if need.total > free:
        return Decision(False, f"not enough free RAM: needs {_gb(need.total)} ({parts}), {_gb(state.ram_available)} "
                               f"free less {_gb(reserve)} for the OS leaves {_gb(free)}", "ram", need.total, free)
    if state.cpu_percent > policy.max_cpu_percent_to_start:
        return Decision(False, f"CPU busy ({state.cpu_percent:.0f}%)", "cpu_busy")
    return Decision(True, "")


class MachineProbe:
    """Reads MachineState; psutil.cpu_percent(None) compares with the previous
    call, so one probe object is polled on a steady beat."""

    MIN_CPU_WINDOW_S = 0.4  # a shorter window gives noise (0% or 100%), so reuse the last figure

    def __init__(self, idle: IdleSource) -> None:
        self.idle = idle
        psutil.cpu_percent(None)
        self._cpu, self._cpu_at = 0.0, time.monotonic()

    def _cpu_percent(self) -> float:
        now = time.monotonic()
        if now - self._cpu_at >= self.MIN_CPU_WINDOW_S:
            self._cpu, self._cpu_at = float(psutil.cpu_percent(None)), now
        return self._cpu

    def read(self) -> MachineState:
        total, avail = sysinfo.ram()
        try:
            idle = self.idle.idle_seconds()
        except Exception:
            idle = None
        return MachineState(idle, sysinfo.on_ac(), total, avail, self._cpu_percent(),
                            time.time())
