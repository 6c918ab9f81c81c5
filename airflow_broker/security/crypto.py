"""Dialog security's cryptography (seed 004): pure (no database), every primitive from the pyca
``cryptography`` library. The certificates and keys are :mod:`.pki`, the master key
:mod:`.master_key`; both are re-exported here, the one module SEND and delivery import.

As in Service Broker, asymmetric keys authenticate the dialog and agree its session key, and the
session key then signs and encrypts every message:

- **Certificates** are X.509 (:func:`generate_certificate` makes an EC P-256 key pair and a
  self-signed certificate; imported ones may be EC or RSA of 2048 bits or more).
- **The key exchange** (:func:`make_handshake`, :func:`open_handshake`) wraps a fresh 256-bit
  session key per dialog under a *key exchange key* (KEK) with AES-256-GCM, bound to the
  conversation, both services and the *header* that carries the KEK. As in Service Broker, the
  header is made once per pair of services and reused for :data:`KEK_LIFETIME`: the KEK wrapped
  for the target certificate's public key (RSA-OAEP-SHA256, or an ephemeral ECDH on the target's
  curve, HKDF-SHA256 and AES-GCM) and, unless the binding is anonymous, signed with the
  initiator's private key (ECDSA-SHA256 or RSA-PSS-SHA256) over all it says: both services,
  both certificates' fingerprints, the wrapped KEK and when it was made. The target checks all
  of it once per header, then only unwraps session keys (checking the conversation, services,
  both certificates' validity and the header's age each time). Anonymous: only the target is
  authenticated (only it can unwrap the KEK); the initiator is not.
- **Messages** are sealed with AES-256-GCM under the session key (:func:`seal`,
  :func:`open_sealed`): an AEAD, so one operation both encrypts the body and authenticates it
  (the "signature" of every message), together with what it travels with (:func:`message_aad`:
  conversation, direction, sequence number, message type). A body altered in transit, moved to
  another place in the dialog or sealed with another key fails its integrity check.
- **Private keys and session keys at rest** are sealed under the master key
  (:func:`seal_with_master`), which is never in the database (like Service Broker's database
  master key): :func:`master_key` takes it from ``AIRFLOW_BROKER_MASTER_KEY`` or from a source
  registered under the entry-point group ``airflow_broker.master_key_sources`` (the Airflow
  provider registers the Airflow Variable / secret ``airflow_broker_master_key``).

Blobs are length-prefixed binary with a version byte, never pickle. :class:`SecurityFailure` is
what a far side did wrong or a check that failed (its ``code`` is the Error code the dialog ends
with); :class:`~airflow_broker.errors.DialogSecurityError` is what cannot be done here at all (no
master key, a certificate that does not parse).
"""

from __future__ import annotations

import functools
import hashlib
import os
import struct
import threading
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Final, TypeVar

from cryptography.exceptions import InvalidSignature, InvalidTag
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, padding, rsa
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from airflow_broker.errors import DialogSecurityError
from airflow_broker.security.master_key import (
    MASTER_KEY_ENV,
    MASTER_KEY_MISSING_REASON,
    MASTER_KEY_SOURCES,
    MASTER_KEY_VARIABLE,
    aead,
    derive_master_key,
    forget_master_key,
    master_key,
    open_with_master,
    registered_master_key_sources,
    require_master_key,
    seal_with_master,
)
from airflow_broker.security.pki import (
    CLOCK_SKEW,
    MAX_SUBJECT,
    MIN_RSA_BITS,
    CertificateInfo,
    PrivateKey,
    PublicKey,
    SecurityFailure,
    format_time,
    generate_certificate,
    key_matches,
    load_certificate,
    load_private_key,
    normalized_pem,
    private_key_der,
)

# ---------------------------------------------------------------------------------------------
# The key exchange: a header per service pair (cached), a session key per dialog
# ---------------------------------------------------------------------------------------------

#: How long an initiator reuses a key exchange header (and its key exchange key) for the dialogs
#: between two services.
KEK_LIFETIME: Final = timedelta(hours=1)
#: The oldest header a target accepts. A dialog's exchange is made once, at its first SEND, and
#: travels with its first messages however long they wait for the far broker (an outage, a
#: route not created yet): far longer than KEK_LIFETIME, but not forever.
HEADER_MAX_AGE: Final = timedelta(days=365)

