"""`python -m services.tools`"""

from services.shared.bus import Bus
from services.shared.runner import main, serve
from services.shared.settings import ServiceSettings
from services.tools.service import ToolsService


async def _run() -> None:
    settings = ServiceSettings()

    async def _build(bus: Bus) -> ToolsService:
        return ToolsService(bus)

    await serve("tools", settings, _build, "Tools the model can call over NATS",
                layout="none")


if __name__ == "__main__":
    main(_run())
