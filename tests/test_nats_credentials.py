"""A service proves who it is to NATS with the credentials its settings name:
a token, TLS with a client certificate, or a creds file on a server in
operator mode, each against a real nats-server that demands it (user and
password, in NATS_URL or in NATS_USER/NATS_PASSWORD, are shown by
tests/test_least_privilege.py)."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.shared.nats_auth import connect_options
from services.shared.settings import ServiceSettings
from tests.nats_operator import Operator
from tests.nats_server import running_nats
from tests.processes import ServiceProcess

TOKEN = "a-token-only-the-services-know"


def service(url: str, **credentials: str) -> ServiceProcess:
    """The tools service: it needs nothing but NATS to start."""
    return ServiceProcess("services.tools", {"NATS_URL": url, "NATS_CONNECT_TIMEOUT_S": "1",
                                             **credentials})


def refused_then_admitted(url: str, wrong: dict[str, str], right: dict[str, str],
                          said: str) -> None:
    refused = service(url, **wrong)
    try:
        refused.start(ready=said)  # it says why, and tries again
    finally:
        refused.stop()
    assert "service_started" not in refused.log()
    admitted = service(url, **right).start()
    admitted.stop()


def test_a_token_gets_a_service_in() -> None:
    with running_nats(f'authorization {{ token: "{TOKEN}" }}') as server:
        refused_then_admitted(server.url, {"NATS_TOKEN": "wrong"}, {"NATS_TOKEN": TOKEN},
                              '"nats_credentials_refused"')


@pytest.fixture
def certificates(tmp_path: Path) -> Iterator[Path]:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, all
    signed by it (openssl, as an operator would make them)."""
    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=tmp_path, check=True, capture_output=True)

    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=test-ca",
            "-keyout", "ca.key", "-out", "ca.pem")
    for name, extension in (("server", "subjectAltName=IP:127.0.0.1"),
                            ("client", "extendedKeyUsage=clientAuth")):
        openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}",
                "-keyout", f"{name}.key", "-out", f"{name}.csr")
        (tmp_path / f"{name}.ext").write_text(extension + "\n")
        openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
                "-CAcreateserial", "-days", "2", "-extfile", f"{name}.ext",
                "-out", f"{name}.pem")
    yield tmp_path


def test_tls_with_a_client_certificate_gets_a_service_in(certificates: Path) -> None:
    tls = (f'tls {{ cert_file: "{certificates}/server.pem", key_file: "{certificates}/server.key",'
           f' ca_file: "{certificates}/ca.pem", verify: true }}')
    trusted_ca = {"NATS_TLS_CA": str(certificates / "ca.pem")}
    with running_nats(tls) as server:
        refused_then_admitted(server.url, trusted_ca, {
            **trusted_ca, "NATS_TLS_CERT": str(certificates / "client.pem"),
            "NATS_TLS_KEY": str(certificates / "client.key")}, '"nats_tls_failed"')


def test_a_creds_file_gets_a_service_in(tmp_path: Path) -> None:
    operator = Operator()
    creds = tmp_path / "tools.creds"
    creds.write_text(operator.user_creds("tools"))
    with running_nats(operator.server_config()) as server:
        refused_then_admitted(server.url, {}, {"NATS_CREDS": str(creds)},
                              '"nats_credentials_refused"')


def test_each_credential_setting_becomes_its_connect_option(tmp_path: Path) -> None:
    creds = tmp_path / "service.creds"
    settings = ServiceSettings(nats_user="gateway", nats_password="pw", nats_token="tk",
                               nats_creds=str(creds))
    options = settings.nats_options()
    assert (options["user"], options["password"], options["token"]) == ("gateway", "pw", "tk")
    assert options["user_credentials"] == str(creds)
    assert "tls" not in options
    assert connect_options({"NATS_USER": "", "NATS_TOKEN": None}) == {}
    assert "pw" not in repr(settings) and "tk" not in repr(settings)
