"""The passwords of the NATS users in nats-users.conf: made at random once,
kept in an env file of mode 0600 (never committed), read again after that.

`make run` keeps them in .data/nats-passwords.env; for compose,
`make .env` (or `python scripts/nats_passwords.py .env`) writes them into
.env, which `docker compose` reads.
"""

from __future__ import annotations

import secrets
import string
import sys
from pathlib import Path

# Each user of nats-users.conf and the variable its password comes from.
PASSWORD_VARIABLES = {
    "admin": "NATS_ADMIN_PASSWORD",
    "gateway": "NATS_GATEWAY_PASSWORD",
    "generator": "NATS_GENERATOR_PASSWORD",
    "compaction-decider": "NATS_DECIDER_PASSWORD",
    "tools": "NATS_TOOLS_PASSWORD",
}
# Not a user of nats-users.conf: what compose.cluster.yaml's nodes ask of each
# other on their route port, which no client may join without it.
ROUTE_PASSWORD_VARIABLE = "NATS_ROUTE_PASSWORD"
# The user each service module connects as.
SERVICE_USERS = {
    "services.gateway": "gateway",
    "services.generator": "generator",
    "services.compaction_decider": "compaction-decider",
    "services.tools": "tools",
}


def kept_passwords(path: Path) -> dict[str, str]:
    """The variables and passwords in `path`, made first if it is missing or
    lacks one (a line each, `NAME=value`, as compose's .env reads)."""
    found = read_env_file(path) if path.exists() else {}
    wanted = {variable: found.get(variable) or new_password()
              for variable in (*PASSWORD_VARIABLES.values(), ROUTE_PASSWORD_VARIABLE)}
    if wanted != {k: v for k, v in found.items() if k in wanted}:
        write_env_file(path, {**found, **wanted})
    return wanted


def new_password(length: int = 32) -> str:
    """Letters and digits, a letter first: nats-server reads a variable's value
    as a value of its own language, so one such as `-x1` or `12345` (taken for
    a number) would stop it from starting."""
    first = secrets.choice(string.ascii_letters)
    alphabet = string.ascii_letters + string.digits
    return first + "".join(secrets.choice(alphabet) for _ in range(length - 1))


def read_env_file(path: Path) -> dict[str, str]:
    pairs = (line.split("=", 1) for line in path.read_text().splitlines()
             if "=" in line and not line.lstrip().startswith("#"))
    return {name.strip(): value.strip() for name, value in pairs}


def write_env_file(path: Path, values: dict[str, str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch(mode=0o600)
    path.chmod(0o600)
    path.write_text("".join(f"{name}={value}\n" for name, value in values.items()))


def service_credentials(module: str, passwords: dict[str, str]) -> dict[str, str]:
    """NATS_USER and NATS_PASSWORD for the service `module`."""
    user = SERVICE_USERS[module]
    return {"NATS_USER": user, "NATS_PASSWORD": passwords[PASSWORD_VARIABLES[user]]}


def admin_options(kept: Path) -> dict[str, str]:
    """nats-py connect options for the admin user of `make run`'s server, when
    its passwords are kept at `kept`; none otherwise."""
    password = read_env_file(kept).get(PASSWORD_VARIABLES["admin"]) if kept.exists() else None
    return {"user": "admin", "password": password} if password else {}


if __name__ == "__main__":
    target = Path(sys.argv[1] if len(sys.argv) > 1 else ".env")
    kept_passwords(target)
    print(f"NATS passwords are in {target} (mode 0600); keep it out of version control.")
