"""engine/fleet/addresses.py: which addresses an agent announces and in which order a
controller dials a peer's, on interface tables shaped like Windows, macOS and Linux."""

from __future__ import annotations

import ipaddress
import socket
import sys

import psutil
import pytest

from engine.fleet import mdns
from engine.fleet.addresses import Nic, announce_addresses, dial_order, is_virtual, nics
from engine.platform import LINUX, MACOS, WINDOWS


def nic(name: str, *cidrs: str, up: bool = True, mac: str = "") -> Nic:
    return Nic(name, up, tuple(ipaddress.IPv4Interface(c) for c in cidrs), mac)


# A Windows 11 laptop with WSL, Docker Desktop, VirtualBox, a VPN and Wi-Fi Direct.
WINDOWS_PC = [
    nic("vEthernet (WSL (Hyper-V firewall))", "172.22.160.1/20"),
    nic("vEthernet (Default Switch)", "172.30.96.1/20"),
    nic("VirtualBox Host-Only Network", "192.168.56.1/24"),
    nic("VMware Network Adapter VMnet8", "192.168.200.1/24"),
    nic("OpenVPN Wintun", "10.8.0.6/24"),
    nic("Local Area Connection* 10", "169.254.7.9/16"),
    nic("Ethernet", "169.254.33.2/16", up=False),  # cable out: APIPA on a down NIC
    nic("Wi-Fi", "192.168.1.23/24"),
    nic("Loopback Pseudo-Interface 1", "127.0.0.1/8"),
]
# A Mac with a VPN (utun), Internet Sharing (bridge100), AirDrop (awdl0) and Parallels.
MAC = [
    nic("lo0", "127.0.0.1/8"),
    nic("utun3", "10.64.0.2/32"),
    nic("bridge100", "192.168.2.1/24"),
    nic("vnic0", "10.211.55.2/24"),
    nic("awdl0"),
    nic("en0", "192.168.1.40/24"),
]
# A Linux workstation with Docker, libvirt and WireGuard; its LAN is on a bridge (br0).
LINUX_PC = [
    nic("lo", "127.0.0.1/8"),
    nic("docker0", "172.17.0.1/16"),
    nic("br-3f2a9c1d7e4b", "172.18.0.1/16"),
    nic("virbr0", "192.168.122.1/24"),
    nic("wg0", "10.100.0.3/24"),
    nic("veth12ab34", "169.254.1.1/16"),
    nic("br0", "192.168.1.50/24"),
]


@pytest.mark.parametrize("table, os_name, want", [
    (WINDOWS_PC, WINDOWS, ["192.168.1.23"]),
    (MAC, MACOS, ["192.168.1.40"]),
    (LINUX_PC, LINUX, ["192.168.1.50"]),
])
def test_an_agent_announces_only_its_lan_address(table, os_name, want):
    assert announce_addresses(table, os_name) == want


def test_two_real_nics_are_both_announced():
    table = [nic("Ethernet", "10.0.0.5/24"), nic("vEthernet (WSL)", "172.22.0.1/20"), nic("Wi-Fi", "192.168.1.23/24")]
    assert announce_addresses(table, WINDOWS) == ["10.0.0.5", "192.168.1.23"]


def test_virtual_and_link_local_only_when_nothing_else_then_loopback():
    in_a_vm = [nic("lo", "127.0.0.1/8"), nic("docker0", "172.17.0.1/16"), nic("eth1", "169.254.9.9/16")]
    assert announce_addresses(in_a_vm, LINUX) == ["172.17.0.1", "169.254.9.9"]  # still findable
    assert announce_addresses([nic("lo", "127.0.0.1/8"), nic("eth0", "10.1.1.1/24", up=False)], LINUX) \
        == ["127.0.0.1"]
    assert announce_addresses([], LINUX) == ["127.0.0.1"]


