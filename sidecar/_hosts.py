"""Which ``Host`` names this sidecar: the HTTP ports' defence against DNS rebinding.

A web page from anywhere can make its own name resolve to 127.0.0.1 once it is loaded
(DNS rebinding). Its scripts are then same-origin with the sidecar's loopback ports:
the Origin check of the state-changing routes passes, no CORS preflight applies, and
on loopback no token stands in the way. Only the ``Host`` header still carries the name
the page used. So a sidecar bound to loopback answers only requests that name it:
``localhost``, a loopback address (127.0.0.0/8, ::1), the address it bound, or the host
of ``--public-url`` (the name a proxy in front passes on), with any port (a local port
forward keeps its own). Everything else is refused with 421 before any route runs, on the
API port and on the OTLP/HTTP port (a rebound page could post spans there: forged runs
and alerts, or heartbeats that keep a dead agent looking alive). OTLP/gRPC needs HTTP/2
with trailers, which no page can send, so it has no check.

A sidecar bound beyond loopback is refused at start without ``--token``: there the token
is the boundary (a browser keeps Basic credentials per origin, so a rebound page has
none), and people reach the sidecar by names it cannot know (a load balancer's, a
container's service name), so any Host is answered.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final
from urllib.parse import urlsplit

from ._settings import Settings, is_loopback

SHOWN_MAX: Final = 100  # characters of a refused Host quoted back


def host_name(host: str) -> str | None:
    """The name in a ``Host`` value (``name``, ``name:port``, ``[v6]``, ``[v6]:port``),
    lower case without a trailing dot; None when the value is not of that form."""
    if host.startswith("["):
        name, closed, port = host[1:].partition("]")
        if not closed or ":" not in name or (port and not port.startswith(":")):
            return None
        port = port[1:]
    else:
        name, _, port = host.partition(":")
    if port and not (port.isascii() and port.isdigit() and int(port) <= 65535):
        return None
    return name.lower().removesuffix(".")


@dataclass(frozen=True, slots=True)
class HostRule:
    """The Host check of both HTTP ports; :meth:`of` builds it from the serve settings."""

    checked: bool  # False: bound beyond loopback, the token is the boundary
    names: frozenset[str] = field(default_factory=frozenset)  # besides the loopback ones

    @classmethod
    def of(cls, settings: Settings, public_url: str | None) -> HostRule:
        names = {host_name(settings.host) or settings.host.lower()}
        if public_url is not None:
            names.add((urlsplit(public_url).hostname or "").removesuffix("."))
        return cls(is_loopback(settings.host), frozenset(n for n in names if n))

    def names_us(self, host: str | None) -> bool:
        if not self.checked or not host:  # no name at all (HTTP/1.0): nothing was renamed
            return True
        name = host_name(host)
        return name is not None and (name in self.names or is_loopback(name))

    def refusal(self, host: str | None) -> str | None:
        """None when ``host`` (the request's Host header) names this sidecar, else why not
        and what to do: the error answer's text."""
        if host is None or self.names_us(host):
            return None
        shown = repr(host[:SHOWN_MAX]) + ("..." if len(host) > SHOWN_MAX else "")
        named = sorted(n for n in self.names if not is_loopback(n))
        also = f", {', '.join(named)}" if named else ""
        return (
            f"Host {shown} does not name this sidecar: on loopback it answers only to "
            f"localhost, 127.0.0.1 or [::1]{also} (any port), so that a web page whose name "
            "was made to resolve here (DNS rebinding) can neither read nor change anything. "
            "Use one of those names; behind a proxy or under another name, start the "
            "sidecar with --public-url set to the address people use "
            "(SAGA_SIDECAR_PUBLIC_URL), and have the proxy pass that Host on"
        )
