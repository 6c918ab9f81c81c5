"""Dialog security per conversation (seed 004): each endpoint's session key.

A dialog with another broker is secure when its far service has a remote service binding here.
The initiator agrees a session key for it once (:func:`for_sending`): a key exchange signed with
the initiating service's certificate (unless the binding is anonymous) and wrapped for the
target certificate in the binding. The key, sealed under the master key, and the exchange are
kept in ``broker_dialog_key``. Every message body of the dialog, both ways, is then sealed under
the session key before it leaves the sending database's transaction: the transmission queue,
forwarders and the far inbox hold only ciphertext. The initiator's messages carry the exchange;
the target opens it the first time (:func:`for_receiving`), checking the certificates and the
signature, and keeps the key for its endpoint.

``encryption`` on an endpoint (BEGIN DIALOG's ENCRYPTION, on by default) says what happens
without a binding: the dialog waits (:class:`Wait`, the reason names what is missing); off, it
travels in clear. A dialog whose endpoint holds a key never travels in clear again.

Failures of the far side or of a certificate are :class:`~airflow_broker.security.crypto.
SecurityFailure` (the dialog ends with an Error naming the reason); what an operator can fix
here (a missing binding, certificate or master key) is :class:`Wait`.
"""

from __future__ import annotations

import threading
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection, Engine

from airflow_broker.constants import ERR_CERTIFICATE_EXPIRED
from airflow_broker.errors import DialogSecurityError
from airflow_broker.security import certificates, crypto
from airflow_broker.security.crypto import SecurityFailure
from airflow_broker.storage import bulk
from airflow_broker.storage import schema as s
from airflow_broker.storage.clock import aware

#: Session keys kept in memory per endpoint (they never change for an endpoint).
CACHE_SIZE = 50_000

_cache: OrderedDict[uuid.UUID, bytes] = OrderedDict()
_cache_lock = threading.Lock()


class Wait(Exception):
    """The dialog cannot be secured yet, for a reason an operator can fix here."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Sealing:
    """How a side seals its messages: the session key, and (initiator) the key exchange."""

    key: bytes
    handshake: bytes | None = None


def _date(when: datetime) -> str:
    return when.strftime("%Y-%m-%d %H:%M:%S UTC")


def _remember(handle: uuid.UUID, key: bytes) -> None:
    with _cache_lock:
        _cache[handle] = key
        _cache.move_to_end(handle)
        while len(_cache) > CACHE_SIZE:
            _cache.popitem(last=False)


def _master() -> bytes:
    master = crypto.master_key()
    if master is None:
        raise Wait(crypto.MASTER_KEY_MISSING_REASON)
    return master


def _unwrap(handle: uuid.UUID, sealed: bytes) -> bytes:
    with _cache_lock:
        key = _cache.get(handle)
    if key is None:
        try:
            key = crypto.open_with_master(_master(), bytes(sealed))
        except DialogSecurityError as exc:
            raise Wait(f"waiting for dialog security: {exc}") from exc
        _remember(handle, key)
    return key


def existing(conn: Connection, handle: uuid.UUID) -> Sealing | None:
    """The endpoint's sealing if its dialog is secure, else None."""
    k = s.dialog_key
    row = conn.execute(
        select(k.c.session_key, k.c.handshake).where(k.c.conversation_handle == handle)
    ).first()
    if row is None:
        return None
    return Sealing(_unwrap(handle, row.session_key), row.handshake)


def _store(
    conn: Connection,
    handle: uuid.UUID,
    key: bytes,
    master: bytes,
    handshake: bytes | None,
    local: str | None,
    remote: str | None,
    now: datetime,
) -> Sealing:
    """Keep the endpoint's key; if another transaction stored one first, that one wins (the
    answer is whichever is stored)."""
    values = {
        "conversation_handle": handle,
        "session_key": crypto.seal_with_master(master, key),
        "handshake": handshake,
        "local_certificate": local,
        "remote_certificate": remote,
        "created_at": now,
    }
    ins = (postgresql if conn.dialect.name == "postgresql" else sqlite).insert(s.dialog_key)
    conn.execute(ins.values(**values).on_conflict_do_nothing())
    won = existing(conn, handle)
    assert won is not None  # ours, or the one that won
    return won


