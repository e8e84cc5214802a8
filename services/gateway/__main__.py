"""`python -m services.gateway`"""

from services.gateway.app import Gateway, build
from services.gateway.settings import GatewaySettings
from services.shared.bus import Bus
from services.shared.runner import main, serve


async def _run() -> None:
    settings = GatewaySettings()

    async def _build(bus: Bus) -> Gateway:
        return await build(bus, settings)

    await serve("gateway", settings, _build, "HTTP API and web page for the chat backend")


if __name__ == "__main__":
    main(_run())
