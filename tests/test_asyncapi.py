"""schemas/asyncapi.yaml: generated from schemas/, never stale, and whole:
every payload, every subject, every reference resolvable."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from schemas import subjects
from schemas.channels import CHANNELS
from schemas.registry import PAYLOADS
from scripts.export_asyncapi import OUT, main, rendered


def document() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load(OUT.read_text())
    return loaded


def resolve(doc: dict[str, Any], ref: str) -> Any:
    assert ref.startswith("#/"), ref
    node: Any = doc
    for part in ref[2:].split("/"):
        node = node[part]
    return node


def refs(node: Any) -> list[str]:
    if isinstance(node, dict):
        own = [node["$ref"]] if isinstance(node.get("$ref"), str) else []
        return own + [r for value in node.values() for r in refs(value)]
    if isinstance(node, list):
        return [r for value in node for r in refs(value)]
    return []


def test_the_committed_file_is_what_the_schemas_give() -> None:
    assert OUT.read_text() == rendered(), "run: python scripts/export_asyncapi.py"
    assert main(["--check"]) == 0


def test_it_is_asyncapi_3_with_every_payload_and_subject() -> None:
    doc = document()
    assert doc["asyncapi"].startswith("3.")
    assert {m["name"] for m in doc["components"]["messages"].values()} == {
        p.MESSAGE_TYPE for p in PAYLOADS}
    addresses = {c["address"].split(".{")[0] for c in doc["channels"].values()}
    assert addresses >= {subjects.QUERY_PREFIX, subjects.REPLY_PREFIX, subjects.TOKEN_PREFIX,
                         subjects.RESPONSE_GENERATION, subjects.COMPACTION_REQUEST,
                         subjects.COMPACTION_EVENT, subjects.COMPACTION_RESULT,
                         subjects.STATE_PREFIX, subjects.TOOL_PREFIX, subjects.ERROR_SUBJECT}


def test_every_channel_has_a_sender_and_a_receiver() -> None:
    ops = document()["operations"].values()
    for channel in CHANNELS:
        mine = [op for op in ops if op["channel"]["$ref"] == f"#/channels/{channel.name}"]
        assert {op["action"] for op in mine} == {"send", "receive"}, channel.name
        assert {op["tags"][0]["name"] for op in mine if op["action"] == "send"} == set(
            channel.senders)


def test_every_reference_resolves() -> None:
    doc = document()
    found = refs(doc)
    assert found
    for ref in found:
        assert resolve(doc, ref) is not None, ref


def test_a_stale_file_is_caught(tmp_path: Path) -> None:
    stale = tmp_path / "asyncapi.yaml"
    stale.write_text(rendered().replace("compaction.result", "compaction.done"))
    assert main(["--check", "--file", str(stale)]) == 1
    assert main(["--check", "--file", str(tmp_path / "missing.yaml")]) == 1
