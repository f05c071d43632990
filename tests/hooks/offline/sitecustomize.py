"""Tests run offline: a socket may connect to this machine (loopback addresses, names that resolve only
to them, Unix sockets) and nowhere else. conftest calls `block()` in the test process and puts this
folder on PYTHONPATH, so that every Python subprocess the tests start (effitrain's CLI, torchrun and
its workers) imports this file at start-up and blocks the same.

An attempt raises OSError(ENETUNREACH), as on a machine without a network, and is appended to the file
EFFITRAIN_TEST_NETWORK_LOG names, if set: a library that catches the error and carries on silently
still leaves a line there for a test to see."""

from __future__ import annotations

import errno
import functools
import ipaddress
import os
import socket

INET = (socket.AF_INET, socket.AF_INET6)


@functools.lru_cache(maxsize=1)
def own_names() -> set[str]:
    """This machine's names (torch's elastic agent looks its own name up); asked once, when needed."""
    return {"localhost", socket.gethostname(), socket.getfqdn()}


def is_local_name(host) -> bool:
    """This machine: no host (a passive socket), localhost, its own names, a loopback or unspecified
    (0.0.0.0, ::) address."""
    host = "" if host is None else (host.decode() if isinstance(host, bytes) else str(host)).split("%")[0]
    if host in ("", "localhost"):
        return True
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return host in own_names()
    return ip.is_loopback or ip.is_unspecified


def is_address(host) -> bool:
    try:
        ipaddress.ip_address((host.decode() if isinstance(host, bytes) else str(host)).split("%")[0])
    except ValueError:
        return False
    return True


def is_local(address, resolve) -> bool:
    if not isinstance(address, tuple) or not address:
        return True  # a Unix socket's path
    if is_local_name(address[0]):
        return True
    try:  # a name this machine resolves: local only if every address it has is
        found = {info[4][0] for info in resolve(address[0], None)}
    except OSError:
        return False
    return bool(found) and all(is_local_name(a) for a in found)


def record(what: str) -> None:
    path = os.environ.get("EFFITRAIN_TEST_NETWORK_LOG")
    if path:
        with open(path, "a") as log:
            log.write(f"pid {os.getpid()}: {what}\n")


def block():
    """Patch socket.socket's connect, connect_ex and sendto, and socket.getaddrinfo (a look-up of another
    machine's name is a network call too); returns the function that undoes it."""
    real = {name: getattr(socket.socket, name) for name in ("connect", "connect_ex", "sendto")}
    real_getaddrinfo = socket.getaddrinfo

    def refused(sock, address) -> OSError | None:
        if sock.family not in INET or is_local(address, real_getaddrinfo):
            return None
        record(f"connection to {address!r}")
        return OSError(errno.ENETUNREACH, f"{os.strerror(errno.ENETUNREACH)}: {address!r} (the tests run offline)")

    def getaddrinfo(host, *args, **kwargs):
        if not is_local_name(host) and not is_address(host):  # an address is not looked up (connect checks it)
            record(f"look-up of {host!r}")
            raise socket.gaierror(socket.EAI_NONAME, f"{host!r} not looked up (the tests run offline)")
        return real_getaddrinfo(host, *args, **kwargs)

    def connect(self, address):
        error = refused(self, address)
        if error:
            raise error
        return real["connect"](self, address)

    def connect_ex(self, address):
        error = refused(self, address)
        return error.errno if error else real["connect_ex"](self, address)

    def sendto(self, data, *args):
        error = refused(self, args[-1])  # sendto(data, address) or sendto(data, flags, address)
        if error:
            raise error
        return real["sendto"](self, data, *args)

    socket.socket.connect, socket.socket.connect_ex, socket.socket.sendto = connect, connect_ex, sendto
    socket.getaddrinfo = getaddrinfo

    def undo():
        for name, method in real.items():
            setattr(socket.socket, name, method)
        socket.getaddrinfo = real_getaddrinfo

    return undo


if __name__ == "sitecustomize":  # imported by Python at start-up (this folder on PYTHONPATH)
    block()
