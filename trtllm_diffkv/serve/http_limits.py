"""Limits on slow, idle and half-open HTTP connections, and the ``Host`` names a server answers (``trtllm-diffkv serve``).

uvicorn closes a keep-alive connection idle for ``timeout_keep_alive`` seconds after a response, caps a request
head at ``h11_max_incomplete_event_size`` bytes (16 KiB) and answers 503 past ``limit_concurrency``, but it has no
deadline for receiving a request: a client that sends one header line (or one body byte) every few seconds keeps
its connection, and its slot, for ever (slowloris; xorbits/inference PR #5213 added the same limits after such
reports). :func:`http_protocol` adds, to the HTTP protocol class uvicorn would pick:

- a deadline for the request head: a connection that has not delivered a whole request line and headers
  ``receive_timeout_s`` seconds after it opened, or after its previous response ended, is closed (no response:
  there is no request to answer, as nginx's ``client_header_timeout`` without its 408);
- a cap on open connections: the connection past ``max_connections`` is closed as soon as it is accepted.

The body's deadline (the same ``receive_timeout_s``, counted from the head) is the app's:
:class:`~trtllm_diffkv.serve.openai_server.Drain`'s guard reads the body and answers 408.

:func:`host_allowed` is the ``Host`` rule: a server bound to a loopback address answers only loopback names
(:data:`LOOPBACK_HOSTS`), so that a web page cannot reach it through a DNS name rebound to 127.0.0.1.
"""
from __future__ import annotations

import ipaddress

__all__ = ["http_protocol", "host_allowed", "is_loopback", "LOOPBACK_HOSTS", "RECEIVE_TIMEOUT_S", "MAX_CONNECTIONS",
           "check_allowed_hosts"]

RECEIVE_TIMEOUT_S = 30.0
"""Default seconds to receive a request head, and then its body (``serve --receive-timeout-s``): an 8 MiB body
(the default body cap) at 280 KB/s."""

MAX_CONNECTIONS = 1024
"""Default cap on open connections (``serve --max-connections``): 16 times the default ``--max-batch-size``."""

LOOPBACK_HOSTS = ("localhost", "127.0.0.0/8", "::1")
"""``Host`` names a loopback-bound server answers by default (any port): ``localhost``, ``127.0.0.0/8``,
``[::1]``."""


def is_loopback(host: str) -> bool:
    """Whether the bind address ``host`` is a loopback one (``localhost``, ``127.0.0.0/8``, ``::1``)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_allowed_hosts(patterns) -> list[str]:
    """``patterns`` (names, IP addresses, CIDR networks such as ``10.0.0.0/8``, or ``*`` for any host) checked
    and lower-cased.

    Raises:
        ValueError: an empty list, an empty entry, or an entry with a port or a scheme.
    """
    out = []
    for pattern in patterns:
        pattern = str(pattern).strip().lower()
        if not pattern or "://" in pattern or (":" in pattern and not _is_address(pattern)) or " " in pattern:
            raise ValueError(f"--allowed-hosts entry {pattern!r} is not a host name, an IP address, a network or '*' "
                             "(no scheme, no port)")
        out.append(pattern.strip("[]"))
    if not out:
        raise ValueError("--allowed-hosts is empty (give '*' to allow any host)")
    return out


def _is_address(text: str) -> bool:
    try:
        ipaddress.ip_network(text.strip("[]"), strict=False)
        return True
    except ValueError:
        return False


def host_allowed(host_header: str | None, patterns) -> bool:
    """Whether a request with this ``Host`` header value is answered under ``patterns`` (:func:`check_allowed_hosts`'s
    form; ``None``: every host). The port is ignored; names compare case-insensitively; an IP address matches an
    equal address or a network holding it. A request without ``Host`` (HTTP/1.0) is answered."""
    if patterns is None or "*" in patterns or host_header is None:
        return True
    host = host_header.strip().lower()
    if host.startswith("["):  # [v6] or [v6]:port
        host = host[1:host.find("]")] if "]" in host else host[1:]
    elif host.count(":") == 1:
        host = host.split(":", 1)[0]
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        address = None
    for pattern in patterns:
        if address is None:
            if host == pattern:
                return True
        elif _is_address(pattern) and address in ipaddress.ip_network(pattern, strict=False):
            return True
    return False


def http_protocol(receive_timeout_s: float | None, max_connections: int | None):
    """The HTTP protocol class uvicorn's ``http="auto"`` picks (httptools when installed, else h11), with the head
    deadline and the connection cap of the module docstring (``None``: that limit off). Pass it as
    ``uvicorn.Config(http=...)``."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    class LimitedProtocol(AutoHTTPProtocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            if max_connections is not None and len(self.connections) > max_connections:
                self.transport.close()  # connection_lost forgets it
                return
            self._arm_head_deadline()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm_head_deadline()  # the next request's head has the same deadline

        def connection_lost(self, exc) -> None:
            handle = getattr(self, "_head_deadline", None)
            if handle is not None:
                handle.cancel()
            super().connection_lost(exc)

        def _arm_head_deadline(self) -> None:
            if receive_timeout_s is None:
                return
            previous = getattr(self, "_head_deadline", None)
            if previous is not None:
                previous.cancel()
            waiting_after = self.cycle  # a new request head replaces the cycle
            self._head_deadline = self.loop.call_later(receive_timeout_s, self._head_overdue, waiting_after)

        def _head_overdue(self, waiting_after) -> None:
            cycle = self.cycle  # still the one before the deadline, and not running: no new head came
            if cycle is waiting_after and (cycle is None or cycle.response_complete) and not self.transport.is_closing():
                self.transport.close()

    LimitedProtocol.__name__ = LimitedProtocol.__qualname__ = f"Limited{AutoHTTPProtocol.__name__}"
    return LimitedProtocol
