"""The gateway's web page, checked without a browser: its files reference each
other, load nothing from outside, and put data into the page only as text."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest

from services.gateway.idempotency import query_id_for

STATIC = Path(__file__).resolve().parent.parent / "services" / "gateway" / "static"

LIVE_EVENT_TYPES = (
    "generator.state",
    "response.generation",
    "compaction.request",
    "compaction.event",
    "compaction.result",
    "session.deleted",
    "settings.changed",
)
STATES = (
    "idle", "receiving", "generating", "dispatching_tool", "waiting_for_tool",
    "publishing", "compacting", "error",
)  # fmt: skip


def read(name: str) -> str:
    return (STATIC / name).read_text(encoding="utf-8")


class PageParser(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.ids: list[str] = []
        self.refs: list[tuple[str, str, str]] = []  # (tag, attribute, value)
        self.inline_scripts: list[str] = []
        self.labels_for: set[str] = set()
        self.controls: list[tuple[str, dict[str, str | None]]] = []
        self.links: list[dict[str, str | None]] = []  # the attributes of each <link>
        self._in_script = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if a.get("id"):
            self.ids.append(str(a["id"]))
        for name in ("src", "href", "action", "poster", "data"):
            if a.get(name):
                self.refs.append((tag, name, str(a[name])))
        if tag == "link":
            self.links.append(a)
        if tag == "label" and a.get("for"):
            self.labels_for.add(str(a["for"]))
        if tag in ("input", "textarea", "select"):
            self.controls.append((tag, a))
        self._in_script = tag == "script"

    def handle_endtag(self, tag: str) -> None:
        if tag == "script":
            self._in_script = False

    def handle_data(self, data: str) -> None:
        if self._in_script and data.strip():
            self.inline_scripts.append(data)


@pytest.fixture(scope="module")
def html() -> str:
    return read("index.html")


@pytest.fixture(scope="module")
def page(html: str) -> PageParser:
    parser = PageParser()
    parser.feed(html)
    return parser


MODULES = ("api", "sha256", "shared", "sse", "kept", "answer", "live", "chat", "panel",
           "sessions", "app")


@pytest.fixture(scope="module")
def js() -> str:
    """The page's script: app.js and the modules it is made of, as one text."""
    return "\n".join(read(f"{name}.js") for name in MODULES)


@pytest.fixture(scope="module")
def css() -> str:
    return read("style.css")


# --------------------------------------------------------------------------- index.html


def test_index_references_script_and_stylesheet(html: str, page: PageParser) -> None:
    assert ("script", "src", "/static/app.js") in page.refs
    assert ("link", "href", "/static/style.css") in page.refs
    assert re.search(r'<script[^>]+type="module"[^>]+src="/static/app.js"', html)


def test_index_loads_nothing_from_outside(html: str, page: PageParser) -> None:
    assert "http://" not in html
    assert "https://" not in html
    for tag, attr, value in page.refs:
        assert value.startswith("/static/"), f"<{tag} {attr}={value!r}> is not a local file"
        assert not value.startswith("//")


def test_index_has_no_inline_script(page: PageParser) -> None:
    assert page.inline_scripts == []


def test_index_ids_are_unique(page: PageParser) -> None:
    duplicates = {i for i in page.ids if page.ids.count(i) > 1}
    assert not duplicates


def test_every_form_control_has_a_label(page: PageParser) -> None:
    for tag, attrs in page.controls:
        if attrs.get("type") == "checkbox":
            continue  # wrapped in its <label>
        assert attrs.get("id") in page.labels_for or attrs.get("aria-label"), (tag, attrs)


# --------------------------------------------------------------------------- style.css


def test_stylesheet_loads_nothing_from_outside(css: str) -> None:
    assert "http://" not in css
    assert "https://" not in css
    assert "@import" not in css
    assert "@font-face" not in css


def test_stylesheet_colours_every_state(css: str) -> None:
    for state in STATES:
        assert f'[data-state="{state}"]' in css, state


# --------------------------------------------------------------------------- app.js


def test_script_never_parses_data_as_markup(js: str) -> None:
    assert not re.search(r"\b(innerHTML|outerHTML)\s*(\+|\|\||&&|\?\?)?=(?!=)", js)
    assert "insertAdjacentHTML" not in js
    assert not re.search(r"document\s*\.\s*write(ln)?\s*\(", js)
    assert "createContextualFragment" not in js
    assert "DOMParser" not in js
    assert not re.search(r"\beval\s*\(|new\s+Function\s*\(", js)


def test_script_renders_text(js: str) -> None:
    assert "textContent" in js or "createTextNode" in js


