"""``python -m scripts.ollama_stub``: run the stand-in."""

import sys

from .cli import main

sys.exit(main())