#: Key exchanges remembered in process memory at each end (least recently used go first).
KEY_EXCHANGE_CACHE_SIZE: Final = 4096

_HS_MAGIC: Final = b"ABDH"
_HS_VERSION: Final = 2
# The fields: the header's (once per service pair and KEK_LIFETIME) initiator service, target
# service, target fingerprint, initiator fingerprint, algorithm, ephemeral key, wrapped KEK,
# creation time and signature; then the dialog's conversation id and wrapped session key.
_HEADER_FIELDS: Final = 9
_FIELDS: Final = 11
_RSA_OAEP: Final = b"rsa-oaep-sha256"
_ECDH: Final = b"ecdh-hkdf-sha256-aes256gcm"
_KEK_INFO: Final = b"airflow-broker key exchange key v2"
_KEY_INFO: Final = b"airflow-broker dialog key v2"
_LEN = struct.Struct(">I")
_TIME = struct.Struct(">q")  # microseconds since the Unix epoch
_EPOCH: Final = datetime(1970, 1, 1, tzinfo=UTC)
_MICROSECOND: Final = timedelta(microseconds=1)
_NOT_MINE: Final = (
    "the dialog's session key cannot be unwrapped with this broker's private key: it was "
    "wrapped for another key, or altered in transit"
)


@dataclass(frozen=True)
class HandshakeResult:
    """What the target learns from a handshake that verified."""

    session_key: bytes = field(repr=False)
    #: True: the initiator was not authenticated (an anonymous remote service binding)
    anonymous: bool
    initiator_fingerprint: str | None
    target_fingerprint: str


@dataclass(frozen=True, slots=True)
class _Exchange:
    """A header's key exchange key and creation time (and, at the initiator, the header)."""

    kek: AESGCM = field(repr=False)
    created: datetime
    header: bytes = b""
    digest: bytes = b""


_K = TypeVar("_K")
_lock = threading.Lock()
#: Initiator: (initiator service, target service, target fingerprint, initiator fingerprint).
_made: OrderedDict[tuple[str, str, str, str | None], _Exchange] = OrderedDict()
#: Target: (header digest, target fingerprint, initiator fingerprint).
_opened: OrderedDict[tuple[bytes, str, str | None], _Exchange] = OrderedDict()


def _recall(
    cache: OrderedDict[_K, _Exchange], key: _K, keep: _Exchange | None = None
) -> _Exchange | None:
    """The exchange ``cache`` holds under ``key`` (or, given ``keep``, holds it from now on)."""
    with _lock:
        if keep is not None:
            cache[key] = keep
            cache.move_to_end(key)
            while len(cache) > KEY_EXCHANGE_CACHE_SIZE:
                cache.popitem(last=False)
            return keep
        if key in cache:
            cache.move_to_end(key)
        return cache.get(key)


@functools.lru_cache(maxsize=256)
def _belongs(certificate_pem: str, key: PrivateKey) -> bool:
    """:func:`key_matches`, remembered per key object (it serializes both public keys)."""
    return key_matches(load_certificate(certificate_pem), key)


def forget_key_exchanges() -> None:
    """Forget every key exchange header this process made or verified (tests; after rotating a
    certificate): the next dialog between two services makes a new one, and the target verifies
    it in full."""
    with _lock:
        _made.clear()
        _opened.clear()
    _belongs.cache_clear()


def _pack(fields: list[bytes]) -> bytes:
    return b"".join(_LEN.pack(len(f)) + f for f in fields)


def _unpack(blob: bytes) -> tuple[list[bytes], int]:
    """The fields of a handshake and where its header ends; :class:`SecurityFailure` when it is
    not one."""
    head = len(_HS_MAGIC) + 1
    if len(blob) < head or blob[: len(_HS_MAGIC)] != _HS_MAGIC:
        raise SecurityFailure("the dialog's key exchange is not in a format this broker knows")
    if blob[len(_HS_MAGIC)] != _HS_VERSION:
        raise SecurityFailure(
            f"the dialog's key exchange is version {blob[len(_HS_MAGIC)]}; this broker knows "
            f"version {_HS_VERSION}"
        )
    fields: list[bytes] = []
    at = header_end = head
    while at + _LEN.size <= len(blob):
        (size,) = _LEN.unpack_from(blob, at)
        at += _LEN.size
        if at + size > len(blob):
            break
        fields.append(blob[at : at + size])
        at += size
        if len(fields) == _HEADER_FIELDS:
            header_end = at
    if (
        at != len(blob)
        or len(fields) != _FIELDS
        or len(fields[7]) != _TIME.size
        or len(fields[9]) != 16
    ):
        raise SecurityFailure("the dialog's key exchange is truncated or malformed")
    return fields, header_end


