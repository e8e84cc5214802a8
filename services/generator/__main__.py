"""`python -m services.generator`"""

from services.generator.service import Generator, build
from services.generator.settings import GeneratorSettings
from services.shared.bus import Bus
from services.shared.runner import main, serve


async def _run() -> None:
    settings = GeneratorSettings()

    async def _build(bus: Bus) -> Generator:
        return await build(bus, settings)

    await serve("generator", settings, _build,
                "Answers chat queries and executes compactions", settings.lock_lease_s,
                layout="owner")


if __name__ == "__main__":
    main(_run())