def for_sending(
    conn: Connection, ep: Any, now: datetime, *, commit_with: Engine | None = None
) -> Sealing | None:
    """How endpoint ``ep`` (conversation_handle, conversation_id, is_initiator, service_name,
    far_service, encryption) seals what it sends to another broker: None for a dialog in
    clear. The initiator agrees the session key here the first time. :class:`Wait` when the
    dialog needs security that is not configured; :class:`SecurityFailure` when a certificate
    it needs has expired (the dialog stops). ``commit_with``: an engine to store a new key with
    in a transaction of its own, committed before this returns (a delivery pass, which sends the
    key exchange before its own transaction commits: a far side that took it must never see the
    dialog agree another key)."""
    handle = ep.conversation_handle
    found = existing(conn, handle)
    if found is not None or not ep.is_initiator:
        # A target seals only the dialogs its initiator secured.
        return found
    binding = certificates.binding_for(conn, ep.far_service)
    if binding is None:
        if ep.encryption:
            raise Wait(
                f"waiting for dialog security: the dialog was begun with encryption on and "
                f"service {ep.far_service!r} has no remote service binding here "
                f"(create_remote_service_binding(..., service={ep.far_service!r}, "
                "certificate=...)), or begin it with encryption=False"
            )
        return None
    master = _master()
    if binding.expires_at <= now:
        raise SecurityFailure(
            f"certificate {binding.certificate!r} of remote service binding {binding.name!r} "
            f"(service {ep.far_service!r}) expired on {_date(binding.expires_at)}",
            ERR_CERTIFICATE_EXPIRED,
        )
    identity = None
    if not binding.anonymous:
        try:
            identity = certificates.local_identity(conn, ep.service_name, now)
        except DialogSecurityError as exc:
            raise Wait(f"waiting for dialog security: {exc}") from exc
        if identity is None:
            last = certificates.last_identity(conn, ep.service_name)
            if last is not None and last.expires_at <= now:
                raise SecurityFailure(
                    f"certificate {last.name!r} of service {ep.service_name!r} expired on "
                    f"{_date(last.expires_at)}",
                    ERR_CERTIFICATE_EXPIRED,
                )
            raise Wait(
                f"waiting for dialog security: service {ep.service_name!r} has no certificate "
                f"with a private key (create_certificate(..., owner={ep.service_name!r})), "
                f"which remote service binding {binding.name!r} needs to authenticate it "
                "(or make the binding anonymous)"
            )
    try:
        key, handshake = crypto.make_handshake(
            conversation_id=ep.conversation_id,
            initiator_service=ep.service_name,
            target_service=ep.far_service,
            target_certificate_pem=binding.pem,
            initiator_certificate_pem=None if identity is None else identity.pem,
            initiator_private_key=None if identity is None else identity.private_key,
            now=now,
        )
    except SecurityFailure as exc:
        name = (
            binding.certificate
            if identity is None
            else f"{binding.certificate!r}/{identity.name!r}"
        )
        raise SecurityFailure(f"certificate {name}: {exc.reason}", exc.code) from exc
    stored = (
        None if identity is None else identity.name,
        binding.certificate,
    )
    if commit_with is not None:
        with commit_with.begin() as own:
            return _store(own, handle, key, master, handshake, *stored, now)
    return _store(conn, handle, key, master, handshake, *stored, now)


