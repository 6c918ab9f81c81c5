"""CREATE / ALTER / DROP of dialog security's objects: certificates and remote service bindings
(seed 004). The store is :mod:`airflow_broker.security.certificates`; these are its verbs inside
a :class:`~airflow_broker.messaging.definitions.Definitions` transaction.
"""

from __future__ import annotations

from datetime import datetime

from airflow_broker.messaging.definitions_core import DefinitionsCore
from airflow_broker.security import certificates as store
from airflow_broker.security.certificates import CertificateRow
from airflow_broker.storage import waits


class SecurityDefinitions(DefinitionsCore):
    """Certificates and remote service bindings of a
    :class:`~airflow_broker.messaging.definitions.Definitions` transaction."""

    # -- certificates --------------------------------------------------------------------------
    def create_certificate(
        self,
        name: str,
        *,
        owner: str,
        subject: str | None = None,
        expires_at: datetime | None = None,
    ) -> CertificateRow:
        """CREATE CERTIFICATE: a key pair and a self-signed certificate for local service
        ``owner``, its private key sealed under the master key (needed: without it nothing is
        written). ``subject`` defaults to the owner, ``expires_at`` to a year from now."""
        row = store.create_certificate(
            self._conn, name, owner=owner, subject=subject, expires_at=expires_at
        )
        waits.wake_for_security(self._conn)  # dialogs that waited for dialog security try again
        return row

    def import_certificate(
        self,
        name: str,
        pem: str,
        *,
        owner: str,
        private_key_pem: str | bytes | None = None,
    ) -> CertificateRow:
        """CREATE CERTIFICATE FROM a PEM, speaking for service ``owner``; with its private key
        (which must match; sealed under the master key) for a local service."""
        row = store.import_certificate(
            self._conn, name, pem, owner=owner, private_key_pem=private_key_pem
        )
        waits.wake_for_security(self._conn)
        return row

    def drop_certificate(self, name: str) -> None:
        """DROP CERTIFICATE; refused while a remote service binding names it."""
        store.drop_certificate(self._conn, name)

    # -- remote service bindings ---------------------------------------------------------------
    def create_remote_service_binding(
        self, name: str, *, service: str, certificate: str, anonymous: bool = False
    ) -> None:
        """CREATE REMOTE SERVICE BINDING: far ``service`` is reached with ``certificate`` (its
        public certificate); ``anonymous``: this side does not authenticate."""
        store.create_remote_service_binding(
            self._conn, name, service=service, certificate=certificate, anonymous=anonymous
        )
        waits.wake_for_security(self._conn, service)

    def alter_remote_service_binding(
        self, name: str, *, certificate: str | None = None, anonymous: bool | None = None
    ) -> None:
        """ALTER REMOTE SERVICE BINDING: another certificate (a renewed one) or anonymity."""
        store.alter_remote_service_binding(
            self._conn, name, certificate=certificate, anonymous=anonymous
        )
        waits.wake_for_security(self._conn)

    def drop_remote_service_binding(self, name: str) -> None:
        """DROP REMOTE SERVICE BINDING."""
        store.drop_remote_service_binding(self._conn, name)
