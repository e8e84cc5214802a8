"""`make run`: the whole system on one workstation, stopped with Ctrl-C (or
SIGTERM, or the terminal closing).

- NATS: the one at NATS_URL if given (with the credentials the environment
  names), else an embedded nats-server with JetStream storing under
  .data/nats (fsync on every write: history is the product's memory; see
  ARCHITECTURE.md), on nats.conf's users: each service connects as its own,
  with passwords made on the first run and kept in .data/nats-passwords.env.
- Ollama: the one at OLLAMA_HOST (default http://127.0.0.1:11434; the short
  forms Ollama accepts, such as `127.0.0.1:11434`, too) if it answers, else
  the deterministic stand-in, announced loudly. A real one is asked whether
  it has MODEL (and COMPACTION_MODEL): if not, the launcher says how to pull
  it, and with PULL=1 (`make run PULL=1`) pulls it, showing its progress.
- The gateway, generator, compaction-decider and tools services. With
  GATEWAY_TOKEN=auto the gateway gets a token (made once, kept in .data/),
  and the address printed carries it for the page's first visit.

Every child runs in a session of its own, so a Ctrl-C reaches only the
launcher, which stops them one at a time: the gateway first, the tools after
the generator, NATS last. Until then, any of them that exits is started
again (scripts/supervision.py).
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

from ollama._client import _parse_host as ollama_url  # the client's own reading
from pydantic import ValidationError
from tqdm import tqdm

from scripts.nats_passwords import kept_passwords, service_credentials
from scripts.supervision import Child, StopSignals, keep_running, stop, tied_to_launcher
from services.gateway.settings import GatewaySettings
from services.shared.runner import settings_refused

ROOT = Path(__file__).resolve().parent.parent
DATA = Path(os.environ.get("DATA_DIR", ROOT / ".data"))
SERVICES = ("services.generator", "services.compaction_decider", "services.tools",
            "services.gateway")
# Started in this order, stopped in the reverse one: the gateway stops taking
# messages first, and the tools outlive the generator's last turns.
START_ORDER = ("services.tools", "services.generator", "services.compaction_decider",
               "services.gateway")
NATS_CONFIG = ROOT / "nats.conf"
NATS_PASSWORDS = DATA / "nats-passwords.env"


def ports_from(name: str, default: str) -> tuple[int, ...]:
    """The port numbers the variable `name` gives (comma-separated), or a
    one-line refusal naming it."""
    given = os.environ.get(name) or default
    try:
        ports = tuple(int(part) for part in given.split(","))
    except ValueError:
        ports = ()
    if not ports or not all(0 < port < 65536 for port in ports):
        raise SystemExit(f"{name}={given!r}: not a port number from 1 to 65535"
                         + (" (several: separated by commas)" if "," in default else ""))
    return ports


# Read at import, so a value that is not a port stops the launcher before it starts anything.
NATS_PORT = ports_from("NATS_PORT", "4222")[0]
STUB_PORT = ports_from("OLLAMA_STUB_PORT", "11435")[0]


def gateway_address() -> tuple[str, int]:
    """Where the gateway will listen, read as the gateway reads it: from the
    environment in any case, then CONFIG_FILE, then its default. (Read from
    GATEWAY_PORT alone, a port set otherwise was waited for on 8080.)"""
    ports_from("GATEWAY_PORT", "8080")  # the common mistake, in the same words as the others
    try:
        settings = GatewaySettings()
    except ValidationError as err:
        raise SystemExit(settings_refused(err)) from None
    if settings.gateway_port == 0:
        raise SystemExit("GATEWAY_PORT=0: the page needs a port known before the gateway starts")
    return settings.gateway_host, settings.gateway_port


GATEWAY_HOST, GATEWAY_PORT = gateway_address()
# /metrics of the services without an HTTP port of their own, in the order of
# SERVICES (generator, decider, tools); the gateway serves its own at /metrics.
METRICS_PORTS = ports_from("METRICS_PORTS", "9101,9102,9103")
STAND_IN = f"http://127.0.0.1:{STUB_PORT}"
# The generator's own default (services/generator/settings.py).
DEFAULT_MODEL = "llama3.2"
# A pull may stall for a while between two progress lines (verifying a large layer).
PULL_READ_TIMEOUT_S = 600


def main() -> int:
    signals = StopSignals()
    env = dict(os.environ)
    children: list[Child] = []
    try:
        passwords = None  # a NATS_URL given comes with the credentials env names
        if not env.get("NATS_URL"):
            passwords = kept_passwords(NATS_PASSWORDS)
            env["NATS_URL"] = embedded_nats(children, passwords)
        env["OLLAMA_HOST"] = ollama_or_stand_in(env.get("OLLAMA_HOST"), children)
        if env["OLLAMA_HOST"] != STAND_IN:  # the stand-in serves any name
            check_models(env["OLLAMA_HOST"], env)
        env["GATEWAY_TOKEN"] = gateway_token(env.get("GATEWAY_TOKEN", ""))
        url = start_services(env, children, passwords)
        page = with_token(url, env["GATEWAY_TOKEN"])
        print(f"\n  Chat is ready: {page}   (Ctrl-C stops everything)\n", flush=True)
        keep_running(children, signals)
    except KeyboardInterrupt:
        pass  # a stop signal while the services started
    finally:
        stop(children, signals)
    return 0


def gateway_token(wanted: str) -> str:
    """GATEWAY_TOKEN as given, or for `auto` the one made on the first such
    run and kept under DATA_DIR (mode 0600), so the page's cookie and the
    printed address stay good across runs."""
    if wanted != "auto":
        return wanted
    kept = DATA / "gateway-token"
    token = kept.read_text().strip() if kept.exists() else ""
    if not token:  # none yet, or a first run cut short left it empty: never no token
        DATA.mkdir(parents=True, exist_ok=True)
        token = secrets.token_urlsafe(32)
        written = kept.with_name(kept.name + ".new")
        written.touch(mode=0o600)
        written.chmod(0o600)
        written.write_text(token)
        written.replace(kept)  # whole or not at all
    return token


# Each starter adds what it starts to `children` before waiting for it, so
# that a start that times out still stops it.

def embedded_nats(children: list[Child], passwords: dict[str, str]) -> str:
    ensure_free(NATS_PORT, "NATS", "set NATS_URL to use that server, or NATS_PORT")
    children.append(Child("nats-server", partial(start_nats, NATS_PORT, passwords)))
    wait_for_port(NATS_PORT, 10, children[-1].proc)
    print(f"  NATS at nats://127.0.0.1:{NATS_PORT}; its users' passwords are in {NATS_PASSWORDS}"
          f" (`nats sub` as user admin)", flush=True)
    return f"nats://127.0.0.1:{NATS_PORT}"


def ollama_or_stand_in(wanted: str | None, children: list[Child]) -> str:
    """OLLAMA_HOST as the generator's client reads it, or the stand-in's address."""
    ollama = ollama_url(wanted)
    if answers(ollama):
        return ollama
    # Else a stand-in left over from an earlier run would answer in its place.
    ensure_free(STUB_PORT, "the Ollama stand-in",
                "stop what listens there, or set OLLAMA_STUB_PORT")
    children.append(Child("the stand-in", partial(start_stub, ollama)))
    wait_for(f"{STAND_IN}/api/version", 10, children[-1].proc)
    return STAND_IN


def wanted_models(env: dict[str, str]) -> list[str]:
    names = [env.get("MODEL") or env.get("model") or DEFAULT_MODEL]
    summariser = env.get("COMPACTION_MODEL") or env.get("compaction_model")
    return list(dict.fromkeys([*names, summariser] if summariser else names))


def check_models(ollama: str, env: dict[str, str]) -> None:
    """Say how to get each wanted model Ollama lacks; pull it when PULL=1."""
    pulling = env.get("PULL", "").lower() in ("1", "true", "yes")
    try:
        have = pulled_models(ollama)
    except (OSError, ValueError) as err:
        print(f"could not list Ollama's models ({err}); not checking MODEL", file=sys.stderr)
        return
    for model in wanted_models(env):
        if normalized(model) in have:
            continue
        if pulling:
            pull(ollama, model)
            continue
        print(f"\n  Ollama at {ollama} has no model {model!r}: every answer will fail "
              f"with model_not_found.\n  Pull it with `ollama pull {model}` (or "
              f"`make run PULL=1`), or pick another with MODEL=<name>.\n",
              file=sys.stderr, flush=True)


def normalized(model: str) -> str:
    """Ollama takes an untagged name for `:latest`."""
    return model if ":" in model.rsplit("/", 1)[-1] else f"{model}:latest"


def pulled_models(ollama: str) -> set[str]:
    with _DIRECT.open(f"{ollama.rstrip('/')}/api/tags", timeout=10) as response:
        listed = json.load(response).get("models") or []
    return {normalized(str(m.get("model") or m.get("name"))) for m in listed}


def pull(ollama: str, model: str) -> None:
    """`ollama pull` through the API, one progress bar per layer."""
    print(f"pulling {model} from {ollama}", file=sys.stderr, flush=True)
    bars: dict[str, tqdm[Any]] = {}
    try:
        for line in pull_progress(ollama, model):
            if "error" in line:
                raise SystemExit(f"pulling {model} failed: {line['error']}")
            show_progress(line, bars)
    finally:
        for bar in bars.values():
            bar.close()


def show_progress(line: dict[str, Any], bars: dict[str, tqdm[Any]]) -> None:
    digest, total = line.get("digest"), line.get("total")
    if not digest or not total:
        tqdm.write(str(line.get("status", "")), file=sys.stderr)
        return
    bar = bars.get(digest)
    if bar is None:
        bar = bars[digest] = tqdm(total=total, desc=str(line.get("status")), unit="B",
                                  unit_scale=True, file=sys.stderr)
    bar.update(max(0, int(line.get("completed") or 0) - bar.n))
    if bar.n >= total:
        bar.close()  # done: the status lines that follow print below it


def pull_progress(ollama: str, model: str) -> Iterator[dict[str, Any]]:
    request = urllib.request.Request(
        f"{ollama.rstrip('/')}/api/pull", method="POST",
        data=json.dumps({"model": model, "stream": True}).encode(),
        headers={"Content-Type": "application/json"})
    try:
        with _DIRECT.open(request, timeout=PULL_READ_TIMEOUT_S) as response:
            for raw in response:
                if raw.strip():
                    yield json.loads(raw)
    except urllib.error.HTTPError as err:
        yield json.loads(err.read() or b"{}") or {"error": f"HTTP {err.code}"}


def start_services(env: dict[str, str], children: list[Child],
                   passwords: dict[str, str] | None) -> str:
    """Start the four services; returns the page's address once it answers."""
    ensure_free(GATEWAY_PORT, "the gateway", "set GATEWAY_PORT to another")
    for metrics_port in METRICS_PORTS:
        ensure_free(metrics_port, "metrics", "set METRICS_PORTS to three others")
    envs = dict(zip(SERVICES, service_envs(env, passwords), strict=True))
    for module in START_ORDER:
        children.append(Child(module, partial(start_service, module, envs[module])))
    url = page_url(GATEWAY_HOST, str(GATEWAY_PORT))
    wait_for(f"{url}healthz", 30, children[-1].proc)
    print_metrics_addresses(url)
    return url


