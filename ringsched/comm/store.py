"""The rendezvous store's address and connection: `--dist-init-addr` parsed, the local address and interface that
reach node 0, and the `TCPStore` itself (node 0 hosts it). Used by the launcher's rendezvous
(`process/rendezvous.py`) and by each stage process, which meets its peers through the same store.
"""

from __future__ import annotations

import datetime
import socket
from typing import TYPE_CHECKING

import psutil
from torch.distributed import TCPStore

if TYPE_CHECKING:
    from ringsched.config import EngineConfig


class RendezvousError(RuntimeError):
    pass


def split_addr(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    if not host or not port.isdigit():
        raise RendezvousError(f"--dist-init-addr {addr!r} must be HOST:PORT")
    return host, int(port)


def route_ip(head: str) -> str:
    """The local address of the interface that routes to `head` (what other nodes should dial)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((socket.gethostbyname(head), 9))  # UDP: no packet is sent
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


def interface_of(ip: str) -> str | None:
    """Name of the network interface that carries `ip` (for GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME)."""
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address == ip for a in addrs):
            return name
    return None


def connect_store(cfg: EngineConfig, is_master: bool, timeout: float | None = None) -> TCPStore:
    host, port = split_addr(cfg.dist_init_addr)
    return TCPStore(
        host,
        port,
        is_master=is_master,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=timeout or cfg.dist_timeout),
    )
