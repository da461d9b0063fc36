"""A stable node id per install, repaired when the install is cloned.

The id is random (uuid4), generated once and kept in identity.json. Disk images
get cloned (golden images, VM templates, a backup restored on a second PC), and
two nodes with one id and one key pair would shadow each other in discovery and
share a secret key. So the id is bound to a machine fingerprint:

  machine_id  the OS's stable id (engine/platform/machine_id.py): MachineGuid
              (Windows), IOPlatformUUID (macOS), /etc/machine-id (Linux)
  macs        hashes of the burned-in MAC addresses of physical NICs: no virtual
              adapter (addresses.is_virtual; on Linux, only devices with a
              /sys/class/net/X/device link), and no locally administered MAC
              (the bit Windows, macOS, Android and NetworkManager set on the
              random, rotating Wi-Fi addresses they use for privacy)

The machine id is the evidence that counts: a different one is a clone. With the
same id, the MACs speak only when every recorded burned-in MAC is gone (a VM cloned
with its machine id but given fresh MACs). A rotating Wi-Fi MAC never enters the
fingerprint, so it cannot look like a clone. Adding a NIC is not a clone; replacing
the only one looks like one, which costs a re-pairing, not a security hole. On a
clone the id and the CurveZMQ key pair are regenerated; the allow-list is kept (a
golden image may carry the admin's controller on purpose), docs/fleet.md says so.

identity.json written before this rule (no "v") recorded random MACs too: with a
machine id, its MAC list is ignored and rewritten, so an upgrade never re-pairs.
"""

from __future__ import annotations

import hashlib
import logging
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from engine.fleet import addresses
from engine.fleet.paths import read_json, write_json
from engine.transport.security import KeyPair
from engine.platform import LINUX, system
from engine.platform.machine_id import machine_id

log = logging.getLogger(__name__)
IDENTITY_FILE = "identity.json"
RECORD_VERSION = 2  # 2: macs hold burned-in physical MACs only (no random Wi-Fi MACs)


@dataclass(frozen=True)
class Fingerprint:
    machine_id: str  # sha256 of the OS machine id, "" if unknown
    macs: tuple[str, ...]  # sha256 of each burned-in physical MAC, sorted

    def matches(self, other: Fingerprint) -> bool:
        """Is `other` (recorded earlier) the same machine as self (now)?"""
        if self.machine_id and other.machine_id and self.machine_id != other.machine_id:
            return False
        if other.macs and self.macs and not set(other.macs) & set(self.macs):
            return False
        return True


def _sha(text: str) -> str:
    return hashlib.sha256(text.strip().lower().encode()).hexdigest()


def normalize_mac(mac: str) -> str:
    """"AA-BB-CC-DD-EE-FF" (Windows) or "aa:bb:..." -> "aa:bb:cc:dd:ee:ff"; "" if not a MAC."""
    hexdigits = mac.strip().lower().replace("-", "").replace(":", "").replace(".", "")
    if len(hexdigits) != 12 or any(c not in "0123456789abcdef" for c in hexdigits):
        return ""
    return ":".join(hexdigits[i:i + 2] for i in range(0, 12, 2))


def locally_administered(mac: str) -> bool:
    """The U/L bit (0x02 of the first octet): set on random and software-made MACs."""
    return bool(int(mac[:2], 16) & 0x02)


def _linux_physical(name: str) -> bool:
    return Path(f"/sys/class/net/{name}/device").exists()


def stable_macs(table: Sequence[addresses.Nic], os_name: str | None = None,
                physical: Callable[[str], bool] | None = None) -> list[str]:
    """Burned-in MACs of physical NICs in `table` (see the module docstring); `physical`
    is the Linux /sys check (default _linux_physical; a seam for tests)."""
    os_name, physical = os_name or system(), physical or _linux_physical
    out = []
    for nic in table:
        mac = normalize_mac(nic.mac)
        if not mac or mac.strip("0:") == "" or mac == "ff:ff:ff:ff:ff:ff" or locally_administered(mac):
            continue
        if addresses.is_virtual(nic.name, os_name) or (os_name == LINUX and not physical(nic.name)):
            continue
        if mac not in out:
            out.append(mac)
    return out


def current_fingerprint() -> Fingerprint:
    mid = machine_id()
    macs = stable_macs(addresses.nics())
    return Fingerprint(_sha(mid) if mid else "", tuple(sorted(_sha(m) for m in macs)))


def _recorded(data: object) -> Fingerprint | None:
    if not isinstance(data, dict):
        return None
    mid, macs = str(data.get("machine_id", "")), tuple(data.get("macs", ()))
    if data.get("v") != RECORD_VERSION and mid:
        macs = ()  # an older record's MACs may be random ones: the machine id alone decides
    return Fingerprint(mid, macs)


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
        recorded = _recorded(data)
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
            if fp != recorded or data.get("v") != RECORD_VERSION:  # e.g. a NIC added: remember the new set
                write_json(config / IDENTITY_FILE, _record(node_id, fp))
            return cls(node_id, KeyPair.load_or_create(config), False)
        keys = KeyPair.load_or_create(config)
        write_json(config / IDENTITY_FILE, _record(node_id, fp))
        return cls(node_id, keys, repaired)


def _record(node_id: str, fp: Fingerprint) -> dict:
    return {"v": RECORD_VERSION, "node_id": node_id, "machine_id": fp.machine_id, "macs": list(fp.macs)}