def _target_identity(
    conn: Connection, service: str, fingerprint: str, now: datetime
) -> tuple[str, str, Any]:
    c = s.certificate
    row = conn.execute(
        select(c.c.name, c.c.pem, c.c.private_key, c.c.expires_at).where(
            c.c.fingerprint == fingerprint, c.c.owner == service
        )
    ).first()
    if row is None or row.private_key is None:
        raise SecurityFailure(
            f"service {service!r} has no certificate with a private key and fingerprint "
            f"{fingerprint}: the initiator's remote service binding names a certificate this "
            "broker does not hold"
        )
    ends = aware(row.expires_at)
    if ends is not None and ends <= now:
        raise SecurityFailure(
            f"certificate {row.name!r} of service {service!r} expired on {_date(ends)}",
            ERR_CERTIFICATE_EXPIRED,
        )
    try:
        der = crypto.open_with_master(_master(), bytes(row.private_key))
    except DialogSecurityError as exc:
        raise Wait(f"waiting for dialog security: {exc}") from exc
    return row.name, row.pem, crypto.load_private_key(der)


def for_receiving(
    conn: Connection,
    ep: dict[str, Any],
    handshake: bytes | None,
    from_service: str,
    seq: int,
    now: datetime,
    *,
    keys: dict[uuid.UUID, bytes] | None = None,
    memo: dict[Any, Any] | None = None,
) -> tuple[bytes, dict[str, Any] | None]:
    """The session key of a secure dialog arriving at endpoint ``ep``, and (the first time) the
    ``broker_dialog_key`` row to write once the endpoint exists. The target checks the key
    exchange: its own certificate, the initiator's (unless the binding is anonymous) and its
    signature, neither certificate expired.

    ``keys``: the sealed keys of the batch's endpoints (:func:`keyed`), so that none is looked
    up again; ``memo``: certificates looked up earlier in the same transaction."""
    handle = ep["conversation_handle"]
    if keys is not None:
        sealed = keys.get(handle)
        if sealed is not None:
            return _unwrap(handle, sealed), None
    else:
        found = existing(conn, handle)
        if found is not None:
            return found.key, None
    memo = {} if memo is None else memo
    if handshake is None:
        # The exchange rides on the first packet of each batch; this batch's packets were
        # split from it: they wait until it arrives (the sender sends them again).
        raise Wait(
            f"waiting for the key exchange of conversation {ep['conversation_id']}, which "
            "travels with its first messages"
        )
    said = crypto.handshake_fields(handshake)
    mine = ("target", ep["service_name"], said["target_fingerprint"])
    if mine not in memo:
        memo[mine] = _target_identity(conn, ep["service_name"], said["target_fingerprint"], now)
    name, pem, private_key = memo[mine]
    initiator_pem = None
    remote = None
    if not said["anonymous"]:
        theirs = ("initiator", from_service, said["initiator_fingerprint"])
        if theirs not in memo:
            memo[theirs] = certificates.certificate_owned_by(
                conn, from_service, fingerprint=said["initiator_fingerprint"]
            )
        cert = memo[theirs]
        if cert is None:
            raise SecurityFailure(
                f"no certificate of initiator service {from_service!r} with fingerprint "
                f"{said['initiator_fingerprint']} here: import it (import_certificate(..., "
                f"owner={from_service!r})) or bind anonymously"
            )
        if cert.expires_at <= now:
            raise SecurityFailure(
                f"certificate {cert.name!r} of initiator service {from_service!r} expired on "
                f"{_date(cert.expires_at)}",
                ERR_CERTIFICATE_EXPIRED,
            )
        initiator_pem, remote = cert.pem, cert.name
    try:
        result = crypto.open_handshake(
            handshake,
            conversation_id=ep["conversation_id"],
            initiator_service=from_service,
            target_service=ep["service_name"],
            target_certificate_pem=pem,
            target_private_key=private_key,
            initiator_certificate_pem=initiator_pem,
            now=now,
        )
    except SecurityFailure as exc:
        names = name if remote is None else f"{name!r}/{remote!r}"
        raise SecurityFailure(f"certificate {names}: {exc.reason}", exc.code) from exc
    master = _master()
    row = {
        "conversation_handle": handle,
        "session_key": crypto.seal_with_master(master, result.session_key),
        "handshake": None,
        "local_certificate": name,
        "remote_certificate": remote,
        "created_at": now,
    }
    _remember(handle, result.session_key)
    return result.session_key, row