def test_script_loads_nothing_from_outside(js: str) -> None:
    assert "http://" not in js
    assert "https://" not in js
    imported = re.findall(r"^\s*import\b[^;]*?from\s+\"([^\"]+)\"", js, re.MULTILINE | re.DOTALL)
    assert imported, "app.js is made of modules"
    # No dependencies: only the page's own modules, each one there.
    assert {name.removeprefix("./").removesuffix(".js") for name in imported} <= set(MODULES)
    assert not re.search(r"^\s*import\s+[\"']|\bimport\s*\(", js, re.MULTILINE)


def test_every_module_of_the_script_is_one_of_the_page() -> None:
    on_disk = {path.stem for path in STATIC.glob("*.js")}
    assert on_disk == set(MODULES)


def test_script_uses_every_endpoint(js: str) -> None:
    for endpoint in ("/api/sessions", "/messages", "/compact", "/stop", "/retry", "/api/events",
                     "/transcript", "/export", '"DELETE"'):
        assert endpoint in js, endpoint
    assert "text/event-stream" in js
    assert "getReader()" in js
    assert "EventSource(" in js
    assert "localStorage" in js
    assert "#session=" in js


def test_script_handles_every_event_type(js: str) -> None:
    for name in (*LIVE_EVENT_TYPES, "token", "restart", "done", "error"):
        assert f'"{name}"' in js, name


def test_script_knows_every_state(js: str) -> None:
    for state in STATES:
        assert f'"{state}"' in js, state


def test_script_finds_only_elements_the_page_has(js: str, page: PageParser) -> None:
    wanted = set(re.findall(r'byId\("([^"]+)"\)', js))
    # UI_IDS maps names to ids as `name: "id",`; every such id must exist too.
    bind = re.search(r"const UI_IDS = \{(.*?)\n\};", js, re.DOTALL)
    assert bind, "UI_IDS not found"
    wanted |= set(re.findall(r':\s*"([a-z0-9-]+)"', bind.group(1)))
    assert wanted
    missing = wanted - set(page.ids)
    assert not missing, f"app.js looks up ids the page lacks: {sorted(missing)}"


# --------------------------------------------------------------------------- app.js under node

NODE = shutil.which("node")

