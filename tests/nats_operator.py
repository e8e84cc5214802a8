"""A NATS operator of the tests' own, as `nsc` would set one up: an operator
key, a system account and one account of users, their JWTs signed in turn,
and a creds file (a user's JWT and seed) for a server in operator mode."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import time
from typing import Any

import nkeys

NO_LIMIT = -1


def new_keys(prefix: int) -> nkeys.KeyPair:
    return nkeys.from_seed(nkeys.encode_seed(os.urandom(32), prefix))


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def signed_jwt(claims: dict[str, Any], signer: nkeys.KeyPair) -> str:
    """A NATS JWT: ed25519 over header and claims, by the issuer's key."""
    header = _b64(json.dumps({"typ": "JWT", "alg": "ed25519-nkey"}).encode())
    claims = {"iat": int(time.time()), **claims}
    digest = hashlib.sha256(json.dumps(claims, sort_keys=True).encode()).digest()
    claims["jti"] = base64.b32encode(digest).decode().rstrip("=")
    body = _b64(json.dumps(claims).encode())
    return f"{header}.{body}.{_b64(signer.sign(f'{header}.{body}'.encode()))}"


class Operator:
    def __init__(self) -> None:
        self.keys = new_keys(nkeys.PREFIX_BYTE_OPERATOR)
        self.system = new_keys(nkeys.PREFIX_BYTE_ACCOUNT)
        self.account = new_keys(nkeys.PREFIX_BYTE_ACCOUNT)

    def _claims(self, subject: nkeys.KeyPair, name: str, nats: dict[str, Any]
                ) -> dict[str, Any]:
        return {"iss": self.keys.public_key.decode(), "sub": subject.public_key.decode(),
                "name": name, "nats": {"version": 2, **nats}}

    def server_config(self) -> str:
        """The lines that put a server in operator mode, accounts preloaded."""
        operator_jwt = signed_jwt(self._claims(self.keys, "tests", {"type": "operator"}),
                                  self.keys)
        system_jwt = signed_jwt(self._claims(self.system, "SYS", {"type": "account"}),
                                self.keys)
        limits = {"subs": NO_LIMIT, "conn": NO_LIMIT, "data": NO_LIMIT,
                  "payload": NO_LIMIT, "wildcards": True}
        account_jwt = signed_jwt(self._claims(self.account, "chat", {
            "type": "account", "limits": limits}), self.keys)
        system, account = (k.public_key.decode() for k in (self.system, self.account))
        return (f'operator: "{operator_jwt}"\nsystem_account: {system}\nresolver: MEMORY\n'
                f'resolver_preload: {{ {system}: "{system_jwt}", {account}: "{account_jwt}" }}')

    def user_creds(self, name: str) -> str:
        """A creds file for a new user of the account, allowed everything."""
        user = new_keys(nkeys.PREFIX_BYTE_USER)
        user_jwt = signed_jwt({"iss": self.account.public_key.decode(),
                               "sub": user.public_key.decode(), "name": name,
                               "nats": {"type": "user", "version": 2, "subs": NO_LIMIT,
                                        "data": NO_LIMIT, "payload": NO_LIMIT}},
                              self.account)
        return (f"-----BEGIN NATS USER JWT-----\n{user_jwt}\n------END NATS USER JWT------\n\n"
                f"-----BEGIN USER NKEY SEED-----\n{user.seed.decode()}\n"
                "------END USER NKEY SEED------\n")
