"""A stable node id per install, repaired when the install is cloned.

The id is random (uuid4), generated once and kept in identity.json. Disk images
get cloned (golden images, VM templates, a backup restored on a second PC), and
two nodes with one id and one key pair would shadow each other in discovery and
share a secret key. So the id is bound to a machine fingerprint:

  machine_id  /etc/machine-id (Linux), MachineGuid (Windows), IOPlatformUUID (macOS)
  macs        hashes of the permanent MAC addresses of physical NICs

A clone is assumed when the machine id differs, or when none of the recorded
MACs is present any more (a VM cloned with its machine-id but fresh MACs).
Adding a NIC is not a clone; replacing the only one looks like one, which costs
a re-pairing, not a security hole. On a clone the id and the CurveZMQ key pair
are regenerated; the allow-list is kept (a golden image may carry the admin's
controller on purpose), docs/fleet.md says so.
"""

from __future__ import annotations

import hashlib
import logging
import platform
import subprocess
import uuid
from dataclasses import dataclass
from pathlib import Path

from engine.fleet.paths import read_json, write_json
from engine.fleet.security import KeyPair

log = logging.getLogger(__name__)
IDENTITY_FILE = "identity.json"


@dataclass(frozen=True)
class Fingerprint:
    machine_id: str  # sha256 of the OS machine id, "" if unknown
    macs: tuple[str, ...]  # sha256 of each physical MAC, sorted

    def matches(self, other: Fingerprint) -> bool:
        """Is `other` (recorded earlier) the same machine as self (now)?"""
        if self.machine_id and other.machine_id and self.machine_id != other.machine_id:
            return False
        if other.macs and self.macs and not set(other.macs) & set(self.macs):
            return False
        return True


def _sha(text: str) -> str:
    return hashlib.sha256(text.strip().lower().encode()).hexdigest()


def _os_machine_id() -> str:
    system = platform.system()
    try:
        if system == "Linux":
            for p in ("/etc/machine-id", "/var/lib/dbus/machine-id"):
                try:
                    text = Path(p).read_text().strip()
                except OSError:
                    continue
                if text:
                    return text
        elif system == "Windows":
            import winreg  # type: ignore[import-not-found]

            with winreg.OpenKey(winreg.HKEY_LOCAL_MACHINE, r"SOFTWARE\Microsoft\Cryptography") as k:
                return str(winreg.QueryValueEx(k, "MachineGuid")[0])
        elif system == "Darwin":
            out = subprocess.run(["ioreg", "-rd1", "-c", "IOPlatformExpertDevice"],
                                 capture_output=True, text=True, timeout=5).stdout
            for line in out.splitlines():
                if "IOPlatformUUID" in line:
                    return line.split("=")[-1].strip().strip('"')
    except Exception:  # an odd platform must not keep the agent from starting
        log.debug("no machine id", exc_info=True)
    return ""


def _physical_macs() -> list[str]:
    """MACs of physical NICs. On Linux only devices with a /sys/.../device link
    count (no bridges, veths, docker0, VPN taps, whose MACs are random)."""
    import psutil

    macs = []
    for name, addrs in psutil.net_if_addrs().items():
        if platform.system() == "Linux" and not Path(f"/sys/class/net/{name}/device").exists():
            continue
        for a in addrs:
            if a.family == psutil.AF_LINK and a.address and a.address.strip("0:-") and name != "lo":
                macs.append(a.address)
    return macs


def current_fingerprint() -> Fingerprint:
    mid = _os_machine_id()
    return Fingerprint(_sha(mid) if mid else "", tuple(sorted(_sha(m) for m in _physical_macs())))


@dataclass(frozen=True)
class NodeIdentity:
    node_id: str  # 32 hex
    keys: KeyPair  # the node's CurveZMQ key pair
    repaired: bool  # a clone was detected and id + keys were regenerated just now

    @classmethod
    def load(cls, config: Path, fingerprint: Fingerprint | None = None) -> NodeIdentity:
        """The node's identity in config, created on first use, repaired on a clone."""
        fp = fingerprint or current_fingerprint()
        data = read_json(config / IDENTITY_FILE, {})
        node_id = data.get("node_id") if isinstance(data, dict) else None
        recorded = Fingerprint(str(data.get("machine_id", "")), tuple(data.get("macs", ())))\
            if isinstance(data, dict) else None
        repaired = False
        if not (isinstance(node_id, str) and len(node_id) == 32) or recorded is None:
            node_id = uuid.uuid4().hex
            KeyPair.load_or_create(config)  # keep keys if only identity.json was lost
        elif not fp.matches(recorded):
            log.warning("this install looks cloned (machine fingerprint changed): "
                        "new node id and key pair; controllers must pair again")
            node_id = uuid.uuid4().hex
            KeyPair.delete(config)
            repaired = True
        else:
            if fp != recorded:  # e.g. a NIC added: remember the new set
                write_json(config / IDENTITY_FILE, _record(node_id, fp))
            return cls(node_id, KeyPair.load_or_create(config), False)
        keys = KeyPair.load_or_create(config)
        write_json(config / IDENTITY_FILE, _record(node_id, fp))
        return cls(node_id, keys, repaired)


def _record(node_id: str, fp: Fingerprint) -> dict:
    return {"node_id": node_id, "machine_id": fp.machine_id, "macs": list(fp.macs)}
