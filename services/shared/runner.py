"""How every service process lives: connect, set up JetStream, register as a
NATS micro service, run until SIGTERM, SIGINT or SIGHUP, then drain and exit. Each
time NATS comes back the JetStream layout is made sure of again, and the
service's `reconnected()` makes again what it keeps in the server.

A service is any object with `start()`, `stop()`, `status()`, `endpoints()`
and `reconnected()`; the runner registers its request/reply endpoints and a
`<name>.status` endpoint answering `status()` as one micro service, so
`nats micro ls`, `nats micro stats` and `$SRV.PING` find every process.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import signal
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import structlog
from nats.aio.client import Client as NATS
from nats.errors import ConnectionClosedError, ConnectionReconnectingError
from nats.micro import add_service
from nats.micro.request import Request
from nats.micro.service import Service
from pydantic import ValidationError

from schemas import subjects
from services.shared import metrics
from services.shared.bus import Bus, connect, round_trip
from services.shared.jetstream import ensure_layout
from services.shared.logging import configure_logging
from services.shared.reconnects import Reconnects, cancel_until_done
from services.shared.settings import ServiceSettings, shown_url

VERSION = "0.1.0"
SHUTDOWN_TIMEOUT_S = 10.0
# Allocations between two young-generation garbage collections (default 700).
GC_THRESHOLD = 50_000
log = structlog.get_logger()


class Component(Protocol):
    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def status(self) -> dict[str, Any]: ...

    def endpoints(self) -> list[Endpoint]: ...

    async def reconnected(self) -> None:
        """NATS is back, its JetStream layout made sure of again: make again
        what this part keeps in the server (consumers, followers, watchers)."""
        ...


# What a service does to the JetStream layout when it starts and when NATS
# comes back. Its owner, the generator, makes what is missing, moves replicas
# and sets the lock lease; the gateway and the decider make what is missing
# (so any may start first) and change nothing; the tools make nothing. Each
# service's NATS user is allowed just that (nats-users.conf).
LayoutRole = Literal["owner", "make_missing", "none"]


@dataclass(frozen=True)
class Endpoint:
    name: str
    subject: str
    handler: Callable[[Request], Awaitable[None]]


async def serve(
    name: str,
    settings: ServiceSettings,
    build: Callable[[Bus], Awaitable[Component]],
    description: str,
    lock_lease_s: float | None = None,
    layout: LayoutRole = "make_missing",
) -> None:
    configure_logging(name, settings.log_level, settings.log_format)
    stop = _stop_on_signals()
    reconnects = Reconnects()
    connecting = asyncio.create_task(connect(
        settings.nats_url, name, settings.nats_connect_timeout_s, reconnects.on_reconnect,
        settings.nats_options()))
    stopping = asyncio.create_task(stop.wait())
    await asyncio.wait({connecting, stopping}, return_when=asyncio.FIRST_COMPLETED)
    if not connecting.done():  # asked to stop before NATS ever answered
        connecting.cancel()
        return
    stopping.cancel()
    nc = connecting.result()
    metrics.watch_connection(nc, name)
    bus = Bus(nc, name, settings.jetstream_replicas)

    async def make_layout() -> None:
        await _make_layout(bus, layout, lock_lease_s, settings.jetstream_replicas)

    await make_layout()
    reconnects.add(make_layout)
    component = await build(bus)
    await component.start()
    reconnects.add(component.reconnected)
    micro = await _register(nc, name, description, component)
    metrics.serve_on(settings.metrics_port, settings.metrics_host)
    await _log_started(nc, settings)
    await stop.wait()
    log.info("service_stopping")
    await reconnects.stop()
    await _stop(component, micro, nc)
    log.info("service_stopped")


async def _log_started(nc: NATS, settings: ServiceSettings) -> None:
    """Once its subscriptions have reached the server, so that a request sent
    on any connection after the line finds the service (subscribing only
    queues the command: a request that got there first met "no responders").
    NATS gone meanwhile: they are sent again on reconnection anyway."""
    with contextlib.suppress(Exception):
        await round_trip(nc)
    log.info("service_started", nats_url=shown_url(settings.nats_url),
             metrics_port=settings.metrics_port)


async def _make_layout(bus: Bus, role: LayoutRole, lock_lease_s: float | None,
                       replicas: int | None) -> None:
    if role == "none":
        return
    owner = role == "owner"
    await ensure_layout(bus.js, lock_lease_s if owner else None, replicas,
                        move_replicas=owner)


async def _register(nc: NATS, name: str, description: str, component: Component) -> Service:
    """One micro service: the component's endpoints and `<name>.status`."""
    # The host lets `services.shared.healthcheck` find this very instance.
    micro = await add_service(nc, name=name, version=VERSION, description=description,
                              metadata={"host": socket.gethostname()})

    async def status(request: Request) -> None:
        await request.respond(json.dumps(component.status()).encode())

    await micro.add_endpoint(name=subjects.STATUS_SUFFIX, subject=subjects.service_status(name),
                             handler=status)
    for endpoint in component.endpoints():
        await micro.add_endpoint(name=endpoint.name, subject=endpoint.subject,
                                 handler=endpoint.handler)
    return micro


