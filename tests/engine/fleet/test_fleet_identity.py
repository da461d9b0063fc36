"""engine/fleet/identity.py + engine/platform/machine_id.py: the OS's machine id wins
over MACs, and a rotating (locally administered) Wi-Fi MAC never looks like a clone.
Each OS branch runs here with its OS calls faked."""

from __future__ import annotations

import contextlib
import ipaddress
import json
import sys
import types

import pytest

from engine.fleet import identity, sysinfo
from engine.fleet.addresses import Nic
from engine.fleet.identity import NodeIdentity, current_fingerprint, locally_administered, stable_macs
from engine.platform import LINUX, MACOS, WINDOWS, machine_id

GUID = "4c4c4544-0042-3510-8052-b7c04f4e3732"


def nic(name: str, mac: str, cidr: str | None = None) -> Nic:
    return Nic(name, True, (ipaddress.IPv4Interface(cidr),) if cidr else (), mac)


def _fake_winreg(guid: str, opened: list) -> types.SimpleNamespace:
    @contextlib.contextmanager
    def open_key(root, path, reserved, access):
        opened.append((root, path, access))
        yield "key"

    return types.SimpleNamespace(
        HKEY_LOCAL_MACHINE="HKLM", KEY_READ=0x20019, KEY_WOW64_64KEY=0x0100, OpenKey=open_key,
        QueryValueEx=lambda key, name: (guid, 1) if (key, name) == ("key", "MachineGuid") else None)


def test_windows_machine_guid_from_the_64_bit_registry_view(monkeypatch):
    opened: list = []
    monkeypatch.setattr(sys, "platform", "win32")
    monkeypatch.setattr(machine_id, "_winreg", lambda: _fake_winreg(GUID, opened))
    assert machine_id.machine_id() == GUID
    assert opened == [("HKLM", r"SOFTWARE\Microsoft\Cryptography", 0x20019 | 0x0100)]


def test_windows_without_winreg_gives_no_id_instead_of_failing(monkeypatch):
    monkeypatch.setattr(sys, "platform", "win32")
    assert "winreg" not in sys.modules  # Linux: the real lazy import fails, and is caught
    assert machine_id.machine_id() == ""


def test_macos_platform_uuid_from_ioreg(monkeypatch):
    monkeypatch.setattr(sys, "platform", "darwin")
    monkeypatch.setattr(machine_id, "_ioreg", lambda: (
        '+-o Mac14,2  <class IOPlatformExpertDevice>\n    "IOPlatformSerialNumber" = "C02XXXX"\n'
        '    "IOPlatformUUID" = "8E4B2C71-1A2B-4C3D-9E8F-001122334455"\n'))
    assert machine_id.machine_id() == "8E4B2C71-1A2B-4C3D-9E8F-001122334455"
    monkeypatch.setattr(machine_id, "_ioreg", lambda: "")
    assert machine_id.machine_id() == ""


def test_linux_machine_id_skips_missing_and_uninitialized(tmp_path, monkeypatch):
    first, second = tmp_path / "machine-id", tmp_path / "dbus-machine-id"
    first.write_text("uninitialized\n")
    second.write_text("0123456789abcdef0123456789abcdef\n")
    assert machine_id.linux_machine_id([str(tmp_path / "none"), str(first), str(second)]) \
        == "0123456789abcdef0123456789abcdef"
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setattr(machine_id, "LINUX_PATHS", (str(first), str(second)))
    assert machine_id.machine_id() == "0123456789abcdef0123456789abcdef"
    second.unlink()
    assert machine_id.machine_id() == ""


def test_locally_administered_bit():
    assert locally_administered("da:a1:19:00:00:01") and locally_administered("02:00:00:00:00:01")
    assert not locally_administered("00:15:5d:01:02:03") and not locally_administered("3c:22:fb:00:00:01")


WINDOWS_NICS = [
    nic("Wi-Fi", "DA-A1-19-4F-2B-11", "192.168.1.23/24"),  # "random hardware addresses" on
    nic("Ethernet", "3C-22-FB-12-34-56"),
    nic("vEthernet (WSL)", "00-15-5D-AA-BB-CC", "172.22.160.1/20"),  # Hyper-V, new each boot
    nic("Loopback Pseudo-Interface 1", ""),
]


def test_stable_macs_per_os():
    assert stable_macs(WINDOWS_NICS, WINDOWS) == ["3c:22:fb:12:34:56"]
    mac = [nic("en0", "3e:22:fb:00:00:01"), nic("en1", "a4:83:e7:00:00:02"), nic("awdl0", "a6:83:e7:00:00:09"),
           nic("bridge100", "a4:83:e7:00:00:64"), nic("lo0", "")]
    assert stable_macs(mac, MACOS) == ["a4:83:e7:00:00:02"]
    linux = [nic("eth0", "3c:22:fb:00:00:07"), nic("docker0", "02:42:ac:11:00:01"), nic("br0", "3c:22:fb:00:00:07"),
             nic("lo", "00:00:00:00:00:00")]
    assert stable_macs(linux, LINUX, physical=lambda name: name == "eth0") == ["3c:22:fb:00:00:07"]


