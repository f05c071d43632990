"""Where the nodes of a job meet: node 0's address and port, checked before torch sees them (torch
takes a port of 70000 or an address with a space and fails later, with a traceback), and a node's wait
for the others said in one line, with its deadline, and bounded."""

from __future__ import annotations

import datetime
import errno
import ipaddress
import re
import socket
import sys
import time

from effitrain.errors import UserError

# One label of a host name (letters, digits, hyphens inside; underscores, which some internal DNS uses).
_LABEL = r"[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?"
HOST_NAME = re.compile(rf"{_LABEL}(?:\.{_LABEL})*\.?")
PROBE_EVERY = 0.2  # seconds between two tries to reach node 0
DEFAULT_PORT = 29500  # torchrun's, for one node given --master-addr without --master-port


def said(name: str, value) -> str:
    """How a message quotes a setting: `--master-port 70000` (a flag), `MASTER_ADDR='a b'` (a variable)."""
    return f"{name} {value!r}" if name.startswith("--") else f"{name}={value!r}"


def check_port(port: int, name: str = "--master-port") -> int:
    if not 1 <= port <= 65535:
        raise UserError(f"{said(name, port)} is not a port (1-65535)",
                        "pass a free port of node 0, the same on every node (e.g. --master-port 29500)")
    return port


def check_address(address: str, name: str = "--master-addr") -> str:
    """Node 0's address as torch reads it (an IPv6 address in brackets); a UserError if it cannot be a
    host name or an IP address. Whether it resolves is asked later: node 0's own name must resolve at
    once (ensure_port_free), another node's may not yet (a Kubernetes service before its pod runs)."""
    text = address.strip()
    fix = (f"set {name.lstrip('-')} to node 0's host name or IP address (e.g. 10.0.0.1 or node01), the same on "
           "every node")
    if name.startswith("--"):
        fix = f"pass {name} with node 0's host name or IP address (e.g. 10.0.0.1 or node01), the same on every node"
    if not text:
        raise UserError(f"{name} is empty", fix)
    try:
        ip = ipaddress.ip_address(text.removeprefix("[").removesuffix("]"))
        return f"[{ip}]" if ip.version == 6 else str(ip)
    except ValueError:
        pass
    if "://" in text:
        raise UserError(f"{said(name, address)} is a URL, not a host", fix)
    if re.fullmatch(r"[^:]+:\d*", text):
        raise UserError(f"{said(name, address)} holds a port", f"{fix}; give the port with --master-port")
    if len(text) > 253 or not HOST_NAME.fullmatch(text):
        raise UserError(f"{said(name, address)} is not a host name or an IP address", fix)
    return text


def ensure_port_free(address: str, port: int) -> None:
    """On node 0, which serves the meeting point: its address resolves, and no other program listens on the
    port (torch's store binds every interface, with SO_REUSEADDR, as here)."""
    host = address.removeprefix("[").removesuffix("]")
    try:
        socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as err:
        raise UserError(f"--master-addr {address} does not resolve on node 0 ({err.strerror or err})",
                        "pass this machine's host name or IP address (node 0 serves the meeting point)") from None
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("", port))
        except OSError as err:
            if err.errno != errno.EADDRINUSE:
                raise UserError(f"--master-port {port} cannot be opened on node 0 ({err.strerror})",
                                "pass a port above 1023 that this user may open, the same on every node") from None
            raise UserError(f"--master-port {port} is taken by another program on node 0",
                            "pass a free port, the same on every node (ss -ltn lists the ports in use)") from None


def deadline_said(seconds: float) -> str:
    """`until 14:32:05 (600 s)`: the clock time a person compares with their own."""
    until = datetime.datetime.now() + datetime.timedelta(seconds=seconds)
    return f"until {until:%H:%M:%S} ({seconds:g} s, --join-timeout)"


def wait_for_node_0(address: str, port: int, seconds: float) -> float:
    """Another node: wait until node 0 listens at address:port (a plain connection: torch's client would
    log each failed try, with a stack), at most `seconds`; returns the seconds left for torch's own join.
    A name that does not resolve yet is tried again: a Kubernetes service resolves once its pod runs."""
    host = address.removeprefix("[").removesuffix("]")
    deadline, resolved = time.monotonic() + seconds, False
    while True:
        left = deadline - time.monotonic()
        try:
            socket.create_connection((host, port), timeout=max(0.1, min(1.0, left))).close()
            return max(1.0, deadline - time.monotonic())
        except socket.gaierror:
            pass
        except OSError:
            resolved = True
        if left <= 0:
            what = "answered" if resolved else f"resolved ({host} is not known to this node's DNS)"
            raise UserError(f"node 0 never {what} at {address}:{port} within {seconds:g} s", "start effitrain "
                            "launch on node 0 with the same --nnodes, --master-addr and --master-port (node 0 "
                            "first, or within --join-timeout), and check that this node can reach that port")
        time.sleep(PROBE_EVERY)


def nodes_missing(err: BaseException, nnodes: int, address: str, port: int, seconds: float) -> UserError:
    """Node 0's store timed out waiting for the other nodes (torch: `1/2 clients joined`)."""
    match = re.search(r"(\d+)/(\d+) clients joined", str(err))
    joined = f"only {int(match[1]) - 1} of the {nnodes - 1} other node(s)" if match else "not every other node"
    return UserError(f"{joined} joined node 0 at {address}:{port} within {seconds:g} s", "start effitrain launch "
                     "on every node with the same --nnodes, --master-addr and --master-port, and check that they can "
                     "reach that port of node 0 (a firewall)")


# Once node 0 answers, torch's store still needs the nodes' agents to agree on the ranks: never less than this.
MIN_STORE_SECONDS = 60


def standalone(args) -> bool:
    """One node and no address given: torchrun picks a free port on localhost, nothing to meet."""
    return args.nnodes == 1 and args.master_addr is None


def meeting_point(args) -> tuple[str, int]:
    """Where node 0 waits: `effitrain launch`'s --master-addr and --master-port, or torchrun's defaults."""
    return args.master_addr or "127.0.0.1", args.master_port or DEFAULT_PORT


def meet(args) -> float | None:
    """Before torch's rendezvous: node 0 checks that it can serve the meeting point; with several nodes each
    says what it waits for and until when, and another node waits (bounded) for node 0 to listen. Returns
    the seconds torch's store gets to gather the nodes (None: standalone, nothing to meet)."""
    if standalone(args):
        return None
    address, port = meeting_point(args)
    if args.node_rank == 0:
        ensure_port_free(address, port)
    if args.nnodes == 1:
        return None
    seconds, until = args.join_timeout, deadline_said(args.join_timeout)
    if args.node_rank == 0:
        print(f"effitrain launch: node 0 waits for the other {args.nnodes - 1} node(s) at {address}:{port} {until}",
              file=sys.stderr, flush=True)
        return seconds
    print(f"effitrain launch: node {args.node_rank} waits for node 0 at {address}:{port} {until}", file=sys.stderr,
          flush=True)
    return max(MIN_STORE_SECONDS, wait_for_node_0(address, port, seconds))


def not_met(args, err: BaseException) -> UserError:
    address, port = meeting_point(args)
    if args.node_rank == 0:
        return nodes_missing(err, args.nnodes, address, port, args.join_timeout)
    last = (str(err).strip().splitlines() or [type(err).__name__])[-1][:300]
    return UserError(f"node {args.node_rank} could not join node 0 at {address}:{port} ({last})",
                     "start effitrain launch on every node with the same --nnodes, --master-addr and --master-port")