def _key_aad(conversation: bytes, initiator: bytes, target: bytes, digest: bytes) -> bytes:
    """What a dialog's wrapped session key is bound to: its conversation, both services and the
    header (its SHA-256), whose key exchange key wraps it."""
    return _KEY_INFO + _pack([conversation, initiator, target, digest])


def _oaep(label: bytes) -> padding.OAEP:
    return padding.OAEP(mgf=padding.MGF1(hashes.SHA256()), algorithm=hashes.SHA256(), label=label)


def _pss() -> padding.PSS:
    return padding.PSS(mgf=padding.MGF1(hashes.SHA256()), salt_length=padding.PSS.DIGEST_LENGTH)


def _derive(shared: bytes, ephemeral: bytes, context: bytes) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=ephemeral, info=context).derive(shared)


def _wrap(public_key: PublicKey, kek: bytes, context: bytes) -> tuple[bytes, bytes, bytes]:
    """(algorithm, ephemeral public key or b"", wrapped key) of ``kek`` for ``public_key``."""
    if isinstance(public_key, rsa.RSAPublicKey):
        return _RSA_OAEP, b"", public_key.encrypt(kek, _oaep(context))
    ephemeral = ec.generate_private_key(public_key.curve)
    point = ephemeral.public_key().public_bytes(
        serialization.Encoding.X962, serialization.PublicFormat.UncompressedPoint
    )
    wrapping = _derive(ephemeral.exchange(ec.ECDH(), public_key), point, context)
    nonce = os.urandom(12)
    return _ECDH, point, nonce + AESGCM(wrapping).encrypt(nonce, kek, context)


def _unwrap(
    private_key: PrivateKey, algorithm: bytes, point: bytes, wrapped: bytes, context: bytes
) -> bytes:
    try:
        if algorithm == _RSA_OAEP and isinstance(private_key, rsa.RSAPrivateKey):
            key = private_key.decrypt(wrapped, _oaep(context))
        elif algorithm == _ECDH and isinstance(private_key, ec.EllipticCurvePrivateKey):
            ephemeral = ec.EllipticCurvePublicKey.from_encoded_point(private_key.curve, point)
            wrapping = _derive(private_key.exchange(ec.ECDH(), ephemeral), point, context)
            key = AESGCM(wrapping).decrypt(wrapped[:12], wrapped[12:], context)
        else:
            raise SecurityFailure(_NOT_MINE)
    except (ValueError, InvalidTag):
        raise SecurityFailure(_NOT_MINE) from None
    if len(key) != 32:
        raise SecurityFailure(_NOT_MINE)
    return key


def _sign(private_key: PrivateKey, data: bytes) -> bytes:
    if isinstance(private_key, rsa.RSAPrivateKey):
        return private_key.sign(data, _pss(), hashes.SHA256())
    return private_key.sign(data, ec.ECDSA(hashes.SHA256()))


def _verify(public_key: PublicKey, signature: bytes, data: bytes) -> bool:
    try:
        if isinstance(public_key, rsa.RSAPublicKey):
            public_key.verify(signature, data, _pss(), hashes.SHA256())
        else:
            public_key.verify(signature, data, ec.ECDSA(hashes.SHA256()))
    except InvalidSignature:
        return False
    return True