def start_service(module: str, env: dict[str, str]) -> subprocess.Popen[bytes]:
    # A session of its own: a terminal's Ctrl-C reaches the launcher alone,
    # which stops the services in order (the tools after the generator).
    return subprocess.Popen([sys.executable, "-m", module], cwd=ROOT, env=env,
                            start_new_session=True, preexec_fn=tied_to_launcher())


def with_token(url: str, token: str) -> str:
    """The page's address with its token, encoded: a base64 `+` read as a space
    was a wrong token."""
    return f"{url}?token={urllib.parse.quote(token, safe='')}" if token else url


def service_envs(env: dict[str, str], passwords: dict[str, str] | None
                 ) -> list[dict[str, str]]:
    """Each service's environment: its own METRICS_PORT (the gateway none) and,
    on the embedded server, its own NATS user."""
    ports = dict(zip(SERVICES, METRICS_PORTS, strict=False))
    envs = []
    for module in SERVICES:
        service_env = dict(env)
        # A METRICS_PORT in the caller's environment would have the gateway
        # take a port meant for another service.
        service_env.pop("METRICS_PORT", None)
        if module in ports:
            service_env["METRICS_PORT"] = str(ports[module])
        if passwords:
            service_env.update(service_credentials(module, passwords))
        envs.append(service_env)
    return envs


