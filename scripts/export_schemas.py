"""Write the JSON Schema of every message into schemas/json/ (or check them).

    python scripts/export_schemas.py          # rewrite the files
    python scripts/export_schemas.py --check  # exit 1 if any file is stale
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from schemas.registry import json_schemas

OUT_DIR = Path(__file__).resolve().parent.parent / "schemas" / "json"


def rendered() -> dict[str, str]:
    return {
        name: json.dumps(schema, indent=2, sort_keys=True) + "\n"
        for name, schema in json_schemas().items()
    }


def stale_files(out_dir: Path = OUT_DIR) -> list[str]:
    expected = rendered()
    stale = [n for n, text in expected.items() if _read(out_dir / n) != text]
    extra = [p.name for p in out_dir.glob("*.json") if p.name not in expected]
    return sorted(stale + extra)


def _read(path: Path) -> str | None:
    return path.read_text() if path.exists() else None


def write(out_dir: Path = OUT_DIR) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in out_dir.glob("*.json"):
        old.unlink()
    for name, text in rendered().items():
        (out_dir / name).write_text(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail if the files are stale")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_files()
        if stale:
            print("stale JSON Schema files: " + ", ".join(stale), file=sys.stderr)
            print("run: python scripts/export_schemas.py", file=sys.stderr)
            return 1
        return 0
    write()
    print(f"wrote {len(rendered())} schema files to {OUT_DIR}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