def _new_header(
    pair: tuple[str, str, str, str | None],
    target_key: PublicKey,
    initiator_key: PrivateKey | None,
    now: datetime,
) -> _Exchange:
    """A fresh key exchange key, wrapped for ``target_key`` and signed with ``initiator_key``
    (unless None) over the whole header."""
    kek = AESGCM.generate_key(bit_length=256)
    ticks = (now - _EPOCH) // _MICROSECOND
    fields = [text.encode() for text in (pair[0], pair[1], pair[2], pair[3] or "")]
    stamp = _TIME.pack(ticks)
    algorithm, point, wrapped = _wrap(target_key, kek, _KEK_INFO + _pack([*fields, stamp]))
    signed = _HS_MAGIC + bytes([_HS_VERSION]) + _pack([*fields, algorithm, point, wrapped, stamp])
    signature = b"" if initiator_key is None else _sign(initiator_key, signed)
    header = signed + _pack([signature])
    created = _EPOCH + ticks * _MICROSECOND
    return _Exchange(AESGCM(kek), created, header, hashlib.sha256(header).digest())


def make_handshake(
    *,
    conversation_id: uuid.UUID,
    initiator_service: str,
    target_service: str,
    target_certificate_pem: str,
    initiator_certificate_pem: str | None,
    initiator_private_key: PrivateKey | None,
    now: datetime,
) -> tuple[bytes, bytes]:
    """The initiator's side of a dialog's key exchange: (session key, handshake blob).

    The blob is the header of the service pair (a key exchange key wrapped for the target
    certificate's public key, both services and both certificates' fingerprints, signed with the
    initiator's private key unless ``initiator_certificate_pem`` is None: an anonymous binding,
    only the target is authenticated), made again after :data:`KEK_LIFETIME`, and a fresh
    256-bit session key wrapped under its key exchange key for this conversation.
    :class:`SecurityFailure` (``ERR_CERTIFICATE_EXPIRED``) when either certificate is past its
    end at ``now``.
    """
    if (initiator_certificate_pem is None) != (initiator_private_key is None):
        raise DialogSecurityError(
            "an authenticated handshake needs both the initiator's certificate and its private "
            "key; an anonymous one neither"
        )
    target = load_certificate(target_certificate_pem)
    target.check_valid(now)
    initiator_fingerprint: str | None = None
    if initiator_certificate_pem is not None and initiator_private_key is not None:
        initiator = load_certificate(initiator_certificate_pem)
        initiator.check_valid(now)
        if not _belongs(initiator_certificate_pem, initiator_private_key):
            raise SecurityFailure(
                f"the private key of service {initiator_service!r} does not belong to its "
                f"certificate with subject {initiator.subject!r}"
            )
        initiator_fingerprint = initiator.fingerprint
    pair = (initiator_service, target_service, target.fingerprint, initiator_fingerprint)
    exchange = _recall(_made, pair)
    if exchange is None or not exchange.created <= now < exchange.created + KEK_LIFETIME:
        exchange = _new_header(pair, target.public_key, initiator_private_key, now)
        _recall(_made, pair, exchange)
    session_key = AESGCM.generate_key(bit_length=256)
    conversation = conversation_id.bytes
    nonce = os.urandom(12)
    aad = _key_aad(
        conversation, initiator_service.encode(), target_service.encode(), exchange.digest
    )
    wrapped = nonce + exchange.kek.encrypt(nonce, session_key, aad)
    return session_key, exchange.header + _pack([conversation, wrapped])


def _parse(blob: bytes) -> tuple[list[bytes], int, dict[str, Any]]:
    fields, header_end = _unpack(blob)
    try:
        conversation_id = uuid.UUID(bytes=fields[9])
        text = [f.decode("utf-8") for f in fields[:5]]
    except (ValueError, UnicodeDecodeError):
        raise SecurityFailure("the dialog's key exchange is malformed") from None
    anonymous = not text[3]
    if anonymous == bool(fields[8]):
        raise SecurityFailure(
            "the dialog's key exchange is malformed: a signature goes with an initiator "
            "certificate, and only with one"
        )
    said = {
        "version": _HS_VERSION,
        "conversation_id": conversation_id,
        "initiator_service": text[0],
        "target_service": text[1],
        "target_fingerprint": text[2],
        "initiator_fingerprint": None if anonymous else text[3],
        "anonymous": anonymous,
        "algorithm": text[4],
    }
    return fields, header_end, said


def handshake_fields(blob: bytes) -> dict[str, Any]:
    """What a handshake says, unverified (to look certificates up before :func:`open_handshake`):
    ``version``, ``conversation_id`` (UUID), ``initiator_service``, ``target_service``,
    ``target_fingerprint``, ``initiator_fingerprint`` (None: anonymous), ``anonymous``,
    ``algorithm``. :class:`SecurityFailure` when it is not a handshake."""
    return _parse(blob)[2]