def _load_with(monkeypatch, tmp_path, platform: str, guid: str, nics: list[Nic]) -> NodeIdentity:
    monkeypatch.setattr(sys, "platform", platform)
    monkeypatch.setattr(identity, "machine_id", lambda: guid)
    monkeypatch.setattr(identity.addresses, "nics", lambda: nics)
    return NodeIdentity.load(tmp_path, current_fingerprint())


def test_a_rotating_wifi_mac_is_not_a_clone_while_machine_guid_matches(monkeypatch, tmp_path):
    laptop = [nic("Wi-Fi", "DA-A1-19-4F-2B-11", "192.168.1.23/24")]  # Wi-Fi only, random MAC
    first = _load_with(monkeypatch, tmp_path, "win32", GUID, laptop)
    for mac in ("4E-10-77-01-02-03", "F6-99-00-AB-CD-EF", "2A-00-00-00-00-01"):  # a new MAC per network
        again = _load_with(monkeypatch, tmp_path, "win32", GUID, [nic("Wi-Fi", mac, "10.0.0.9/24")])
        assert again.node_id == first.node_id and not again.repaired and again.keys == first.keys
    # Hyper-V gives vEthernet a new MAC at each boot: never a clone either.
    again = _load_with(monkeypatch, tmp_path, "win32", GUID, WINDOWS_NICS[:1] + [WINDOWS_NICS[2]])
    assert again.node_id == first.node_id and not again.repaired


def test_a_different_machine_guid_is_a_clone(monkeypatch, tmp_path):
    first = _load_with(monkeypatch, tmp_path, "win32", GUID, WINDOWS_NICS)
    clone = _load_with(monkeypatch, tmp_path, "win32", "11111111-2222-3333-4444-555555555555", WINDOWS_NICS)
    assert clone.repaired and clone.node_id != first.node_id and clone.keys != first.keys


def test_a_vm_cloned_with_its_machine_id_but_new_burned_in_macs_is_a_clone(monkeypatch, tmp_path):
    monkeypatch.setattr(identity, "_linux_physical", lambda name: True)
    vm = [nic("ens33", "00:0c:29:11:22:33", "192.168.1.60/24")]  # VMware OUI: universally administered
    first = _load_with(monkeypatch, tmp_path, "linux", "m" * 32, vm)
    same = _load_with(monkeypatch, tmp_path, "linux", "m" * 32, vm + [nic("wlan0", "f2:00:00:00:00:01")])
    assert same.node_id == first.node_id
    clone = _load_with(monkeypatch, tmp_path, "linux", "m" * 32, [nic("ens33", "00:0c:29:99:88:77")])
    assert clone.repaired and clone.node_id != first.node_id


def test_an_identity_written_before_the_mac_rule_is_kept_on_upgrade(monkeypatch, tmp_path):
    """An older identity.json hashed the random Wi-Fi MAC of its day; with a machine id
    the upgrade trusts the id and rewrites the record, instead of re-pairing."""
    laptop = [nic("en0", "3e:01:02:03:04:05", "192.168.1.40/24")]
    first = _load_with(monkeypatch, tmp_path, "darwin", GUID, laptop)
    path = tmp_path / identity.IDENTITY_FILE
    old = json.loads(path.read_text())
    old.pop("v")
    old["macs"] = [identity._sha("3e:01:02:03:04:05")]
    path.write_text(json.dumps(old))
    monkeypatch.setattr(identity, "stable_macs", lambda table, os_name=None: ["a4:83:e7:00:00:02"])
    again = _load_with(monkeypatch, tmp_path, "darwin", GUID, laptop)
    assert again.node_id == first.node_id and not again.repaired
    assert json.loads(path.read_text())["v"] == identity.RECORD_VERSION


@pytest.mark.parametrize("platform, release, version, mac_ver, want", [
    ("win32", "10", "10.0.22631", "", "Windows 11"),
    ("win32", "10", "10.0.19045", "", "Windows 10"),
    ("darwin", "23.5.0", "", "14.5", "macOS 14.5"),
])
def test_os_name_as_people_say_it(monkeypatch, platform, release, version, mac_ver, want):
    monkeypatch.setattr(sys, "platform", platform)
    monkeypatch.setattr(sysinfo.platform, "release", lambda: release)
    monkeypatch.setattr(sysinfo.platform, "version", lambda: version)
    monkeypatch.setattr(sysinfo.platform, "mac_ver", lambda: (mac_ver, ("", "", ""), ""))
    assert sysinfo.os_name() == want
