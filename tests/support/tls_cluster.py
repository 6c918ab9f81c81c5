"""A private PostgreSQL cluster that accepts only TLS connections, for the TLS tests.

It is a throw-away cluster of its own (``initdb`` in a temporary directory, a free port on
127.0.0.1), never the shared test server: its ``pg_hba.conf`` has ``hostssl`` lines only (and
``local`` for the Unix socket that sets it up), and its certificate is signed by a CA made for
the run. ``localhost`` and ``127.0.0.1`` are both in the certificate, so ``sslmode=verify-full``
works with either. A second CA that signed nothing stands for the wrong one.

As root (the CI), ``initdb`` and ``pg_ctl`` run as the ``postgres`` OS user (``runuser``): the
server refuses to run as root. The server binaries are Debian's ``postgresql`` package; without
them :func:`server_bindir` fails the test run with what to install (never a skip).
"""

from __future__ import annotations

import datetime
import glob
import ipaddress
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import psycopg
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

#: The database the cluster is created with, besides ``postgres``.
DATABASE = "broker_tls"
#: The cluster's superuser (no password: ``trust`` over TLS).
SUPERUSER = "postgres"
#: The OS user that runs the server when the tests run as root.
SERVER_OS_USER = "postgres"


def server_bindir() -> Path:
    """The directory of ``initdb`` and ``pg_ctl``: ``pg_config --bindir``, else Debian's
    ``/usr/lib/postgresql/<newest>/bin``. Fails the test when there is none."""
    candidates: list[Path] = []
    pg_config = shutil.which("pg_config")
    if pg_config:
        done = subprocess.run([pg_config, "--bindir"], capture_output=True, text=True)
        if done.returncode == 0 and done.stdout.strip():
            candidates.append(Path(done.stdout.strip()))
    by_version = sorted(
        glob.glob("/usr/lib/postgresql/*/bin"), key=lambda p: int(Path(p).parent.name), reverse=True
    )
    candidates += [Path(p) for p in by_version]
    for bindir in candidates:
        if (bindir / "initdb").is_file() and (bindir / "pg_ctl").is_file():
            return bindir
    pytest.fail(
        "the TLS tests start a PostgreSQL cluster of their own and need the server binaries "
        "(initdb, pg_ctl): install Debian's `postgresql` package (`apt-get install postgresql`; "
        "`make postgres` does), looked in: " + (", ".join(map(str, candidates)) or "(nowhere)")
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- certificates ----------------------------------------------------------------------------


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def make_ca(common_name: str) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """A self-signed CA certificate and its key, valid for a day."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name))
        .issuer_name(_name(common_name))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return cert, key


def make_server_cert(
    ca: x509.Certificate, ca_key: ec.EllipticCurvePrivateKey
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """A server certificate for CN=localhost (DNS:localhost, IP:127.0.0.1) signed by ``ca``."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name("localhost"))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
        .add_extension(
            x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False
        )
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    return cert, key


# -- the cluster -----------------------------------------------------------------------------


@dataclass
class PrivateCluster:
    """A throw-away cluster of a test's own (the TLS one here, the frozen one of
    :mod:`support.frozen_cluster`): its files under ``root``, listening on ``port``."""

    root: Path
    bindir: Path
    port: int

    @property
    def data(self) -> Path:
        return self.root / "data"

    @property
    def log_file(self) -> Path:
        return self.root / "postgres.log"

    def server_log(self) -> str:
        try:
            return self.log_file.read_text(errors="replace")[-4000:]
        except OSError:
            return "(no server log)"

    def create_database(self, name: str) -> str:
        """Create database ``name`` (over the Unix socket, as the superuser); returns it."""
        with psycopg.connect(
            host=str(self.root), port=self.port, user=SUPERUSER, dbname="postgres", autocommit=True
        ) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return name


@dataclass
class TlsCluster(PrivateCluster):
    """A running TLS-only cluster: connect to ``host``:``port`` as :data:`SUPERUSER`, database
    :data:`DATABASE`, verifying the server with ``ca_file``; ``wrong_ca_file`` signed nothing."""

    ca_file: Path
    wrong_ca_file: Path
    host: str = "localhost"
    database: str = DATABASE
    user: str = SUPERUSER

    def stop(self) -> None:
        _run_as_server(
            [str(self.bindir / "pg_ctl"), "-D", str(self.data), "-m", "immediate", "-w", "stop"],
            check=False,
        )
        shutil.rmtree(self.root, ignore_errors=True)


def _as_root() -> bool:
    return os.geteuid() == 0


def _run_as_server(cmd: list[str], *, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run ``cmd`` as the server's OS user: this one, or :data:`SERVER_OS_USER` as root."""
    if _as_root():
        cmd = ["runuser", "-u", SERVER_OS_USER, "--", *cmd]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if check and done.returncode != 0:
        pytest.fail(
            f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}",
            pytrace=False,
        )
    return done


def _write(path: Path, data: bytes, mode: int, owner: pwd.struct_passwd | None) -> None:
    path.write_bytes(data)
    path.chmod(mode)
    if owner is not None:
        os.chown(path, owner.pw_uid, owner.pw_gid)


def server_owner(what: str) -> pwd.struct_passwd | None:
    """The OS user a private cluster runs as: None (this one), or :data:`SERVER_OS_USER` as
    root; ``what`` names the cluster in the failure when that user does not exist."""
    if not _as_root():
        return None
    try:
        return pwd.getpwnam(SERVER_OS_USER)
    except KeyError:
        pytest.fail(
            f"running as root, {what} runs as OS user {SERVER_OS_USER!r}, which does not "
            "exist: install Debian's `postgresql` package (it creates the user)"
        )


def private_root(prefix: str, owner: pwd.struct_passwd | None) -> Path:
    """A new directory for a private cluster. Not under pytest's tmp_path: that is private to
    the user running the tests (0700), and the server's user must reach its files."""
    root = Path(tempfile.mkdtemp(prefix=prefix))
    root.chmod(0o755)
    if owner is not None:
        os.chown(root, owner.pw_uid, owner.pw_gid)
    return root


def initdb(cluster: PrivateCluster, settings: str, hba: str) -> None:
    """Make ``cluster``'s data directory (trust, UTF8, C locale), with ``settings`` added to
    its postgresql.conf after the port, address and socket directory, and ``hba`` as its
    pg_hba.conf."""
    _run_as_server(
        [
            str(cluster.bindir / "initdb"),
            "-D",
            str(cluster.data),
            "-U",
            SUPERUSER,
            "--auth=trust",
            "--encoding=UTF8",
            "--locale=C",
            "--no-sync",
        ]
    )
    with (cluster.data / "postgresql.conf").open("a") as conf:
        conf.write(
            f"\nport = {cluster.port}\n"
            "listen_addresses = '127.0.0.1'\n"
            f"unix_socket_directories = '{cluster.root}'\n" + settings
        )
    (cluster.data / "pg_hba.conf").write_text(hba)


def start_server(cluster: PrivateCluster) -> subprocess.CompletedProcess[str]:
    """``pg_ctl start`` of ``cluster``, waiting up to 30 s; the caller checks how it went."""
    return _run_as_server(
        [
            str(cluster.bindir / "pg_ctl"),
            "-D",
            str(cluster.data),
            "-l",
            str(cluster.log_file),
            "-w",
            "-t",
            "30",
            "start",
        ],
        check=False,
    )


def start_tls_cluster() -> TlsCluster:
    """initdb a cluster in a new temporary directory, give it a certificate, allow only
    ``hostssl`` connections on 127.0.0.1, start it and create :data:`DATABASE`. Stop it with
    :meth:`TlsCluster.stop` (which also removes the directory)."""
    bindir = server_bindir()
    owner = server_owner("the TLS cluster")
    root = private_root("broker-tls-", owner)
    try:
        return _set_up(root, bindir, owner)
    except BaseException:
        shutil.rmtree(root, ignore_errors=True)
        raise


def _set_up(root: Path, bindir: Path, owner: pwd.struct_passwd | None) -> TlsCluster:

    ca, ca_key = make_ca("airflow-broker test CA")
    wrong_ca, _ = make_ca("airflow-broker wrong CA")
    server_cert, server_key = make_server_cert(ca, ca_key)
    pem = serialization.Encoding.PEM
    _write(root / "ca.crt", ca.public_bytes(pem), 0o644, owner)
    _write(root / "wrong-ca.crt", wrong_ca.public_bytes(pem), 0o644, owner)
    _write(root / "server.crt", server_cert.public_bytes(pem), 0o644, owner)
    _write(root / "server.key", _pem_key(server_key), 0o600, owner)

    cluster = TlsCluster(
        root=root,
        bindir=bindir,
        port=free_port(),
        ca_file=root / "ca.crt",
        wrong_ca_file=root / "wrong-ca.crt",
    )
    initdb(
        cluster,
        "# airflow-broker TLS test cluster\n"
        "ssl = on\n"
        f"ssl_cert_file = '{root / 'server.crt'}'\n"
        f"ssl_key_file = '{root / 'server.key'}'\n"
        "fsync = off\n"
        "max_connections = 40\n",
        "# TLS only over TCP: no `host` line\n"
        "local all all trust\n"
        "hostssl all all 127.0.0.1/32 trust\n",
    )
    started = start_server(cluster)
    if started.returncode != 0:
        log = cluster.server_log()
        cluster.stop()  # an immediate stop of whatever half started
        pytest.fail(
            f"the TLS test cluster did not start ({started.stdout}{started.stderr}):\n{log}",
            pytrace=False,
        )
    try:
        cluster.create_database(DATABASE)
    except BaseException:
        cluster.stop()
        raise
    return cluster
