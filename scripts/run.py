"""`make run`: the whole system on one workstation, stopped with Ctrl-C.

- NATS: the one at NATS_URL if given, else an embedded nats-server with
  JetStream storing under .data/nats (fsync on every write: history is the
  product's memory; see ARCHITECTURE.md).
- Ollama: the one at OLLAMA_HOST (default http://127.0.0.1:11434) if it
  answers, else the deterministic stand-in, announced loudly.
- The gateway, generator, compaction-decider and tools services.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DATA = Path(os.environ.get("DATA_DIR", ROOT / ".data"))
SERVICES = ("services.generator", "services.compaction_decider", "services.tools",
            "services.gateway")
STUB_PORT = int(os.environ.get("OLLAMA_STUB_PORT", "11435"))


def main() -> int:
    env = dict(os.environ)
    children: list[subprocess.Popen[bytes]] = []
    try:
        if not env.get("NATS_URL"):
            nats_port = int(env.get("NATS_PORT", "4222"))
            children.append(start_nats(nats_port))
            env["NATS_URL"] = f"nats://127.0.0.1:{nats_port}"
        env["OLLAMA_HOST"] = env.get("OLLAMA_HOST", "http://127.0.0.1:11434")
        if not answers(env["OLLAMA_HOST"]):
            children.append(start_stub(env["OLLAMA_HOST"]))
            env["OLLAMA_HOST"] = f"http://127.0.0.1:{STUB_PORT}"
        for module in SERVICES:
            children.append(subprocess.Popen([sys.executable, "-m", module], cwd=ROOT, env=env))
        host = env.get("GATEWAY_HOST", "127.0.0.1")
        port = env.get("GATEWAY_PORT", "8080")
        wait_for(f"http://{host}:{port}/healthz", 30)
        print(f"\n  Chat is ready: http://{host}:{port}/   (Ctrl-C stops everything)\n",
              flush=True)
        while all(child.poll() is None for child in children):
            time.sleep(0.5)
        print("a process exited; stopping the rest", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        stop(children)


def start_nats(port: int) -> subprocess.Popen[bytes]:
    store = DATA / "nats"
    store.mkdir(parents=True, exist_ok=True)
    config = DATA / "nats.conf"
    config.write_text(
        f"listen: 127.0.0.1:{port}\n"
        "max_payload: 8MB\n"
        f'jetstream {{ store_dir: "{store}", sync_interval: always }}\n'
    )
    server = Path(sys.executable).parent / "nats-server"
    proc = subprocess.Popen([str(server), "-c", str(config)], cwd=ROOT)
    wait_for_port(port, 10)
    return proc


def start_stub(wanted: str) -> subprocess.Popen[bytes]:
    banner = "!" * 72
    print(f"\n{banner}\n  No Ollama answers at {wanted}.\n"
          f"  Starting the DETERMINISTIC STAND-IN on port {STUB_PORT}: replies are canned,\n"
          f"  not a real model. Start Ollama (or set OLLAMA_HOST) for real answers.\n{banner}\n",
          file=sys.stderr, flush=True)
    proc = subprocess.Popen([sys.executable, "-m", "scripts.ollama_stub", "--port",
                             str(STUB_PORT)], cwd=ROOT)
    wait_for(f"http://127.0.0.1:{STUB_PORT}/api/version", 10)
    return proc


def answers(ollama_url: str) -> bool:
    return answers_http(f"{ollama_url.rstrip('/')}/api/version")


def wait_for(url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if answers_http(url):
            return
        time.sleep(0.2)
    raise SystemExit(f"{url} did not answer within {timeout_s} s")


def answers_http(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as response:
            return bool(response.status == 200)
    except OSError:
        return False


def wait_for_port(port: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), 0.2):
                return
        except OSError:
            time.sleep(0.1)
    raise SystemExit(f"nats-server did not listen on {port} within {timeout_s} s")


def stop(children: list[subprocess.Popen[bytes]]) -> None:
    # One at a time, newest first: services drain while NATS is still up.
    for child in reversed(children):
        if child.poll() is None:
            child.send_signal(signal.SIGTERM)
        try:
            child.wait(15)
        except subprocess.TimeoutExpired:
            child.kill()


if __name__ == "__main__":
    raise SystemExit(main())