async def _stop(component: Component, micro: Service, nc: NATS) -> None:
    """Stop and drain, bounded: a process never lingers when NATS is gone or
    a handler hangs. NATS away is said once, whichever way it shows."""
    try:
        await asyncio.wait_for(_shut_down(component, micro, nc), SHUTDOWN_TIMEOUT_S)
        return
    except (ConnectionReconnectingError, ConnectionClosedError):
        # From drain(): nothing can be drained into a server that is away.
        log.warning("nats_unreachable_at_shutdown", unsent_dropped=True)
    except TimeoutError:
        if nc.is_connected:
            log.warning("shutdown_timed_out")
        else:  # work in hand waited on NATS until the bound
            log.warning("nats_unreachable_at_shutdown", unsent_dropped=True, timed_out=True)
    await _close(nc)


async def _shut_down(component: Component, micro: Service, nc: NATS) -> None:
    await component.stop()
    await micro.stop()
    await nc.drain()


async def _close(nc: NATS) -> None:
    """Close, dropping first what waits to be sent while a reconnect is under
    way: nats-py would write it into the lost connection's closed socket, and
    raise instead of closing."""
    if not nc.is_connected:
        nc._pending = []
        nc._pending_data_size = 0
    await nc.close()
    await _reconnecting_ended(nc)


async def _reconnecting_ended(nc: NATS) -> None:
    """nats-py's reconnect loop can miss its cancel (`cancel_until_done`) and
    go on after the close, keeping the process from ever exiting."""
    task = nc._reconnection_task
    if task is not None and not await cancel_until_done(task):
        log.warning("nats_reconnect_loop_not_ended")


def _stop_on_signals() -> asyncio.Event:
    """SIGHUP too: the terminal `make run` ran in was closed. The launcher
    then stops everything in order, and a service must drain, not die."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        loop.add_signal_handler(sig, stop.set)
    return stop


def main(coro: Awaitable[None]) -> None:
    _collect_garbage_less_often()
    try:
        with (contextlib.suppress(KeyboardInterrupt),
              asyncio.Runner(loop_factory=_loop_factory()) as runner):
            runner.run(coro)  # type: ignore[arg-type]
    except ValidationError as err:
        if not err.title.endswith("Settings"):
            raise  # a bug, with its traceback
        raise SystemExit(settings_refused(err)) from None


def settings_refused(err: ValidationError) -> str:
    """What a person reads when a setting is wrong: each one named as the
    environment names it, with what was given and what is wanted, and no
    traceback (a supervisor starting the service again repeats it)."""
    lines = [f"{err.title}: not started, {err.error_count()} setting(s) not valid:"]
    for error in err.errors(include_url=False):
        name = "_".join(str(part) for part in error["loc"]).upper()
        given = "(hidden)" if _secret(name) else repr(error.get("input"))[:80]
        lines.append(f"  {name}={given}: {error['msg']}")
    return "\n".join(lines)


def _secret(name: str) -> bool:
    """A token or password refused is not echoed: the line goes to a
    terminal, and to any log that keeps a service's output."""
    return any(word in name for word in ("TOKEN", "PASSWORD", "SECRET", "CREDENTIALS"))


def _collect_garbage_less_often() -> None:
    """Every message builds and drops many small objects (pydantic models,
    dicts); with the default threshold of 700 the cycle collector runs every
    few messages. Reference counting frees nearly all of them anyway."""
    gc.freeze()  # what is loaded at start-up stays: never scan it again
    gc.set_threshold(GC_THRESHOLD, *gc.get_threshold()[1:])


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop where it is installed (less CPU per message moved); else
    asyncio's own loop."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop
