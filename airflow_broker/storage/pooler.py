"""PostgreSQL: is there a connection pooler between the broker and the server?

A pooler in transaction mode (PgBouncer's ``pool_mode = transaction``, as Airflow's Helm chart
deploys it; RDS Proxy, Supavisor, pgcat and Odyssey do the same) hands each transaction
whichever server process is free. What lives in a server *session* then belongs to nobody:

- a statement prepared in one transaction is missing in the next, or already there when another
  client's transaction prepared it on the same server process;
- LISTEN registers a server process that goes back to the pool, so notifications never reach
  the client that asked for them;
- a session advisory lock stays with a server process that others go on using, and its unlock
  may reach another one;
- a plain ``SET`` changes the server process for whoever gets it next.

So the engine finds out, on its first connection, whether it talks to the server itself: the
server reports the address and port it sees its client at and the port it listens on
(``inet_client_port()``, ``inet_server_port()``, ``current_setting('port')``), and the client
knows both ends of its own socket. Through a pooler they differ (the server's client is the
pooler). On a Unix socket the socket's file name carries the port it was opened on
(``.s.PGSQL.6432``). A network that rewrites addresses on the way (some container port
mappings) looks the same as a pooler: the broker then works as behind one, which costs speed,
never correctness. ``Broker.connect(url, pooled=True | False)`` overrides the decision.

Behind a pooler the broker:

- sends its hot statements whole instead of preparing them (:mod:`~airflow_broker.storage.direct`);
- writes receive leases with unnamed statements and no session setting (the side writer);
- waits by polling instead of LISTEN, unless ``listen_url`` names a direct connection;
- holds the transmitter's one-run-at-a-time lock as a transaction-level lock;

and says so once in the log.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("airflow_broker")

_ASK = "SELECT inet_client_port(), inet_server_port(), current_setting('port')"


@dataclass(frozen=True, slots=True)
class Finding:
    """What the two ends of one connection say: ``pooled`` when they disagree."""

    pooled: bool
    #: the client's view and the server's, for the log
    detail: str


def inspect(dbapi_conn: Any) -> Finding:
    """Compare ``dbapi_conn``'s socket (a psycopg connection) with what the server sees."""
    autocommit = dbapi_conn.autocommit
    dbapi_conn.autocommit = True
    try:
        row = dbapi_conn.execute(_ASK).fetchone()
    finally:
        dbapi_conn.autocommit = autocommit
    seen_client_port, server_port, setting_port = row[0], row[1], int(row[2])
    family, local, peer = _ends(dbapi_conn.pgconn.socket)
    if family == socket.AF_UNIX:
        # The socket file is named after the port it listens on: .s.PGSQL.<port>.
        name = str(peer or "")
        opened_on = name.rsplit(".", 1)[-1] if ".s.PGSQL." in name else None
        direct = seen_client_port is None and opened_on == str(setting_port)
        detail = (
            f"connected to socket {name or '?'}; the server listens on port {setting_port} "
            f"and sees its client at port {seen_client_port or 'a Unix socket'}"
        )
        return Finding(not direct, detail)
    local_port = local[1] if isinstance(local, tuple) else None
    peer_port = peer[1] if isinstance(peer, tuple) else None
    direct = seen_client_port == local_port and server_port in (peer_port, None)
    detail = (
        f"connected from port {local_port} to port {peer_port}; the server sees its client at "
        f"port {seen_client_port} and listens on port {server_port or setting_port}"
    )
    return Finding(not direct, detail)


def _ends(fd: int) -> tuple[int, Any, Any]:
    """(address family, local address, peer address) of the socket ``fd`` (not closed)."""
    sock = socket.socket(fileno=os.dup(fd))
    try:
        with contextlib.suppress(OSError):
            return sock.family, sock.getsockname(), sock.getpeername()
        return sock.family, None, None
    finally:
        sock.close()


__all__ = ["Finding", "inspect"]
