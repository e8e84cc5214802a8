"""compose.yaml driven through docker-compose on a real Docker engine, with
images built locally (no registry needed): the Debian base image from
scripts/docker_base.sh, the project image from the Dockerfile with wheels
made by the host's pip, and that same image as the NATS server."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

from scripts.nats_passwords import PASSWORD_VARIABLES, new_password
from tests.nats_server import free_port

ROOT = Path(__file__).resolve().parents[1]
BASE_IMAGE = os.environ.get("BASE_IMAGE", "compacting-chat/debian-python:bookworm")
IMAGE = "compacting-chat:compose-test"


def why_docker_cannot_run() -> str | None:
    """None when a Docker engine answers and docker-compose is installed."""
    for tool in ("docker", "docker-compose"):
        if not shutil.which(tool):
            return f"{tool} is not installed"
    info = subprocess.run(["docker", "info"], capture_output=True, text=True, timeout=30)
    if info.returncode != 0:
        return f"no Docker engine answers: {info.stderr.strip()[:200]}"
    return None


def prepare_images() -> None:
    """The base image (cached by the engine) and the wheels the build installs."""
    subprocess.run([str(ROOT / "scripts" / "docker_base.sh")], check=True,
                   env={**os.environ, "BASE_IMAGE": BASE_IMAGE})
    wheels = ROOT / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--wheel-dir",
                    str(wheels), str(ROOT), "setuptools"], check=True,
                   stderr=subprocess.DEVNULL)  # pip's warnings on the host's own indexes
    for own in wheels.glob("compacting_chat-*.whl"):  # built from the sources instead
        own.unlink()


class Stack:
    """One compose project of the test's own, on ports of its own."""

    def __init__(self, env: dict[str, str]) -> None:
        self.project = f"chattest{uuid.uuid4().hex[:8]}"
        self.gateway_port, self.nats_port, self.stand_in_port = (free_port() for _ in range(3))
        self.env = {
            **os.environ,
            "BASE_IMAGE": BASE_IMAGE, "WHEELS_ONLY": "1", "CHAT_IMAGE": IMAGE,
            "NATS_IMAGE": IMAGE, "CHAT_OLLAMA_HOST": "http://ollama:11434",
            "MODEL": "stub-model",
            "GATEWAY_PUBLISHED_PORT": str(self.gateway_port),
            "NATS_PUBLISHED_PORT": str(self.nats_port),
            "NATS_MONITOR_PUBLISHED_PORT": str(free_port()),
            "STAND_IN_PUBLISHED_PORT": str(self.stand_in_port),
            # What `make .env` writes, made afresh for this project.
            **{variable: new_password() for variable in PASSWORD_VARIABLES.values()},
            **env,
        }
        self.base_url = f"http://127.0.0.1:{self.gateway_port}"
        # As the operator: the tests look into streams and buckets.
        admin = self.env["NATS_ADMIN_PASSWORD"]
        self.nats_url = f"nats://admin:{admin}@127.0.0.1:{self.nats_port}"
        self.stand_in_url = f"http://127.0.0.1:{self.stand_in_port}"

    def compose(self, *args: str, timeout_s: float = 300) -> str:
        done = subprocess.run(["docker-compose", "-p", self.project, "--profile", "stand-in",
                               *args], cwd=ROOT, env=self.env, capture_output=True,
                              text=True, timeout=timeout_s)
        if done.returncode != 0:
            raise RuntimeError(f"docker-compose {' '.join(args)}:\n{done.stderr[-3000:]}")
        return done.stdout

    def containers(self, service: str | None = None) -> list[str]:
        return self.compose("ps", "-q", *([service] if service else [])).split()

    def inspect(self, container: str) -> dict[str, object]:
        out = subprocess.run(["docker", "inspect", container], capture_output=True,
                             text=True, check=True).stdout
        return dict(json.loads(out)[0])

    def health(self) -> dict[str, str]:
        """Each running container's health status, by name."""
        statuses = {}
        for container in self.containers():
            info = self.inspect(container)
            state = info["State"]
            assert isinstance(state, dict)
            if state["Running"]:
                health = state.get("Health") or {}
                statuses[str(info["Name"]).lstrip("/")] = health.get("Status", "none")
        return statuses

    def wait_healthy(self, timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            statuses = self.health()
            if statuses and all(s == "healthy" for s in statuses.values()):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"not all healthy after {timeout_s} s: {statuses}\n"
                                   + self.compose("logs", "--tail", "30"))
            time.sleep(1)

    def volumes(self) -> list[str]:
        out = subprocess.run(["docker", "volume", "ls", "-q", "--filter",
                              f"label=com.docker.compose.project={self.project}"],
                             capture_output=True, text=True, check=True).stdout
        return out.split()
