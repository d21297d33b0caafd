"""What ``sfchat-relay`` prints once it listens: where it is, and commands that work when copied.

Contract
--------
``banner(...)`` returns the lines; the first is always ``sfchat-relay listening on URL``. The
commands put no secret on a command line (where ``ps`` shows it to every user of a machine):

* the token goes into the environment, ``export SFCHAT_TOKEN=...`` shown once, and only when the
  relay generated it; a token the operator chose is never echoed: the line reads it with
  ``read -rs`` instead;
* there is no secret to pick: the tail prints a pairing code, and the head asks for it;
* the URL is the one the operator gave (``--public-url``), else the address the relay is bound
  to, else (bound to every address: 0.0.0.0, ::) this host's first public address, else its first
  address at all (``local_addresses``), with every address listed and a line saying to use this
  host's public IP or DNS name from another network, and wss:// behind a TLS proxy (or the
  certificate's name when the relay serves TLS itself).

A relay that emulates a link (``--emulate-rtt-ms``, ``--emulate-mbps``) says so in two lines of
capitals marked ``!!!``: it slows every session down on purpose, which only a benchmark wants.

Every string in the banner that came from outside (the host flag, the addresses the system
reports) goes through ``plain`` first. This module knows nothing of websockets or sessions.
"""

from __future__ import annotations

import fcntl
import ipaddress
import shlex
import socket
import struct

WILDCARDS = ("0.0.0.0", "::", "")
SIOCGIFADDR = 0x8915  # Linux: the IPv4 address of an interface


def plain(text: str) -> str:
    """``text`` with every character that is not printable (escapes, newlines) shown as ``?``."""
    return "".join(c if c.isprintable() else "?" for c in text)


def _ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(text.split("%", 1)[0])
    except ValueError:
        return None  # a DNS name


def _route_sources() -> list[str]:
    """The source addresses of this host's default routes (connecting a UDP socket sends nothing)."""
    found = []
    for family, probe in ((socket.AF_INET, "192.0.2.1"), (socket.AF_INET6, "2001:db8::1")):
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as probe_socket:
                probe_socket.connect((probe, 9))
                found.append(probe_socket.getsockname()[0])
        except OSError:
            pass
    return found


def _interface_addresses() -> list[str]:
    """Each interface's IPv4 address, then every IPv6 address (Linux; elsewhere none)."""
    found = []
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as ioctl_socket:
            for _, name in socket.if_nameindex():
                try:
                    answer = fcntl.ioctl(ioctl_socket.fileno(), SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
                except OSError:
                    continue  # no IPv4 address on this interface
                found.append(socket.inet_ntoa(answer[20:24]))
    except OSError:
        pass
    try:
        with open("/proc/net/if_inet6") as table:
            for line in table:
                digits = line.split()[0]
                found.append(str(ipaddress.IPv6Address(int(digits, 16))))
    except (OSError, ValueError, IndexError):
        pass
    return found


def local_addresses() -> list[str]:
    """This host's non-loopback, non-link-local addresses, those of its default routes first."""
    seen: dict[str, None] = {}
    for address in [*_route_sources(), *_interface_addresses()]:
        ip = _ip(address)
        if ip is not None and not (ip.is_loopback or ip.is_link_local or ip.is_unspecified):
            seen.setdefault(str(ip), None)
    return list(seen)


def ws_url(host: str, port: int, tls: bool) -> str:
    host = f"[{host}]" if ":" in host else host  # IPv6 literal
    return f"{'wss' if tls else 'ws'}://{host}:{port}"


def _where(host: str, port: int, tls: bool, addresses: list[str]) -> tuple[str, list[str]]:
    """The URL for the commands, and the lines that say which address to use."""
    ip = _ip(host)
    if host == "localhost" or (ip is not None and ip.is_loopback):
        return ws_url(plain(host), port, tls), ["bound to loopback: only this machine can connect"]
    if host not in WILDCARDS:
        lines = [] if ip is None or ip.is_global else \
            ["a private address: from another network, use this host's public IP or DNS name"]
        return ws_url(plain(host), port, tls), lines
    public = [a for a in addresses if (ip := _ip(a)) is not None and ip.is_global]
    chosen = (public or addresses or ["PUBLIC_HOST"])[0]
    lines = [f"this host's addresses: {', '.join(addresses) or 'none found'}",
             f"the commands below use {chosen} ({'a public address' if public else 'not a public address'}); "
             f"from another network use",
             f"this host's public IP or DNS name, with TCP port {port} open (or start the relay with --public-url)",
             "the relay serves TLS: use the name on its certificate" if tls else
             "behind a TLS proxy (nginx, caddy...): wss://THE_PROXYS_NAME instead of ws://"]
    return ws_url(plain(chosen), port, tls), lines


def banner(host: str, port: int, tls: bool, token: str, token_generated: bool, emulate_rtt_ms: float,
           public_url: str | None = None, addresses: list[str] | None = None, emulate_mbps: float = 0.0) -> str:
    """The lines ``sfchat-relay`` prints at start. ``public_url``: what the others reach the relay
    by (``--public-url``), used as it is; ``addresses``: ``local_addresses()`` unless given."""
    if public_url is not None:
        url, where = plain(public_url), []
    else:
        if addresses is None and host in WILDCARDS:
            addresses = local_addresses()
        url, where = _where(host, port, tls, [plain(a) for a in addresses or []])
    everywhere = " (every address of this host)" if host in WILDCARDS else ""
    lines = [f"sfchat-relay listening on {ws_url(plain(host) or '0.0.0.0', port, tls)}{everywhere}", *where]
    emulated = [f"a round trip of {emulate_rtt_ms:g} ms"] * bool(emulate_rtt_ms) + \
        [f"{emulate_mbps:g} Mbit/s each way"] * bool(emulate_mbps)
    if emulated:
        lines += [f"!!! EMULATING A SLOW LINK ({', '.join(emulated)}): EVERY FRAME IS HELD BACK ON PURPOSE",
                  "!!! FOR BENCHMARKS ONLY: for real use, restart without --emulate-rtt-ms and --emulate-mbps"]
    if token_generated:
        lines += ["token generated for this run (start the relay with SFCHAT_TOKEN set to keep one);",
                  "on both machines first (in a notebook: store it as the secret SFCHAT_TOKEN instead):",
                  f"  export SFCHAT_TOKEN={shlex.quote(plain(token))}"]
    else:
        lines += ["on both machines first, pasting the token this relay was started with (not echoed):",
                  "  read -rs SFCHAT_TOKEN && export SFCHAT_TOKEN"]
    lines += ["then on the tail machine (it prints a pairing code):",
              f"  sfchat --tail --relay {url} --session NAME",
              "and on the head machine (it asks for that code):",
              f"  sfchat --relay {url} --session NAME",
              "NAME: any session name, the same on both (1..64 of A-Z a-z 0-9 . _ -)"]
    return "\n".join(lines)