NODE_CHECK = r"""
const load = (name) => import(`${process.argv[1]}/${name}.js`);
const [live, shared, chat, panel, answer, sse, sha256, api] = await Promise.all(
  ["live", "shared", "chat", "panel", "answer", "sse", "sha256", "api"].map(load));
// The page's own SHA-256, for a page without crypto.subtle (no secure
// context), against the block boundaries and text of several UTF-8 widths.
const DIGESTED = ["", "abc", "a".repeat(55), "a".repeat(56), "a".repeat(64), "a".repeat(1000),
                  "s1\nmessage\nkey", "héllo 世界 🙂"];
const digests = DIGESTED.map(sha256.sha256Hex);
const queryIds = [await api.queryIdFor("s1", "k1", false), await api.queryIdFor("s1", "k1", true)];
Object.defineProperty(globalThis.crypto, "subtle", { value: undefined });
queryIds.push(await api.queryIdFor("s1", "k1", false), await api.queryIdFor("s1", "k1", true));
const p = new sse.SseParser();
const out = [];
// Frames split at awkward places, a comment, CRLF line ends and a multi-line data field.
for (const chunk of [": connected\n\nevent: tok", "en\ndata: {\"text\": \"Hi\", \"index\": 0}\n",
                     "\nevent: token\r\ndata: {\"text\": \" there\",", " \"index\": 1}\r\n\r\n",
                     "data: a\ndata: b\n\n", "event: done\ndata: {\"reply\": \"Hi there\"}"]) {
  out.push(...p.push(chunk));
}
out.push(...p.finish());
const levels = [0, 0.79, 0.8, 0.949, 0.95, 1.2].map((r) => panel.gaugeLevel(r * 1000, 1000));
// Automatic compaction from 600 tokens of 1,000 (a threshold of 0.6): the gauge warns from there.
const levelsFrom600 = [599, 600, 949, 950].map((t) => panel.gaugeLevel(t, 1000, 600));
// A compaction starts; a second request is skipped; then the first one ends.
const banner = [];
let running = null;
for (const [type, id, event] of [["compaction.event", "c1", "started"],
                                 ["compaction.result", "c2"], ["compaction.result", "c1"]]) {
  running = live.compactingAfter(running, type, id, event);
  banner.push(running);
}
// One known only from a read ends with the first result seen.
banner.push(live.compactingAfter("unknown", "compaction.result", "c3"));
// A read of the session: any state but compacting ends the banner (a turn's
// phase too), unless the read was sent before its start was seen (load 3
// against a start seen at load 3); "compacting" keeps it, or brings it up for
// a compaction whose start was missed, unless the read was sent before a
// result was seen (load 5 against a result seen at load 5).
const reload = [["c1", "idle", 4, 3, 0], ["c1", "compacting", 4, 3, 0],
                ["c1", "generating", 4, 3, 0], ["c1", "idle", 3, 3, 0],
                [null, "compacting", 1, 0, 0], [null, "compacting", 5, 3, 5],
                [null, "compacting", 6, 3, 5]]
  .map(([current, state, readSeq, startSeen, endSeen]) =>
    live.compactingAfterRead(current, state, readSeq, startSeen, endSeen));
// The gauge after a compaction's result: completed moves it, anything else does not.
const shown = { token_count: 1255, budget: 1792 };
const gauge = [{ status: "completed", tokens_before: 1255, tokens_after: 1002 },
               { status: "skipped", error: "nothing to compact" },
               { status: "completed" }]
  .map((result) => panel.sessionAfterCompaction(shown, result).token_count);
// A compaction's progress in the banner, and what an answer not yet begun waits for.
const progress = [{ pieces_done: 1, pieces_total: 5 }, { pieces_done: 5, pieces_total: 5 }, {}]
  .map(panel.progressText);
const waits = [];
let pending = { queued: true, started: false };
for (const [action, to] of [["start_generation", "generating"], ["reset", "idle"],
                            ["receive", "receiving"]]) {
  pending = answer.pendingAfter(pending, action, to);
  waits.push(answer.pendingText(pending));
}
const lateProgress = live.compactingAfter(null, "compaction.event", "c9", "progress");
// Progress arriving after its own result is an echo; a start under that id is
// not: a turn's second emergency compaction runs under the query's id too.
const echoes = [live.compactingAfter(null, "compaction.event", "c9", "progress", "c9"),
                live.compactingAfter(null, "compaction.event", "c9", "started", "c9"),
                live.compactingAfter(null, "compaction.event", "c10", "started", "c9")];
// Two reads that both brought the newest answer show it once.
const newer = chat.withNewer([{ position: "1" }, { position: "2" }],
                             [{ position: "2" }, { position: "3" }]).map((i) => i.position);
// A live state change older than the newest state known is late, from the same
// generator only (two clocks may disagree); one that is no time is not.
const seen = { at: "2026-01-02T14:02:30.500000Z", by: "g1" };
const late = [["2026-01-02T14:02:30.100000Z", "g1"], ["2026-01-02T14:02:31.000000Z", "g1"],
              ["2026-01-02T14:02:30.100000Z", "g2"], ["not a time", "g1"]]
  .map(([at, by]) => live.staleState(seen, at, by));
const firstLate = live.staleState(null, "2026-01-02T14:02:30.100000Z", "g1");
// Within one millisecond, to the microsecond the services stamp; a stamp may
// be written with fewer digits, or none.
const inMs = { at: "2026-01-02T14:02:30.500400Z", by: "g1" };
const withinMs = ["2026-01-02T14:02:30.500100Z", "2026-01-02T14:02:30.500700Z",
                  "2026-01-02T14:02:30.5Z", "2026-01-02T14:02:30Z"]
  .map((at) => live.staleState(inMs, at, "g1"));
const newest = [["2026-01-02T14:02:30.100000Z", "g1"], ["2026-01-02T14:02:31.000000Z", "g1"],
                ["2026-01-02T14:02:30.100000Z", "g2"], [null, "g1"]]
  .map(([at, by]) => live.newestSeen(seen, at, by));
console.log(JSON.stringify({
  progress, waits, lateProgress, echoes, newer, late, firstLate, newest, withinMs, digests,
  queryIds,
  events: out, levels, levelsFrom600, fmt: shared.fmt(1234567), pct: shared.percent(1234, 3584),
  types: live.LIVE_EVENT_TYPES, banner, reload, gauge,
  shown: [["idle", false], ["generating", true], ["idle", true], ["compacting", false]]
    .map(([phase, compacting]) => panel.sessionState(phase, compacting)),
  noSession: panel.sessionAfterCompaction(null, { status: "completed", tokens_after: 5 }),
  divider: [chat.dividerText({ kind: "compaction", auto: true, level: "gentle",
                              tokens_before: 1255, tokens_after: 1002,
                              at: "2026-01-02T14:02:30Z" }),
            chat.dividerText({ kind: "compaction", auto: false, level: "emergency" })],
  // Six messages, a marker keeping the last two before it, one more message, a marker
  // keeping one, one message.
  faded: [...chat.fadedIndexes(["m", "m", "m", "m", ["c", 2], "m", ["c", 1], "m"].map(
    (k) => (k === "m" ? { kind: "message" } : { kind: "compaction", kept_messages: k[1] })))],
  noMarker: [...chat.fadedIndexes([{ kind: "message" }])],
  // Two turns, a retry of the second, a marker keeping the last question and
  // its fresh answer: the answer the retry replaced is not one of the two.
  retriedBefore: [...chat.fadedIndexes([
    { kind: "message", role: "user", query_id: "q1" },
    { kind: "message", role: "assistant", query_id: "q1" },
    { kind: "message", role: "user", query_id: "q2" },
    { kind: "message", role: "assistant", query_id: "q2" },
    { kind: "message", role: "assistant", query_id: "q3", supersedes: "q2" },
    { kind: "compaction", kept_messages: 2 }])],
  // A retry after the marker: the answer it replaced was one the marker kept.
  retriedAfter: [...chat.fadedIndexes([
    { kind: "message", role: "user", query_id: "q1" },
    { kind: "message", role: "assistant", query_id: "q1" },
    { kind: "compaction", kept_messages: 2 },
    { kind: "message", role: "assistant", query_id: "q2", supersedes: "q1" }])],
  // A question, its answer (a tool call, its result, the text), a retry of it.
  superseded: [...chat.supersededIndexes([
    { kind: "message", role: "user", query_id: "q1" },
    { kind: "message", role: "assistant", query_id: "q1" },
    { kind: "message", role: "tool", query_id: "q1" },
    { kind: "message", role: "assistant", query_id: "q1" },
    { kind: "message", role: "assistant", query_id: "q2", supersedes: "q1" }])],
}));
"""