def print_metrics_addresses(page: str) -> None:
    lines = [f"    {module.rsplit('.', 1)[-1]:<20} http://127.0.0.1:{port}/metrics"
             for module, port in zip(SERVICES, METRICS_PORTS, strict=False)]
    lines.append(f"    {'gateway':<20} {page}metrics")
    print("\n  Prometheus metrics:\n" + "\n".join(lines), flush=True)


def start_nats(port: int, passwords: dict[str, str]) -> subprocess.Popen[bytes]:
    """nats-server on the repository's nats.conf, as compose runs it, but on
    loopback, on `port`, storing under DATA, without the monitoring port."""
    store = DATA / "nats"
    store.mkdir(parents=True, exist_ok=True)
    server = Path(sys.executable).parent / "nats-server"
    return subprocess.Popen([str(server), "-c", str(NATS_CONFIG), "-a", "127.0.0.1",
                             "-p", str(port), "-m", "0"], cwd=ROOT,
                            # Quoted: nats-server reads the value in its own
                            # language, where a space or a '#' ends it.
                            env={**os.environ, "NATS_STORE_DIR": json.dumps(str(store)),
                                 **passwords},
                            start_new_session=True, preexec_fn=tied_to_launcher())


def start_stub(wanted: str) -> subprocess.Popen[bytes]:
    banner = "!" * 72
    print(f"\n{banner}\n  No Ollama answers at {wanted}.\n"
          f"  Starting the DETERMINISTIC STAND-IN on port {STUB_PORT}: replies are canned,\n"
          f"  not a real model. Start Ollama (or set OLLAMA_HOST) for real answers.\n{banner}\n",
          file=sys.stderr, flush=True)
    return subprocess.Popen([sys.executable, "-m", "scripts.ollama_stub", "--port",
                             str(STUB_PORT)], cwd=ROOT, start_new_session=True,
                            preexec_fn=tied_to_launcher())


