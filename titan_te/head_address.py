"""The head node's address: where rank 0 listens (MASTER_ADDR), checked without torch so the launcher can
refuse a wrong one before any process starts."""
from __future__ import annotations

import socket

from titan_te.errors import ConfigError


def check_head_address(addr: str, local: bool = True) -> None:
    """Rank 0 runs on the node with NODE_RANK=0 and opens its store there; the ranks, rank 0 too, reach it at
    MASTER_ADDR. That name must resolve, and (`local`, used once rank 0 failed to reach itself there) be an
    address of this machine: not checked before, since a forwarding address (a Kubernetes service, say)
    reaches it too. A ConfigError says which it is not."""
    hint = ("on one node leave MASTER_ADDR unset; on several, set it to the address of the node with NODE_RANK=0 "
            "as the other nodes reach it")
    try:
        infos = socket.getaddrinfo(addr, None, type=socket.SOCK_STREAM)
    except OSError:
        raise ConfigError(f"MASTER_ADDR={addr} does not resolve to an address; {hint}") from None
    if not local:
        return
    for family, kind, proto, _, sockaddr in infos:
        with socket.socket(family, kind, proto) as s:
            try:
                s.bind((sockaddr[0], 0))
                return
            except OSError:
                continue
    raise ConfigError(f"MASTER_ADDR={addr} is not an address of this machine, where NODE_RANK=0 runs rank 0, and "
                      f"does not reach it; {hint}")