@pytest.mark.parametrize("name, os_name, virtual", [
    ("vEthernet (WSL)", WINDOWS, True), ("VETHERNET (Default Switch)", WINDOWS, True),
    ("VirtualBox Host-Only Network #2", WINDOWS, True), ("Tailscale", WINDOWS, True),
    ("Local Area Connection* 2", WINDOWS, True), ("Local Area Connection", WINDOWS, False),
    ("Ethernet 2", WINDOWS, False), ("Wi-Fi", WINDOWS, False),
    ("utun0", MACOS, True), ("bridge100", MACOS, True), ("bridge0", MACOS, False),  # Thunderbolt Bridge
    ("en0", MACOS, False), ("en7", MACOS, False),
    ("docker0", LINUX, True), ("br-0123456789ab", LINUX, True), ("virbr0", LINUX, True),
    ("veth0a1b2c", LINUX, True), ("tun0", LINUX, True), ("wg0", LINUX, True),
    ("br0", LINUX, False), ("eth0", LINUX, False), ("wlp2s0", LINUX, False), ("enp0s31f6", LINUX, False),
])
def test_virtual_adapter_names(name, os_name, virtual):
    assert is_virtual(name, os_name) is virtual


def test_the_os_comes_from_sys_platform(monkeypatch):
    monkeypatch.setattr(sys, "platform", "win32")
    assert is_virtual("vEthernet (WSL)") and announce_addresses(WINDOWS_PC) == ["192.168.1.23"]
    monkeypatch.setattr(sys, "platform", "darwin")
    assert is_virtual("utun2") and not is_virtual("vEthernet (WSL)")


def test_a_controller_dials_its_own_subnet_first():
    ctl = [nic("lo", "127.0.0.1/8"), nic("Wi-Fi", "192.168.1.10/24"), nic("vEthernet (WSL)", "172.22.160.1/20")]
    # The agent's office LAN came first; we are on its Wi-Fi subnet.
    peer = ["10.20.0.7", "192.168.1.23", "169.254.4.4", "172.22.170.5"]
    assert dial_order(peer, ctl, WINDOWS) == ["192.168.1.23", "10.20.0.7", "169.254.4.4", "172.22.170.5"]


def test_dial_order_is_stable_and_deduplicated():
    ctl = [nic("eth0", "10.0.0.2/24"), nic("eth1", "10.77.0.5/24")]
    assert dial_order(["10.77.0.1", "10.0.0.1", "10.0.0.1"], ctl, LINUX) == ["10.77.0.1", "10.0.0.1"]
    assert dial_order(["10.9.9.9", "10.0.0.1"], [nic("eth0", "10.0.0.2/24", up=False)], LINUX) \
        == ["10.9.9.9", "10.0.0.1"]  # a down NIC is no subnet of ours
    assert dial_order(["127.0.0.1"], [nic("lo", "127.0.0.1/8")], LINUX) == ["127.0.0.1"]


def test_link_local_peer_is_first_when_we_share_its_link():
    ctl = [nic("Ethernet", "169.254.10.1/16"), nic("Wi-Fi", "192.168.1.10/24")]
    assert dial_order(["10.3.0.1", "169.254.20.2"], ctl, WINDOWS) == ["169.254.20.2", "10.3.0.1"]


def test_nics_reads_this_machine():
    table = nics()
    names = set(psutil.net_if_addrs())
    assert {n.name for n in table} == names
    v4 = {a.address for addrs in psutil.net_if_addrs().values() for a in addrs if a.family == socket.AF_INET}
    assert {str(i.ip) for n in table for i in n.ipv4} == v4


def test_explicit_interfaces_are_announced_as_given_and_none_means_the_usable_ones(monkeypatch):
    assert mdns.advertised_addresses(mdns.resolve_interfaces(["127.0.0.1"])) == ["127.0.0.1"]
    monkeypatch.setattr(mdns.addr, "nics", lambda: LINUX_PC)
    monkeypatch.setattr(sys, "platform", "linux")
    assert mdns.advertised_addresses(mdns.resolve_interfaces(None)) == ["192.168.1.50"]
