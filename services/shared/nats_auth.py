"""How a process proves who it is to NATS: the credential settings
(`NATS_USER`/`NATS_PASSWORD`, `NATS_TOKEN`, `NATS_CREDS`, `NATS_TLS_*`)
turned into nats-py's connect options. User and password may also sit in
`NATS_URL` itself (`nats://user:password@host:4222`), which nats-py reads.

No pydantic here: the container healthcheck reads the same variables
straight from the environment and must start quickly."""

from __future__ import annotations

import ssl
from collections.abc import Mapping
from typing import Any

# Setting names, as environment variables.
CREDENTIALS = ("NATS_USER", "NATS_PASSWORD", "NATS_TOKEN", "NATS_CREDS",
               "NATS_TLS_CA", "NATS_TLS_CERT", "NATS_TLS_KEY")


def inbox_prefix(service: str) -> str:
    """Where the replies to `service`'s requests arrive: a prefix of its own
    (`_INBOX_gateway.…`), so that nats-users.conf can let each service read
    only its own replies. A replacement service connecting as one of those
    users uses the same prefix."""
    return f"_INBOX_{service}"


def connect_options(values: Mapping[str, str | None]) -> dict[str, Any]:
    """nats-py keyword arguments for the credentials `values` names (keys
    as in CREDENTIALS; missing or empty ones are not set)."""
    given = {name: value for name, value in values.items() if value}
    options: dict[str, Any] = {}
    if "NATS_USER" in given:
        options["user"] = given["NATS_USER"]
        options["password"] = given.get("NATS_PASSWORD", "")
    if "NATS_TOKEN" in given:
        options["token"] = given["NATS_TOKEN"]
    if "NATS_CREDS" in given:
        options["user_credentials"] = given["NATS_CREDS"]
    tls = tls_context(given.get("NATS_TLS_CA"), given.get("NATS_TLS_CERT"),
                      given.get("NATS_TLS_KEY"))
    if tls is not None:
        options["tls"] = tls
    return options


def tls_context(ca: str | None, cert: str | None, key: str | None) -> ssl.SSLContext | None:
    """TLS when a CA (to trust the server) or a client certificate is given:
    the server's certificate is always verified, against the CA or, without
    one, the system's roots."""
    if not (ca or cert):
        return None
    context = ssl.create_default_context(cafile=ca)
    if cert:
        context.load_cert_chain(cert, key)
    return context
