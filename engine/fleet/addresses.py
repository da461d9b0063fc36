"""Which of this machine's IPv4 addresses an agent announces, and in which order a
controller dials the addresses a peer announced.

A PC has many addresses that do not lead to it from the LAN: WSL / Hyper-V vEthernet,
Docker and podman bridges, VirtualBox / VMware host-only networks, VPN tunnels, 169.254
link-local. Announced, they send controllers to the wrong place (a Hyper-V NAT subnet
exists on every Windows PC with WSL, so it even looks "local" from the other PC).

    announce_addresses(nics())             # agent: what goes in the mDNS A records
    dial_order(peer_addresses, nics())     # controller: best first

Both are pure functions of an interface table (Nic), so the rules are unit-tested with
fake Windows, macOS and Linux tables; nics() is the one reader of the OS
(psutil.net_if_addrs / net_if_stats, the same call on every OS).

Announcing works in tiers: usable addresses (an up, non-virtual interface, not
link-local) if there are any; else the virtual and link-local ones (an agent inside a VM,
or two PCs on one cable with no DHCP, is still found); else loopback. The order an agent
lists them in does not reach the controller (mDNS A records are a set), so the ranking
that matters is the controller's, from its own interfaces: dial_order.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from ipaddress import IPv4Address, IPv4Interface

import psutil

from engine.platform import LINUX, MACOS, WINDOWS, system

USABLE, VIRTUAL, LOOPBACK = 0, 1, 2  # announcement tiers, best first
LINK_LOCAL = ipaddress.IPv4Network("169.254.0.0/16")

# Interface names that are never the LAN, per OS. psutil gives kernel names on Linux
# ("docker0"), BSD names on macOS ("utun3") and connection ("friendly") names on Windows
# ("vEthernet (WSL)"). Matched case-insensitively against the whole name.
_COMMON = [r"docker\d*", r"vboxnet\d+", r"vmnet\d+", r"tun\d*", r"tap\w*", r"wg\w*", r"utun\d*",
           r"zt\w+", r"tailscale\d*", r"podman\d*", r"ppp\d+"]
_PATTERNS = {
    LINUX: _COMMON + [r"br-[0-9a-f]{12}", r"virbr\d+(-nic)?", r"veth\w*", r"vnet\d+", r"lxcbr\d+",
                      r"lxdbr\d+", r"cni\d+", r"flannel\.\d+", r"cali\w+", r"kube-\w+", r"vxlan\w*",
                      r"nordlynx", r"incusbr\d+"],
    # bridge0 is the Thunderbolt Bridge between two Macs: a real (fast) link, kept.
    MACOS: _COMMON + [r"bridge1\d\d", r"ipsec\d+", r"gif\d+", r"stf\d+", r"awdl\d+", r"llw\d+",
                      r"ap\d+", r"anpi\d+", r"vmenet\d+", r"vnic\d+", r"feth\d+"],
    WINDOWS: _COMMON + [r"vethernet.*", r".*hyper-v.*", r".*\bwsl\b.*", r".*virtualbox.*",
                        r".*vmware.*", r".*\bvmnet\d*.*", r".*\bvpn\b.*", r".*openvpn.*", r".*tap-.*",
                        r".*wintun.*", r".*wireguard.*", r".*tailscale.*", r".*zerotier.*",
                        r".*nordlynx.*", r".*docker.*", r".*npcap.*", r".*loopback.*", r".*bluetooth.*",
                        # Wi-Fi Direct virtual adapters; "Local Area Connection" alone is an Ethernet NIC
                        r"local area connection\* \d+"],
}
_COMPILED = {os_: re.compile("|".join(f"(?:{p})" for p in ps), re.IGNORECASE) for os_, ps in _PATTERNS.items()}


@dataclass(frozen=True)
class Nic:
    """One network interface as the OS reports it."""

    name: str  # the OS's name: "eth0", "en0", "Wi-Fi", "vEthernet (WSL)"
    up: bool  # administratively up (psutil net_if_stats().isup); a down NIC answers nothing
    ipv4: tuple[IPv4Interface, ...]  # its IPv4 addresses with their prefix
    mac: str = ""  # link-layer address as the OS spells it, "" when there is none


def nics() -> list[Nic]:
    """This machine's interfaces (psutil; the same call on every OS)."""
    stats = psutil.net_if_stats()
    out = []
    for name, addrs in psutil.net_if_addrs().items():
        v4, mac = [], ""
        for a in addrs:
            if a.family == socket.AF_INET and a.address:
                v4.append(_iface(a.address, a.netmask))
            elif a.family == psutil.AF_LINK and a.address:
                mac = a.address
        st = stats.get(name)
        # A name missing from the stats (it happens on Windows) is taken as up: unknown is not down.
        out.append(Nic(name, True if st is None else bool(st.isup), tuple(v4), mac))
    return out


def _iface(address: str, netmask: str | None) -> IPv4Interface:
    try:
        return IPv4Interface(f"{address}/{netmask}" if netmask else f"{address}/32")
    except ValueError:  # an odd netmask: the address alone
        return IPv4Interface(f"{address}/32")


def is_virtual(name: str, os_name: str | None = None) -> bool:
    """Is this interface name one of the known virtual adapters of the OS?"""
    return _COMPILED[os_name or system()].fullmatch(name.strip()) is not None


def tier(nic: Nic, address: IPv4Address, os_name: str | None = None) -> int:
    """USABLE, VIRTUAL (virtual adapter or link-local) or LOOPBACK."""
    if address.is_loopback:
        return LOOPBACK
    if address in LINK_LOCAL or is_virtual(nic.name, os_name):
        return VIRTUAL
    return USABLE


def announce_addresses(table: Sequence[Nic], os_name: str | None = None) -> list[str]:
    """The addresses an agent announces: the best non-empty tier (see the module
    docstring), in table order. Down interfaces never count; "127.0.0.1" when the
    table has nothing at all."""
    tiers: dict[int, list[str]] = {USABLE: [], VIRTUAL: [], LOOPBACK: []}
    for nic in table:
        for iface in nic.ipv4:
            t = tier(nic, iface.ip, os_name)
            if (nic.up or t == LOOPBACK) and str(iface.ip) not in tiers[t]:
                tiers[t].append(str(iface.ip))
    for t in (USABLE, VIRTUAL, LOOPBACK):
        if tiers[t]:
            return tiers[t]
    return ["127.0.0.1"]


def dial_order(addresses: Sequence[str], own: Sequence[Nic], os_name: str | None = None) -> list[str]:
    """A peer's addresses, best first, seen from a controller whose interfaces are `own`:
      0  an address of one of our real interfaces (the peer runs here), or in its subnet
      1  elsewhere, routed (announced order)
      2  link-local that is not on one of our links
      3  inside the subnet of one of our virtual adapters: the route leads into that
         adapter (our WSL or Docker network), not to the peer
    Stable: within a rank, the order given."""
    mine, direct, virtual = set(), [], []
    for nic in own:
        if not nic.up:
            continue
        for iface in nic.ipv4:
            if is_virtual(nic.name, os_name):
                virtual.append(iface.network)
            else:
                mine.add(iface.ip)
                direct.append(iface.network)

    def rank(text: str) -> int:
        try:
            ip = IPv4Address(text)
        except ValueError:  # a name or IPv6: no opinion, after the direct ones
            return 1
        if ip in mine or any(ip in net for net in direct):
            return 0
        if any(ip in net for net in virtual):
            return 3
        return 2 if ip in LINK_LOCAL else 1

    seen: list[str] = []
    for a in addresses:
        if a not in seen:
            seen.append(a)
    return sorted(seen, key=rank)