def _check_age(created: datetime, now: datetime) -> None:
    if created > now + CLOCK_SKEW:
        raise SecurityFailure(
            f"the dialog's key exchange was made on {format_time(created)}, in the future: the "
            "initiator's clock runs ahead"
        )
    if now - created > HEADER_MAX_AGE:
        raise SecurityFailure(
            f"the dialog's key exchange was made on {format_time(created)}, more than "
            f"{HEADER_MAX_AGE.days} days ago: replayed, or held up in transit too long"
        )


def open_handshake(
    blob: bytes,
    *,
    conversation_id: uuid.UUID,
    initiator_service: str,
    target_service: str,
    target_certificate_pem: str,
    target_private_key: PrivateKey,
    initiator_certificate_pem: str | None,
    now: datetime,
) -> HandshakeResult:
    """The target's side: check everything a handshake says and unwrap its session key.

    The conversation and both services must be the ones the message travels with, the target
    certificate the one it names, neither certificate past its end (``ERR_CERTIFICATE_EXPIRED``),
    the header no older than :data:`HEADER_MAX_AGE` and, unless it is
    anonymous, signed by the initiator's certificate (``initiator_certificate_pem``: the far
    service's, by the fingerprint the handshake names). A header is verified and its key
    exchange key unwrapped once; later dialogs with it only unwrap their session key (every
    check above but the signature still runs). Anything else: :class:`SecurityFailure`.
    """
    fields, header_end, said = _parse(blob)
    if said["conversation_id"] != conversation_id:
        raise SecurityFailure(
            f"the dialog's key exchange is for conversation {said['conversation_id']}, not "
            f"{conversation_id}: replayed or misdelivered"
        )
    for key, expected in (
        ("initiator_service", initiator_service),
        ("target_service", target_service),
    ):
        if said[key] != expected:
            raise SecurityFailure(
                f"the dialog's key exchange names {key.replace('_', ' ')} {said[key]!r}, not "
                f"{expected!r}"
            )
    target = load_certificate(target_certificate_pem)
    if said["target_fingerprint"] != target.fingerprint:
        raise SecurityFailure(
            f"the session key was wrapped for a certificate of service {target_service!r} with "
            f"fingerprint {said['target_fingerprint']}, not for this broker's certificate with "
            f"subject {target.subject!r} (fingerprint {target.fingerprint}): the initiator's "
            "remote service binding names another certificate"
        )
    target.check_valid(now)
    fingerprint: str | None = said["initiator_fingerprint"]
    initiator = None
    if fingerprint is not None:
        if initiator_certificate_pem is None:
            raise SecurityFailure(
                f"no certificate for initiator service {initiator_service!r} (the dialog is "
                f"signed with the certificate whose fingerprint is {fingerprint}): import it "
                "with that service as its owner"
            )
        initiator = load_certificate(initiator_certificate_pem)
        if initiator.fingerprint != fingerprint:
            raise SecurityFailure(
                f"the dialog is signed with a certificate of initiator service "
                f"{initiator_service!r} with fingerprint {fingerprint}, not the one with subject "
                f"{initiator.subject!r} (fingerprint {initiator.fingerprint})"
            )
        initiator.check_valid(now)
    if not _belongs(target_certificate_pem, target_private_key):
        raise SecurityFailure(_NOT_MINE)
    header = blob[:header_end]
    digest = hashlib.sha256(header).digest()
    slot = (digest, target.fingerprint, fingerprint)
    exchange = _recall(_opened, slot)
    if exchange is None:
        if initiator is not None:
            signed = header[: len(header) - _LEN.size - len(fields[8])]
            if not _verify(initiator.public_key, fields[8], signed):
                raise SecurityFailure(
                    f"the dialog's key exchange is not signed by initiator service "
                    f"{initiator_service!r}: its signature does not verify with the certificate "
                    f"with subject {initiator.subject!r} (altered in transit, or signed with "
                    "another key)"
                )
        context = _KEK_INFO + _pack([*fields[:4], fields[7]])
        kek = _unwrap(target_private_key, fields[4], fields[5], fields[6], context)
        try:
            exchange = _Exchange(AESGCM(kek), _EPOCH + _TIME.unpack(fields[7])[0] * _MICROSECOND)
        except OverflowError:  # only an anonymous header can say so
            raise SecurityFailure("the dialog's key exchange is malformed") from None
        _recall(_opened, slot, exchange)  # its age is checked at every use
    _check_age(exchange.created, now)
    wrapped, aad = fields[10], _key_aad(fields[9], fields[0], fields[1], digest)
    try:
        session_key = exchange.kek.decrypt(wrapped[:12], wrapped[12:], aad)
    except (ValueError, InvalidTag):
        raise SecurityFailure(
            "the dialog's session key does not unwrap under its key exchange header: altered in "
            "transit, or taken from another dialog's key exchange"
        ) from None
    if len(session_key) != 32:
        raise SecurityFailure(_NOT_MINE)
    return HandshakeResult(session_key, fingerprint is None, fingerprint, target.fingerprint)