def page_url(host: str, port: str) -> str:
    """Where a browser on this machine finds the page."""
    if host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1"  # listening everywhere, loopback included
    return f"http://[{host}]:{port}/" if ":" in host else f"http://{host}:{port}/"


def answers(ollama: str) -> bool:
    return answers_http(f"{ollama.rstrip('/')}/api/version")


# Local probes never go through a proxy the environment names.
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def answers_http(url: str) -> bool:
    try:
        with _DIRECT.open(url, timeout=1) as response:
            return bool(response.status == 200)
    except (OSError, ValueError):
        return False


def wait_for(url: str, timeout_s: float, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if answers_http(url):
            return
        exited(proc)
        time.sleep(0.2)
    raise SystemExit(f"{url} did not answer within {timeout_s} s")


def wait_for_port(port: int, timeout_s: float, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        exited(proc)
        try:
            with socket.create_connection(("127.0.0.1", port), 0.2):
                return
        except OSError:
            time.sleep(0.1)
    raise SystemExit(f"nats-server did not listen on {port} within {timeout_s} s")


def exited(proc: subprocess.Popen[bytes]) -> None:
    """Stop waiting for a process that is gone."""
    if proc.poll() is not None:
        args = proc.args if isinstance(proc.args, list) else [proc.args]
        command = " ".join(str(arg) for arg in args)
        raise SystemExit(f"{command} exited with {proc.returncode} while starting")


def ensure_free(port: int, what: str, advice: str) -> None:
    """Refuse to start beside something that already listens on our port: the
    checks for readiness would take it for ours."""
    try:
        with socket.create_connection(("127.0.0.1", port), 0.2):
            pass
    except OSError:
        return
    raise SystemExit(f"port {port}, wanted for {what}, is in use; {advice}")


if __name__ == "__main__":
    raise SystemExit(main())
