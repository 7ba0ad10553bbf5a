"""ICE restrictions: keep aiortc/aioice on named host addresses only.

aioice gathers host candidates by calling the module-level function
``aioice.ice.get_host_addresses(use_ipv4, use_ipv6)`` from
``Connection.gather_candidates`` (it enumerates every adapter and drops
127.0.0.1 / ::1). :func:`restrict_host_candidates` replaces that one function,
process-wide, with one returning exactly the named addresses (loopback allowed).
It is idempotent: calling it again only changes the list. :func:`unrestrict`
puts the original back.

:func:`rtc_configuration` builds an ``RTCConfiguration`` with an explicit (by
default empty) ``iceServers`` list, so aiortc never falls back to its default
public STUN server.
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Iterable

import aioice.ice
from aiortc import RTCConfiguration, RTCIceServer

__all__ = [
    "ENV_VAR",
    "restrict_host_candidates",
    "unrestrict",
    "hosts_from_env",
    "rtc_configuration",
]

ENV_VAR = "DAISYWEB_ICE_HOSTS"

_original = aioice.ice.get_host_addresses
_allowed: list[str] | None = None


def _restricted_get_host_addresses(use_ipv4: bool, use_ipv6: bool) -> list[str]:
    allowed = _allowed or []
    out = []
    for a in allowed:
        v = ipaddress.ip_address(a).version
        if (v == 4 and use_ipv4) or (v == 6 and use_ipv6):
            out.append(a)
    return out


def hosts_from_env() -> list[str] | None:
    """Comma-separated addresses from ``DAISYWEB_ICE_HOSTS``, or None if unset/empty."""
    raw = os.environ.get(ENV_VAR, "").strip()
    if not raw:
        return None
    return [a.strip() for a in raw.split(",") if a.strip()]


def restrict_host_candidates(addresses: Iterable[str] | None = None) -> list[str]:
    """Limit ICE host candidates to ``addresses`` (or ``$DAISYWEB_ICE_HOSTS``).

    Raises ValueError on an invalid address or when no list is given either way.
    Returns the installed list.
    """
    global _allowed
    addrs = list(addresses) if addresses is not None else hosts_from_env()
    if not addrs:
        raise ValueError(f"no ICE host addresses given (argument or ${ENV_VAR})")
    norm = [str(ipaddress.ip_address(a)) for a in addrs]
    _allowed = norm
    aioice.ice.get_host_addresses = _restricted_get_host_addresses
    return list(norm)


def unrestrict() -> None:
    """Restore aioice's own host address discovery."""
    global _allowed
    _allowed = None
    aioice.ice.get_host_addresses = _original


def rtc_configuration(ice_servers: Iterable[str] = ()) -> RTCConfiguration:
    """RTCConfiguration with explicit ICE servers (default none: no STUN traffic)."""
    return RTCConfiguration(iceServers=[RTCIceServer(u) for u in ice_servers])