# ---------------------------------------------------------------------------------------------
# Messages
# ---------------------------------------------------------------------------------------------

_MSG_VERSION: Final = 1
_MSG_HEADER: Final = bytes([_MSG_VERSION])
_NONE: Final = b"\x00"
_BODY: Final = b"\x01"
_SEQ = struct.Struct(">q")


def message_aad(
    conversation_id: uuid.UUID, from_initiator: bool, seq: int, message_type: str
) -> bytes:
    """What a sealed body is bound to besides itself: its conversation, direction, sequence
    number and message type. A body moved to another place fails :func:`open_sealed`."""
    return (
        b"ABM"
        + conversation_id.bytes
        + (b"I" if from_initiator else b"T")
        + _SEQ.pack(seq)
        + message_type.encode("utf-8")
    )


def seal(session_key: bytes, body: bytes | None, aad: bytes) -> bytes:
    """A message body signed and encrypted under the dialog's session key (AES-256-GCM, a fresh
    12-byte nonce): version, nonce, ciphertext and tag. None and ``b""`` stay distinct."""
    nonce = os.urandom(12)
    plain = _NONE if body is None else _BODY + bytes(body)
    return _MSG_HEADER + nonce + aead(session_key).encrypt(nonce, plain, _MSG_HEADER + aad)


def open_sealed(session_key: bytes, blob: bytes, aad: bytes) -> bytes | None:
    """The body :func:`seal` sealed with the same key and ``aad``; :class:`SecurityFailure`
    (``ERR_DIALOG_SECURITY``) on any change."""
    if len(blob) < 1 + 12 + 16 + 1 or blob[:1] != _MSG_HEADER:
        raise SecurityFailure(
            "the message body is not sealed in a format this broker knows: altered in transit"
        )
    try:
        plain = aead(session_key).decrypt(blob[1:13], blob[13:], _MSG_HEADER + aad)
    except InvalidTag:
        raise SecurityFailure(
            "the message body failed its integrity check: altered in transit or sealed with "
            "another key"
        ) from None
    if plain == _NONE:
        return None
    if plain[:1] == _BODY:
        return plain[1:]
    raise SecurityFailure("the message body is sealed in a format this broker does not know")


__all__ = [
    "CLOCK_SKEW",
    "HEADER_MAX_AGE",
    "KEK_LIFETIME",
    "KEY_EXCHANGE_CACHE_SIZE",
    "MASTER_KEY_ENV",
    "MASTER_KEY_MISSING_REASON",
    "MASTER_KEY_SOURCES",
    "MASTER_KEY_VARIABLE",
    "MAX_SUBJECT",
    "MIN_RSA_BITS",
    "CertificateInfo",
    "HandshakeResult",
    "PrivateKey",
    "PublicKey",
    "SecurityFailure",
    "aead",
    "derive_master_key",
    "forget_key_exchanges",
    "forget_master_key",
    "format_time",
    "generate_certificate",
    "handshake_fields",
    "key_matches",
    "load_certificate",
    "load_private_key",
    "make_handshake",
    "master_key",
    "message_aad",
    "normalized_pem",
    "open_handshake",
    "open_sealed",
    "open_with_master",
    "private_key_der",
    "registered_master_key_sources",
    "require_master_key",
    "seal",
    "seal_with_master",
]
