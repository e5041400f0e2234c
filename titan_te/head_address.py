"""The head node's address: where rank 0 listens (MASTER_ADDR), checked without torch so the launcher can
refuse a wrong one before any process starts."""
from __future__ import annotations

import socket

from titan_te.errors import ConfigError


def check_head_address(addr: str) -> None:
    """Rank 0 runs on the node with NODE_RANK=0 and listens at MASTER_ADDR: that name must resolve to an
    address of this machine (a ConfigError says which it is not)."""
    hint = ("on one node leave MASTER_ADDR unset; on several, set it to the address of the node with NODE_RANK=0 "
            "as the other nodes reach it")
    try:
        infos = socket.getaddrinfo(addr, None, type=socket.SOCK_STREAM)
    except OSError:
        raise ConfigError(f"MASTER_ADDR={addr} does not resolve to an address; {hint}") from None
    for family, kind, proto, _, sockaddr in infos:
        with socket.socket(family, kind, proto) as s:
            try:
                s.bind((sockaddr[0], 0))
                return
            except OSError:
                continue
    raise ConfigError(f"MASTER_ADDR={addr} is not an address of this machine, where NODE_RANK=0 runs rank 0; {hint}")
