"""The master key: what private keys and session keys are sealed under at rest, never stored in
the database (like Service Broker's database master key).

:func:`master_key` takes it from ``AIRFLOW_BROKER_MASTER_KEY`` or, when that is not set, from the
sources registered under the entry-point group ``airflow_broker.master_key_sources`` (the Airflow
provider registers one reading the Airflow Variable / secret ``airflow_broker_master_key``); the
string becomes a 256-bit key through HKDF-SHA256. :func:`seal_with_master` seals with AES-256-GCM
and marks each blob with a short id of the key, so that a wrong master key is told apart from an
altered blob. Re-exported by :mod:`airflow_broker.security.crypto`.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Final

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from airflow_broker.errors import DialogSecurityError

log = logging.getLogger("airflow_broker")

MASTER_KEY_ENV: Final = "AIRFLOW_BROKER_MASTER_KEY"

#: Entry-point group of master key sources: callables ``() -> str | None``, asked in name order
#: when :data:`MASTER_KEY_ENV` is not set (the Airflow provider registers the Airflow Variable).
MASTER_KEY_SOURCES: Final = "airflow_broker.master_key_sources"

#: The Airflow Variable (or secret of any configured secrets backend) the provider reads.
MASTER_KEY_VARIABLE: Final = "airflow_broker_master_key"

#: The transmission status of a secure dialog's messages while there is no master key.
MASTER_KEY_MISSING_REASON: Final = (
    f"waiting for dialog security: no master key (set {MASTER_KEY_ENV}, or the Airflow "
    f"Variable/secret {MASTER_KEY_VARIABLE}); private keys and session keys are sealed under it"
)

#: Seconds a master key found through a registered source (or its absence) is reused.
SOURCE_CACHE_SECONDS: Final = 60.0

_KDF_SALT: Final = b"airflow-broker master key v1 salt"
_KDF_INFO: Final = b"airflow-broker master key v1"
_SEALED_VERSION: Final = 1
_KEY_ID_BYTES: Final = 4
_NONCE: Final = 12
_TAG: Final = 16

_lock = threading.Lock()
#: (monotonic time the sources were asked, the key they gave)
_from_sources_cache: tuple[float, bytes | None] | None = None


@functools.lru_cache(maxsize=1024)
def aead(key: bytes) -> AESGCM:
    """The AES-GCM object of ``key``, made once per key (a small LRU cache)."""
    return AESGCM(key)


@functools.cache
def registered_master_key_sources() -> tuple[Callable[[], str | None], ...]:
    """The master key sources installed packages register under :data:`MASTER_KEY_SOURCES`."""
    found = []
    for ep in sorted(entry_points(group=MASTER_KEY_SOURCES), key=lambda e: e.name):
        try:
            found.append(ep.load())
        except Exception:  # a broken plugin must not stop the broker
            log.exception("master key source %s (%s) does not load; ignored", ep.name, ep.value)
    return tuple(found)


@functools.lru_cache(maxsize=8)
def derive_master_key(secret: str) -> bytes:
    """The 32-byte master key of the configured string (HKDF-SHA256, fixed salt and info)."""
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=_KDF_SALT, info=_KDF_INFO).derive(
        secret.encode("utf-8")
    )


def _ask_sources() -> str | None:
    for source in registered_master_key_sources():
        try:
            value = source()
        except Exception:  # logged, and the next source is asked
            log.exception("master key source %r failed; ignored", source)
            continue
        if value:
            return str(value)
    return None


def master_key() -> bytes | None:
    """The master key: :data:`MASTER_KEY_ENV` when set (read every time, derived once per
    value), else the first registered source that answers (asked again after
    :data:`SOURCE_CACHE_SECONDS`); None when there is none."""
    global _from_sources_cache
    env = os.environ.get(MASTER_KEY_ENV)
    if env:
        return derive_master_key(env)
    now = time.monotonic()
    with _lock:
        cached = _from_sources_cache
    if cached is not None and now - cached[0] < SOURCE_CACHE_SECONDS:
        return cached[1]
    secret = _ask_sources()
    key = derive_master_key(secret) if secret is not None else None
    with _lock:
        _from_sources_cache = (now, key)
    return key


def forget_master_key() -> None:
    """Ask the registered sources again on the next :func:`master_key` (after a rotation)."""
    global _from_sources_cache
    with _lock:
        _from_sources_cache = None


def require_master_key(purpose: str) -> bytes:
    """The master key, else :class:`DialogSecurityError` saying how to give one and naming
    ``purpose``, what it is needed for ("store the private key of certificate 'x'")."""
    key = master_key()
    if key is None:
        raise DialogSecurityError(
            f"no master key: set {MASTER_KEY_ENV} (or the Airflow Variable/secret "
            f"{MASTER_KEY_VARIABLE}) to {purpose}; it is never stored in the database"
        )
    return key


def _key_id(master: bytes) -> bytes:
    digest = hashes.Hash(hashes.SHA256())
    digest.update(b"airflow-broker master key id v1\x00" + master)
    return digest.finalize()[:_KEY_ID_BYTES]


def seal_with_master(master: bytes, data: bytes) -> bytes:
    """``data`` sealed under the master key (AES-256-GCM): version, key id, nonce, ciphertext."""
    header = bytes([_SEALED_VERSION]) + _key_id(master)
    nonce = os.urandom(_NONCE)
    return header + nonce + aead(master).encrypt(nonce, data, header)


def open_with_master(master: bytes, blob: bytes) -> bytes:
    """What :func:`seal_with_master` sealed; :class:`DialogSecurityError` if it was sealed under
    another master key, or altered."""
    size = 1 + _KEY_ID_BYTES
    if len(blob) < size + _NONCE + _TAG or blob[0] != _SEALED_VERSION:
        raise DialogSecurityError("sealed data is not in a format this broker knows")
    header = blob[:size]
    if header[1:] != _key_id(master):
        raise DialogSecurityError(
            f"sealed under another master key: the master key given ({MASTER_KEY_ENV} or the "
            f"Airflow Variable/secret {MASTER_KEY_VARIABLE}) is not the one it was sealed with"
        )
    try:
        return aead(master).decrypt(blob[size : size + _NONCE], blob[size + _NONCE :], header)
    except InvalidTag:
        raise DialogSecurityError(
            "sealed data failed its integrity check: altered where it is stored"
        ) from None


__all__ = [
    "MASTER_KEY_ENV",
    "MASTER_KEY_MISSING_REASON",
    "MASTER_KEY_SOURCES",
    "MASTER_KEY_VARIABLE",
    "SOURCE_CACHE_SECONDS",
    "aead",
    "derive_master_key",
    "forget_master_key",
    "master_key",
    "open_with_master",
    "registered_master_key_sources",
    "require_master_key",
    "seal_with_master",
]