@pytest.mark.skipif(NODE is None, reason="node is not installed")
def test_sse_parser_and_helpers_under_node(tmp_path: Path) -> None:
    # Copied beside a package.json that makes node load every .js as a module.
    (tmp_path / "package.json").write_text('{"type": "module"}', encoding="utf-8")
    for name in MODULES:
        (tmp_path / f"{name}.js").write_text(read(f"{name}.js"), encoding="utf-8")
    assert NODE is not None
    done = subprocess.run(
        [NODE, "--input-type=module", "-e", NODE_CHECK, tmp_path.as_uri()],
        capture_output=True,
        env={**os.environ, "TZ": "UTC"},
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["events"] == [
        {"event": "token", "data": '{"text": "Hi", "index": 0}'},
        {"event": "token", "data": '{"text": " there", "index": 1}'},
        {"event": "message", "data": "a\nb"},
        {"event": "done", "data": '{"reply": "Hi there"}'},
    ]
    assert result["levels"] == ["ok", "ok", "warn", "warn", "danger", "danger"]
    assert result["levelsFrom600"] == ["ok", "warn", "warn", "danger"]
    assert result["fmt"] == "1,234,567"
    assert result["pct"] == 34
    assert result["types"] == list(LIVE_EVENT_TYPES)
    assert result["banner"] == ["c1", "c1", None, None]
    assert result["reload"] == [None, "c1", None, "c1", "unknown", None, "unknown"]
    # As the server's session_state: a running compaction hides the turn's phase.
    assert result["shown"] == ["idle", "compacting", "compacting", "compacting"]
    assert result["gauge"] == [1002, 1255, 1255]
    assert result["noSession"] is None
    assert result["divider"] == ["compacted · automatic · 1,255 → 1,002 tokens · 14:02",
                                 "compacted · manual · emergency"]
    assert sorted(result["faded"]) == [0, 1, 2, 3] and result["noMarker"] == []
    assert sorted(result["retriedBefore"]) == [0, 1, 3] and result["retriedAfter"] == []
    assert sorted(result["superseded"]) == [1, 2, 3]
    assert result["progress"] == ["Compacting… piece 2 of 5", "Compacting… all 5 pieces written",
                                  "Compacting the conversation…"]
    # Queued behind the earlier turn until it ends, then waiting for the model.
    assert result["waits"] == ["queued: the session's earlier message is answered first…",
                               "waiting for a generator…", "waiting for the model…"]
    assert result["lateProgress"] == "c9"
    assert result["echoes"] == [None, "c9", "c10"]
    assert result["newer"] == ["1", "2", "3"]
    assert result["late"] == [True, False, False, False] and result["firstLate"] is False
    assert result["withinMs"] == [True, False, True, True]
    digested = ["", "abc", "a" * 55, "a" * 56, "a" * 64, "a" * 1000, "s1\nmessage\nkey",
                "héllo 世界 🙂"]
    assert result["digests"] == [hashlib.sha256(text.encode()).hexdigest() for text in digested]
    # As the gateway names a keyed query, with crypto.subtle and without it.
    named = [query_id_for("s1", "k1", False), query_id_for("s1", "k1", True)]
    assert result["queryIds"] == named * 2
    seen = {"at": "2026-01-02T14:02:30.500000Z", "by": "g1"}
    assert result["newest"] == [seen, {"at": "2026-01-02T14:02:31.000000Z", "by": "g1"},
                                {"at": "2026-01-02T14:02:30.100000Z", "by": "g2"}, seen]
