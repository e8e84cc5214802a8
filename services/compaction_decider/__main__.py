"""`python -m services.compaction_decider`"""

from services.compaction_decider.service import Decider
from services.compaction_decider.settings import DeciderSettings
from services.shared.bus import Bus
from services.shared.runner import main, serve


async def _run() -> None:
    settings = DeciderSettings()

    async def _build(bus: Bus) -> Decider:
        return Decider(bus, settings)

    await serve("compaction-decider", settings, _build,
                "Decides from real token counts when a session must be compacted")


if __name__ == "__main__":
    main(_run())
