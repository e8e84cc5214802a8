"""`python -m services.shared.healthcheck NAME`: exit 0 when the service NAME
running on this host (a container: its own hostname) is connected to NATS and
serving, else 1. Compose runs it as each service's healthcheck.

Every service announces its host in its NATS micro-service metadata; the
check pings all instances of NAME and waits for the one on this host, so a
healthy twin in another container cannot answer for a broken one here.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import sys

import nats
from nats.aio.msg import Msg
from nats.js.api import Header

from services.shared.nats_auth import connect_options, inbox_prefix

TIMEOUT_S = 3.0
# The server's status to a ping that no subscriber took.
NO_RESPONDERS = "503"


# What the ping found: the instance on this host, none of that name at all,
# or none on this host within the timeout.
HERE, NONE_CONNECTED, NOT_HERE = "here", "none connected", "not here"


def configured() -> dict[str, str]:
    """The settings as the service reads them: the environment, in any case,
    over the keys of the YAML file CONFIG_FILE names."""
    values: dict[str, str] = {}
    if os.environ.get("CONFIG_FILE"):
        from services.shared.settings import read_yaml_config  # only then: it is slow

        values = {key.upper(): str(value) for key, value in read_yaml_config().items()
                  if value is not None}
    values.update({key.upper(): value for key, value in os.environ.items()})
    return values


async def answers_here(name: str, host: str, settings: dict[str, str]) -> str:
    url = settings.get("NATS_URL", "nats://127.0.0.1:4222")
    servers = [part.strip() for part in url.split(",") if part.strip()]
    nc = await nats.connect(servers, connect_timeout=TIMEOUT_S, inbox_prefix=inbox_prefix(name),
                            allow_reconnect=False, max_reconnect_attempts=0,
                            error_cb=_quiet, **connect_options(settings))
    try:
        found: asyncio.Future[str] = asyncio.get_running_loop().create_future()

        async def on_ping(msg: Msg) -> None:
            if (msg.headers or {}).get(Header.STATUS) == NO_RESPONDERS:
                # No instance of NAME is connected at all: known now, not at the timeout.
                if not found.done():
                    found.set_result(NONE_CONNECTED)
                return
            metadata = json.loads(msg.data).get("metadata") or {}
            if metadata.get("host") == host and not found.done():
                found.set_result(HERE)

        inbox = nc.new_inbox()
        await nc.subscribe(inbox, cb=on_ping)
        await nc.publish(f"$SRV.PING.{name}", b"", reply=inbox)
        try:
            return await asyncio.wait_for(found, TIMEOUT_S)
        except TimeoutError:
            return NOT_HERE
    finally:
        await nc.close()


async def _quiet(err: Exception) -> None:
    """The client's own traceback would bury the one line said below."""


def main() -> int:
    if len(sys.argv) != 2:
        print("usage: python -m services.shared.healthcheck SERVICE_NAME", file=sys.stderr)
        return 2
    # From the environment alone: the settings' imports would double the
    # check's start-up time, which a loaded host makes exceed its timeout.
    try:
        # Bounded as a whole: the client's own connect may retry for long.
        found = asyncio.run(asyncio.wait_for(
            answers_here(sys.argv[1], socket.gethostname(), configured()), 2 * TIMEOUT_S))
    except Exception as err:  # NATS unreachable: unhealthy, said why
        print(f"unhealthy: {type(err).__name__}: {err}", file=sys.stderr)
        return 1
    if found != HERE:
        why = " (none is connected to NATS)" if found == NONE_CONNECTED else ""
        print(f"unhealthy: no {sys.argv[1]} on {socket.gethostname()} answers{why}",
              file=sys.stderr)
    return 0 if found == HERE else 1


if __name__ == "__main__":
    sys.exit(main())