def seal_body(
    key: bytes,
    conversation_id: uuid.UUID,
    from_initiator: bool,
    seq: int,
    message_type: str,
    body: bytes | None,
) -> bytes:
    return crypto.seal(
        key, body, crypto.message_aad(conversation_id, from_initiator, seq, message_type)
    )


def open_body(
    key: bytes,
    conversation_id: uuid.UUID,
    from_initiator: bool,
    seq: int,
    message_type: str,
    body: bytes | None,
) -> bytes | None:
    if body is None:
        raise SecurityFailure(
            f"message {seq} of conversation {conversation_id} is sealed but empty"
        )
    try:
        return crypto.open_sealed(
            key, body, crypto.message_aad(conversation_id, from_initiator, seq, message_type)
        )
    except SecurityFailure as exc:
        raise SecurityFailure(
            f"message {seq} of conversation {conversation_id} failed its integrity check: "
            "altered in transit, or sealed with another key",
            exc.code,
        ) from exc


def forget() -> None:
    """Drop the session keys kept in memory (tests; after a master key rotation)."""
    with _cache_lock:
        _cache.clear()


def for_sending_many(
    conn: Connection,
    eps: list[Any],
    now: datetime,
    *,
    commit_with: Engine | None = None,
    keyed: set[uuid.UUID] | None = None,
    bound: set[str] | None = None,
) -> dict[uuid.UUID, Sealing | Wait | SecurityFailure | None]:
    """:func:`for_sending` for many endpoints at once (a delivery pass's batch): one query for
    the keys they have, one for the bindings; an endpoint's :class:`Wait` or
    :class:`SecurityFailure` is its value instead of raised. ``keyed`` (the handles that have
    a key) and ``bound`` (the far services with a remote service binding), when the caller read
    them in its own query of this transaction, narrow the first query to those handles (none:
    no query) and save the second."""
    handles = [ep.conversation_handle for ep in eps]
    k = s.dialog_key
    asked = handles if keyed is None else [h for h in handles if h in keyed]
    keys = (
        {
            r.conversation_handle: r
            for r in conn.execute(
                select(k.c.conversation_handle, k.c.session_key, k.c.handshake).where(
                    bulk.any_of(k.c.conversation_handle, asked, conn.dialect.name)
                )
            )
        }
        if asked
        else {}
    )
    if bound is None:
        bound = (
            {b.service for b in certificates.bindings(conn)} if len(keys) < len(handles) else set()
        )
    out: dict[uuid.UUID, Sealing | Wait | SecurityFailure | None] = {}
    for ep in eps:
        h = ep.conversation_handle
        try:
            found = keys.get(h)
            if found is not None:
                out[h] = Sealing(_unwrap(h, found.session_key), found.handshake)
            elif not ep.is_initiator or (ep.far_service not in bound and not ep.encryption):
                out[h] = None
            else:
                out[h] = for_sending(conn, ep, now, commit_with=commit_with)
        except (Wait, SecurityFailure) as exc:
            out[h] = exc
    return out


def keyed(conn: Connection, handles: list[uuid.UUID]) -> dict[uuid.UUID, bytes]:
    """Those of ``handles`` whose dialog is secure, with their sealed session keys."""
    if not handles:
        return {}
    k = s.dialog_key
    return {
        r.conversation_handle: bytes(r.session_key)
        for r in conn.execute(
            select(k.c.conversation_handle, k.c.session_key).where(
                bulk.any_of(k.c.conversation_handle, handles, conn.dialect.name)
            )
        )
    }
