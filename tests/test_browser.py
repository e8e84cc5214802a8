"""The page driven in a real browser: Playwright's Python package with the
system's Chromium (no browser download), against the whole product.

Skipped, with the reason shown, where no Chromium is installed (`.ci/run`
installs it). Every test fails on a console error or an uncaught exception
in the page, and saves a screenshot under its temporary directory.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path

import httpx
import pytest

from schemas import subjects
from schemas.envelope import Envelope, utc_now
from schemas.messages import StateChange
from tests.events import until
from tests.stub_server import configure_stub_now, running_stub
from tests.system import (
    System,
    ask,
    new_session,
    publish_now,
    put_live_setting,
    running_system,
)

# CHROMIUM names another binary (a path or a command).
CHROMIUM = shutil.which(os.environ.get("CHROMIUM") or "chromium") or shutil.which(
    "chromium-browser")
playwright_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="no Chromium on this machine (apt-get install chromium)")

CHROMIUM_FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--no-first-run",
]
SUMMARY_MODEL = "browser-summariser"
ANSWER_MODEL = "stub-model"  # the system's MODEL
WAIT_MS = 30_000
# Every wait on the page is for a condition; its bound only keeps a broken page
# from hanging the suite. Playwright's own 5 s was short of a compaction's
# summary on a busy machine: a test failed by the clock, not the page.
playwright_api.expect.set_options(timeout=WAIT_MS)
HOSTILE = "<img src=x onerror=alert(1)>"


THINKER = "thinker"


@pytest.fixture(scope="module")
def stub_url() -> Iterator[str]:
    """A stand-in of this module's own, with a model that thinks."""
    with running_stub("--capabilities", f"{THINKER}=completion,tools,thinking") as url:
        yield url


@pytest.fixture(scope="module")
def system(nats_url: str, stub_url: str) -> Iterator[System]:
    # A small window so a few turns move the gauge; automatic compaction off
    # so only the Compact button compacts; the summariser a model of its own
    # so the test can hold its call and see `compacting` for as long as it looks.
    env = {"NUM_CTX": "2048", "COMPACTION_THRESHOLD": "0", "COMPACTION_TAIL_TURNS": "1",
           "COMPACTION_MODEL": SUMMARY_MODEL}
    with running_system(nats_url, stub_url, env) as running:
        yield running


@pytest.fixture(scope="module")
def browser() -> Iterator[playwright_api.Browser]:
    with playwright_api.sync_playwright() as p:
        launched = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS)
        yield launched
        launched.close()


class Watched:
    """A page whose console errors, page errors and dialogs are recorded."""

    def __init__(self, page: playwright_api.Page, shots: Path) -> None:
        self.page = page
        self.shots = shots
        self.problems: list[str] = []
        self.dialogs: list[str] = []
        self._expected: list[str] = []
        page.on("console", self._on_console)
        page.on("pageerror", lambda exc: self.problems.append(f"page error: {exc}"))
        page.on("dialog", self._on_dialog)

    def _on_console(self, message: playwright_api.ConsoleMessage) -> None:
        if message.type == "error" and not any(text in message.text for text in self._expected):
            self.problems.append(f"console error: {message.text}")

    def ignore(self, text: str) -> None:
        """Console errors holding `text` are expected from here on (a request
        the test refuses on purpose, which the browser logs all the same)."""
        self._expected.append(text)

    def _on_dialog(self, dialog: playwright_api.Dialog) -> None:
        self.dialogs.append(dialog.message)
        dialog.dismiss()

    def shot(self, name: str) -> None:
        self.page.screenshot(path=str(self.shots / f"{name}.png"), full_page=True)


@pytest.fixture
def watched(browser: playwright_api.Browser, system: System, tmp_path: Path,
            request: pytest.FixtureRequest) -> Iterator[Watched]:
    width = getattr(request, "param", 1280)
    context = browser.new_context(viewport={"width": width, "height": 900},
                                  base_url=system.base_url)
    page = context.new_page()
    page.set_default_timeout(WAIT_MS)
    watcher = Watched(page, tmp_path)
    page.goto("/")
    yield watcher
    watcher.shot("last")
    context.close()
    assert watcher.problems == [], watcher.problems


def create_session(page: playwright_api.Page) -> str:
    before = page.evaluate("location.hash")
    page.click("#new-session-button")
    page.click("#new-session-create")
    playwright_api.expect(page.locator("#message-input")).to_be_enabled()
    # A session named in the address, not the one shown before: with another
    # shown, its address and idle badge alone said nothing of the new one.
    page.wait_for_function(
        "(before) => location.hash.includes('session=') && location.hash !== before", arg=before)
    # Read by the page: a first read still on its way when a test sends would
    # draw the transcript again once the turn ends, whatever the turn showed.
    playwright_api.expect(page.locator("#state-badge")).to_have_attribute("data-state", "idle")
    return str(page.evaluate("decodeURIComponent(location.hash.split('session=')[1])"))


def send(page: playwright_api.Page, text: str) -> None:
    answers = page.locator("#messages .msg-assistant")
    before = answers.count()
    page.fill("#message-input", text)
    page.click("#send-button")
    playwright_api.expect(answers).to_have_count(before + 1)
    playwright_api.expect(page.locator("#messages .msg-pending")).to_have_count(0)
    playwright_api.expect(page.locator("#send-button")).to_be_enabled()


def gauge_percent(page: playwright_api.Page) -> int:
    return int(page.get_attribute("#gauge", "aria-valuenow") or "0")


@contextlib.contextmanager
def answer_under_way(page: playwright_api.Page, stub_url: str, text: str
                     ) -> Iterator[playwright_api.Locator]:
    """`text` sent while the model stops after its answer's first piece: the
    pending answer, written in part, for as long as the block runs."""
    configure_stub_now(stub_url, paused_models=[ANSWER_MODEL])
    try:
        page.fill("#message-input", text)
        page.click("#send-button")
        pending = page.locator("#messages .msg-pending")
        playwright_api.expect(pending.locator(".msg-text")).not_to_have_text("")
        yield pending
    finally:
        configure_stub_now(stub_url, paused_models=[])


def test_a_message_streams_and_the_state_badge_moves(
        watched: Watched, stub_url: str) -> None:
    page = watched.page
    create_session(page)
    # Streaming: part of the answer is on the page while it is still pending.
    with answer_under_way(page, stub_url, "tell me a story about the sea and the ships on it"):
        playwright_api.expect(page.locator("#state-badge")).to_have_attribute(
            "data-state", "generating")
        watched.shot("streaming")
    playwright_api.expect(page.locator("#messages .msg-pending")).to_have_count(0)
    playwright_api.expect(page.locator("#state-badge")).to_have_attribute("data-state", "idle")
    assert page.locator("#messages .msg-assistant .msg-text").last.inner_text().strip()


def test_compact_shows_compacting_then_the_result_and_the_gauge_drops(
        watched: Watched, stub_url: str) -> None:
    page = watched.page
    create_session(page)
    for n in range(3):
        send(page, f"turn {n}: " + "the quick brown fox jumps over the lazy dog " * 12)
    before = gauge_percent(page)
    configure_stub_now(stub_url, held_models=[SUMMARY_MODEL])
    try:
        page.click("#compact-button")
        playwright_api.expect(page.locator("#state-badge")).to_have_attribute(
            "data-state", "compacting")
        playwright_api.expect(page.locator("#compacting-banner")).to_be_visible()
        watched.shot("compacting")
    finally:
        configure_stub_now(stub_url, held_models=[])
    playwright_api.expect(page.locator("#compact-status")).to_contain_text(
        "Compaction completed")
    playwright_api.expect(page.locator("#compacting-banner")).to_be_hidden()
    page.wait_for_function(
        f"Number(document.getElementById('gauge').getAttribute('aria-valuenow')) < {before}")
    playwright_api.expect(page.locator("#fact-compactions")).to_have_text("1")
    watched.shot("compacted")


def test_compact_now_waits_for_the_compaction_under_way(
        watched: Watched, stub_url: str) -> None:
    """A second click during a compaction was skipped, "nothing to compact",
    and its line replaced the first one's result; with no session open,
    Delete… could be clicked, to no effect."""
    page = watched.page
    compact, delete = page.locator("#compact-button"), page.locator("#delete-button")
    playwright_api.expect(delete).to_be_disabled()
    create_session(page)
    playwright_api.expect(delete).to_be_enabled()
    for n in range(2):
        send(page, f"turn {n}: " + "the quick brown fox jumps over the lazy dog " * 12)
    configure_stub_now(stub_url, held_models=[SUMMARY_MODEL])
    try:
        compact.click()
        playwright_api.expect(page.locator("#compacting-banner")).to_be_visible()
        playwright_api.expect(compact).to_be_disabled()
    finally:
        configure_stub_now(stub_url, held_models=[])
    playwright_api.expect(page.locator("#compact-status")).to_contain_text(
        "Compaction completed")
    playwright_api.expect(compact).to_be_enabled()


def test_the_picker_shows_the_session_opened_by_its_address(watched: Watched) -> None:
    """Opened by its address (a link, Back), a session the picker knew, with
    its label, left the picker on "(choose a session)"."""
    page = watched.page
    first = create_session(page)
    send(page, "the first session")
    create_session(page)
    page.evaluate(f"location.hash = '#session={first}'")
    playwright_api.expect(page.locator("#session-select")).to_have_value(first)


def test_markup_in_a_message_is_shown_as_text(watched: Watched) -> None:
    page = watched.page
    create_session(page)
    send(page, HOSTILE)
    user = page.locator("#messages .msg-user .msg-text").last
    playwright_api.expect(user).to_have_text(HOSTILE)
    assert page.locator("#messages img").count() == 0
    assert watched.dialogs == []


def test_the_danger_buttons_can_be_read(watched: Watched, stub_url: str) -> None:
    """Stop and Delete… were red on red: a later rule gave them the red text
    and kept the red fill."""
    page = watched.page
    create_session(page)
    colours = "(e) => { const s = getComputedStyle(e); return [s.color, s.backgroundColor]; }"
    with answer_under_way(page, stub_url, "a message being answered"):
        for button in ("#stop-button", "#delete-button"):
            text, fill = page.eval_on_selector(button, colours)
            assert text != fill, (button, text, fill)


def test_a_long_answer_is_laid_out_once_a_frame_not_once_a_piece(
        watched: Watched, stub_url: str) -> None:
    """Each piece, added with a look at the scroll position after it, made the
    browser lay the list out again: 40,000 characters took 52 s to show."""
    page = watched.page
    create_session(page)
    devtools = page.context.new_cdp_session(page)
    devtools.send("Performance.enable")

    def layouts() -> int:
        metrics = devtools.send("Performance.getMetrics")["metrics"]
        return int(next(m["value"] for m in metrics if m["name"] == "LayoutCount"))

    configure_stub_now(stub_url, chars_per_token=100)  # room in the window for it all
    try:
        before = layouts()
        send(page, "long !long 12000")
        laid_out = layouts() - before
    finally:
        configure_stub_now(stub_url, chars_per_token=4)
    pieces = len(page.locator("#messages .msg-assistant .msg-text").last.inner_text().split())
    assert pieces > 1500
    assert laid_out < pieces / 4, (laid_out, pieces)


@pytest.mark.parametrize("watched", [390], indirect=True)
def test_a_message_is_sent_on_a_narrow_screen(watched: Watched) -> None:
    page = watched.page
    create_session(page)
    assert page.evaluate("document.documentElement.scrollWidth") <= 390
    send(page, "hello from a phone")
    playwright_api.expect(page.locator("#messages .msg-user .msg-text").last).to_have_text(
        "hello from a phone")
    watched.shot("narrow")


# Some 10 000 tokens: at 5 ms each it never ends by itself before the Stop click.
LONG_QUESTION = "tell me everything !long 40000"


@contextlib.contextmanager
def another_tab_answering(page: playwright_api.Page, stub_url: str, sid: str) -> Iterator[None]:
    """Session `sid` answering a message from another tab, its model stopped
    after the first piece, while `page` (showing `sid`) sees it generating."""
    other = page.context.new_page()
    try:
        open_session(other, sid)
        with answer_under_way(other, stub_url, "from the other tab"):
            playwright_api.expect(page.locator("#state-badge")).to_have_attribute(
                "data-state", "generating")
            yield
    finally:
        other.close()


def test_stop_ends_the_answer_keeps_its_text_and_gives_send_back(
        watched: Watched, stub_url: str) -> None:
    page = watched.page
    create_session(page)
    send_button, stop_button = page.locator("#send-button"), page.locator("#stop-button")
    configure_stub_now(stub_url, ms_per_token=5)
    try:
        page.fill("#message-input", LONG_QUESTION)
        page.click("#send-button")
        pending = page.locator("#messages .msg-pending .msg-text")
        playwright_api.expect(pending).not_to_have_text("")
        playwright_api.expect(stop_button).to_be_visible()
        playwright_api.expect(send_button).to_be_hidden()
        watched.shot("streaming-long")
        seen = pending.inner_text()
        stop_button.click()
        playwright_api.expect(page.locator("#messages .msg-pending")).to_have_count(0)
    finally:
        configure_stub_now(stub_url, ms_per_token=0)
    answer = page.locator("#messages .msg-assistant").last
    playwright_api.expect(answer.locator(".msg-tag")).to_have_text("stopped")
    kept = answer.locator(".msg-text").inner_text()
    assert kept.startswith(seen.strip()) and len(kept) < 40000, kept[:200]
    playwright_api.expect(send_button).to_be_visible()
    playwright_api.expect(stop_button).to_be_hidden()
    playwright_api.expect(page.locator("#state-badge")).to_have_attribute("data-state", "idle")
    watched.shot("stopped")
    send(page, "and now briefly")
    playwright_api.expect(page.locator("#messages .msg-assistant .msg-text").last).to_have_text(
        "Echo: and now briefly (turn 2)")
    assert page.locator("#messages .msg-assistant .msg-tag").count() == 1


Handler = Callable[[playwright_api.Route], None]


def first_request_only(handle: Handler) -> tuple[Handler, list[str]]:
    """A route handler doing `handle` to the first request and letting the
    others through, and the URLs it handled."""
    handled: list[str] = []

    def once(route: playwright_api.Route) -> None:
        if handled:
            route.continue_()
            return
        handled.append(route.request.url)
        handle(route)

    return once, handled


def network_failures_only(watched: Watched) -> None:
    """Requests a test cut on purpose show as console errors: only those may."""
    watched.problems[:] = [p for p in watched.problems if "net::ERR_FAILED" not in p]


def test_a_stop_that_fails_gives_stop_back_and_the_answer_goes_on(
        watched: Watched, stub_url: str) -> None:
    page = watched.page
    create_session(page)
    stop_button = page.locator("#stop-button")
    with answer_under_way(page, stub_url, "a long story, please") as pending:
        page.route("**/api/sessions/*/stop", lambda route: route.abort())
        stop_button.click()
        playwright_api.expect(page.locator("#notice")).to_contain_text("Could not stop")
        # Still being written, and it can still be stopped.
        playwright_api.expect(pending.locator(".msg-status")).to_have_text("writing…")
        playwright_api.expect(stop_button).to_be_enabled()
        page.unroute("**/api/sessions/*/stop")
        stop_button.click()
        playwright_api.expect(pending).to_have_count(0)
    playwright_api.expect(page.locator("#notice")).to_be_hidden()  # stopped after all
    answer = page.locator("#messages .msg-assistant").last
    playwright_api.expect(answer.locator(".msg-tag")).to_have_text("stopped")
    network_failures_only(watched)


def test_a_retry_that_fails_leaves_the_answer_standing(watched: Watched) -> None:
    page = watched.page
    create_session(page)
    send(page, "hello")
    answer = page.locator("#messages .msg-assistant").first
    page.route("**/api/sessions/*/retry", lambda route: route.abort())
    answer.locator(".retry-button").click()
    playwright_api.expect(page.locator("#messages .msg-failed")).to_have_count(1)
    # No fresh answer was stored: the old one is still the one in the context.
    playwright_api.expect(answer).not_to_have_class(re.compile(r"\bmsg-superseded\b"))
    playwright_api.expect(answer.locator(".msg-tag")).to_have_count(0)
    playwright_api.expect(answer.locator(".retry-button")).to_be_enabled()
    network_failures_only(watched)


def test_a_live_feed_the_gateway_refused_is_opened_again_by_the_page(
        watched: Watched) -> None:
    page = watched.page
    def refuse(route: playwright_api.Route) -> None:
        # As the gateway answers a client over its share of streams; the
        # browser does not try such a stream again by itself.
        route.fulfill(status=429, content_type="application/json",
                      body='{"error": {"code": "too_many_streams", "message": "too many"}}')

    refuse_once, refused = first_request_only(refuse)
    page.route("**/api/events*", refuse_once)
    create_session(page)
    playwright_api.expect(page.locator("#live-status")).to_have_attribute(
        "data-live", "connected")
    assert len(refused) == 1
    # The refused stream shows as a console error; only it may.
    watched.problems[:] = [p for p in watched.problems if "429" not in p]


def test_retry_replaces_the_last_answer_with_a_fresh_one(watched: Watched) -> None:
    page = watched.page
    create_session(page)
    send(page, "hello")
    answers = page.locator("#messages .msg-assistant")
    playwright_api.expect(answers).to_have_count(1)
    page.locator("#messages .retry-button").click()
    playwright_api.expect(page.locator("#messages .msg-pending")).to_have_count(0)
    playwright_api.expect(page.locator("#send-button")).to_be_enabled()
    old, fresh = answers.first, answers.last
    # Retry sits on the stored answer only: once it is there, the list was
    # drawn again from the transcript, not left as streamed.
    playwright_api.expect(fresh.locator(".retry-button")).to_be_enabled()
    # Both answers stay on the page; only the fresh one is in the context.
    playwright_api.expect(answers).to_have_count(2)
    playwright_api.expect(old).to_have_class(re.compile(r"\bmsg-superseded\b"))
    playwright_api.expect(old.locator(".msg-tag")).to_have_text("superseded")
    playwright_api.expect(fresh).not_to_have_class(re.compile(r"\bmsg-superseded\b"))
    playwright_api.expect(fresh.locator(".msg-text")).to_have_text("Echo: hello (turn 1)")
    playwright_api.expect(page.locator("#messages .retry-button")).to_have_count(1)
    watched.shot("retried")
    send(page, "more")
    playwright_api.expect(answers.last.locator(".msg-text")).to_have_text("Echo: more (turn 2)")
    playwright_api.expect(answers.nth(1).locator(".retry-button")).to_have_count(0)
    playwright_api.expect(old.locator(".msg-tag")).to_have_text("superseded")
    assert page.locator("#messages .msg-superseded").count() == 1


def test_an_answer_lost_on_the_way_is_sent_again_and_answered_once(
        watched: Watched, system: System) -> None:
    page = watched.page
    # The live feed down too: with it, the page would show the stored answer by
    # itself (the turn's report reloads the session), and Send again would vanish.
    page.route("**/api/events*", lambda route: route.abort())
    sid = create_session(page)
    keys: list[str | None] = []

    def lose_the_first_answer(route: playwright_api.Route) -> None:
        keys.append(route.request.headers.get("idempotency-key"))
        if len(keys) > 1:
            route.continue_()
            return
        route.fetch()  # the gateway takes the message and answers it...
        route.abort()  # ...and the page never hears of it

    page.route("**/api/sessions/*/messages", lose_the_first_answer)
    page.fill("#message-input", "hello")
    page.click("#send-button")
    again = page.locator("#messages .msg-failed .send-again-button")
    playwright_api.expect(again).to_be_enabled()
    watched.shot("answer-lost")
    again.click()
    answers = page.locator("#messages .msg-assistant")
    playwright_api.expect(answers.last.locator(".msg-text")).to_have_text("Echo: hello (turn 1)")
    playwright_api.expect(page.locator("#messages .msg-failed")).to_have_count(0)
    page.unroute("**/api/events*")
    playwright_api.expect(page.locator("#live-status")).to_have_attribute("data-live", "connected")
    network_failures_only(watched)  # the aborted requests, cut on purpose
    assert len(keys) == 2 and keys[0] and keys[0] == keys[1], keys
    stored = httpx.get(f"{system.base_url}/api/sessions/{sid}", timeout=10).json()["messages"]
    assert [m["role"] for m in stored] == ["user", "assistant"]


def session_of_turns(client: httpx.Client, turns: int) -> str:
    """A new session with `turns` answered questions, t0, t1, ..."""
    sid = new_session(client)
    for n in range(turns):
        assert ask(client, sid, f"t{n}").status_code == 200
    return sid


def open_session(page: playwright_api.Page, sid: str) -> None:
    page.goto(f"/#session={sid}")
    # In the picker once the page has left what it showed before (its badge
    # idle too, perhaps): only then does an idle badge speak of this session.
    playwright_api.expect(page.locator("#session-select")).to_have_value(sid)
    playwright_api.expect(page.locator("#state-badge")).to_have_attribute("data-state", "idle")


def test_a_compacted_session_is_labelled_by_its_first_message(
        watched: Watched, system: System) -> None:
    """Labelled from its context, it took the first message the compaction
    kept raw: 't2' where the session began with 't0'."""
    with system.client() as client:
        sid = new_session(client)
        for n in range(3):  # long enough for a summary to free room
            long = f"t{n} " + "the quick brown fox jumps over the lazy dog " * 12
            assert ask(client, sid, long).status_code == 200
        assert client.post(f"/api/sessions/{sid}/compact", json={}).status_code == 202
        until(lambda: client.get(f"/api/sessions/{sid}").json()["compactions"] == 1,
              "the compaction done")
    open_session(watched.page, sid)
    option = watched.page.locator(f"#session-select option[value='{sid}']")
    playwright_api.expect(option).to_have_text(re.compile(r"^t0"))


def test_the_turn_under_way_stays_when_earlier_messages_are_loaded(
        watched: Watched, system: System, stub_url: str) -> None:
    page = watched.page
    with system.client() as client:
        # More than a page of transcript (100 items), so scrolling up loads more.
        sid = session_of_turns(client, 55)
    open_session(page, sid)
    playwright_api.expect(page.locator("#messages .msg-more")).to_be_visible()
    with answer_under_way(page, stub_url, "and one more") as pending:
        page.locator("#messages").evaluate("box => { box.scrollTop = 0; }")
        users = page.locator("#messages .msg-user .msg-text")
        playwright_api.expect(users.first).to_have_text("t0")  # the older page is drawn
        playwright_api.expect(pending).to_have_count(1)
        playwright_api.expect(users.last).to_have_text("and one more")
    playwright_api.expect(pending).to_have_count(0)
    answer = page.locator("#messages .msg-assistant .msg-text").last
    playwright_api.expect(answer).to_have_text(re.compile(r"^Echo: and one more"))
    playwright_api.expect(users.last).to_have_text("and one more")
    assert page.locator("#messages .msg-failed").count() == 0


def test_the_turn_under_way_stays_when_a_slow_first_read_arrives(
        watched: Watched, stub_url: str) -> None:
    page = watched.page
    create_session(page)
    send(page, "first question")
    held: list[playwright_api.Route] = []

    def hold_the_first_read(route: playwright_api.Route) -> None:
        if held or "kind=" in route.request.url:
            route.continue_()
        else:
            held.append(route)

    page.route("**/transcript?before=end*", hold_the_first_read)
    configure_stub_now(stub_url, paused_models=[ANSWER_MODEL])
    try:
        with page.expect_request(
                lambda r: "transcript?before=end" in r.url and "kind=" not in r.url):
            page.reload()
        page.fill("#message-input", "second question")
        page.click("#send-button")
        pending = page.locator("#messages .msg-pending")
        playwright_api.expect(pending.locator(".msg-text")).not_to_have_text("")
        assert len(held) == 1
        held[0].continue_()
        users = page.locator("#messages .msg-user .msg-text")
        playwright_api.expect(users.first).to_have_text("first question")  # the read is drawn
        playwright_api.expect(users).to_have_count(2)
        playwright_api.expect(users.last).to_have_text("second question")
        playwright_api.expect(pending).to_have_count(1)
    finally:
        configure_stub_now(stub_url, paused_models=[])
    playwright_api.expect(pending).to_have_count(0)
    answers = page.locator("#messages .msg-assistant .msg-text")
    playwright_api.expect(answers.last).to_have_text("Echo: second question (turn 2)")
    playwright_api.expect(users).to_have_count(2)


def failed_to_send(page: playwright_api.Page, stub_url: str, text: str
                   ) -> playwright_api.Locator:
    """`text` sent while the model server fails every call (a 500): its
    failed bubble, once it shows the error."""
    configure_stub_now(stub_url, quirks=["error"])
    try:
        page.fill("#message-input", text)
        page.click("#send-button")
        failed = page.locator("#messages .msg-failed")
        playwright_api.expect(failed.locator(".msg-error")).to_be_visible()
    finally:
        configure_stub_now(stub_url, quirks=[])
    return failed


def test_a_message_that_surely_failed_goes_back_into_the_composer(
        watched: Watched, stub_url: str) -> None:
    page = watched.page
    create_session(page)
    failed = failed_to_send(page, stub_url, "please keep this")
    assert failed.locator(".send-again-button").count() == 0
    playwright_api.expect(page.locator("#message-input")).to_have_value("please keep this")


def test_retry_after_a_failed_message_marks_the_answer_it_stands_under(
        watched: Watched, stub_url: str) -> None:
    """The failed message's bubble follows the last answer on the page: Retry
    took the list's last item for its answer, and marked the failure
    superseded instead of the answer being replaced."""
    page = watched.page
    create_session(page)
    send(page, "first")
    failed = failed_to_send(page, stub_url, "second")
    answer = page.locator("#messages .msg-assistant", has_text="Echo: first")
    configure_stub_now(stub_url, paused_models=[ANSWER_MODEL])
    try:
        answer.locator(".retry-button").click()
        playwright_api.expect(answer).to_have_class(re.compile(r"\bmsg-superseded\b"))
        playwright_api.expect(failed).not_to_have_class(re.compile(r"\bmsg-superseded\b"))
    finally:
        configure_stub_now(stub_url, paused_models=[])
    playwright_api.expect(page.locator("#messages .msg-pending")).to_have_count(0)


def test_a_question_kept_by_a_compaction_after_a_retry_is_not_faded(
        watched: Watched) -> None:
    page = watched.page
    create_session(page)
    for n in range(3):  # long enough for a summary to free room
        send(page, f"question {n}: " + "the quick brown fox jumps over the lazy dog " * 12)
    page.locator("#messages .retry-button").click()
    answers = page.locator("#messages .msg-assistant")
    playwright_api.expect(answers).to_have_count(4)
    playwright_api.expect(answers.last.locator(".retry-button")).to_be_enabled()
    # The tail of one turn keeps the last question and its fresh answer.
    page.click("#compact-button")
    playwright_api.expect(page.locator("#messages .msg-divider")).to_have_count(1)
    # A result that came before the request's own answer was written over by
    # "Compaction requested", which then stayed.
    playwright_api.expect(page.locator("#compact-status")).to_contain_text("ompleted")
    faded = re.compile(r"\bmsg-compacted\b")
    last_question = page.locator("#messages .msg-user").last
    playwright_api.expect(last_question.locator(".msg-text")).to_contain_text("question 2")
    playwright_api.expect(last_question).not_to_have_class(faded)
    playwright_api.expect(page.locator("#messages .msg-superseded")).to_have_class(faded)
    playwright_api.expect(page.locator("#messages .msg-user").first).to_have_class(faded)
    playwright_api.expect(page.locator("#timeline .timeline-row")).to_have_count(1)


def test_a_thinking_models_thinking_stays_once_the_turn_is_stored(
        watched: Watched, system: System) -> None:
    """Thinking is never stored: drawn again from the stored transcript at the
    turn's end, the answer lost it some 20 ms after it was shown."""
    page = watched.page
    with system.client() as client:
        sid = new_session(client, model=THINKER)
    open_session(page, sid)
    send(page, "think about it")
    # Drawn from the stored transcript: its answer has no status line.
    playwright_api.expect(page.locator("#messages .msg-status")).to_have_count(0)
    thinking = page.locator("#messages .msg-assistant .msg-thinking")
    playwright_api.expect(thinking).to_have_count(1)
    playwright_api.expect(thinking.locator(".msg-text")).to_contain_text("Considering")


def test_a_reader_of_earlier_messages_stays_there_when_newer_ones_arrive(
        watched: Watched, system: System) -> None:
    """Every newer read scrolled to the end: a message sent elsewhere, a report,
    a compaction took the reader away from what they were reading."""
    page = watched.page
    with system.client() as client:
        sid = session_of_turns(client, 30)
        open_session(page, sid)
        box = page.locator("#messages")
        box.evaluate("box => { box.scrollTop = 300; }")
        assert ask(client, sid, "from elsewhere").status_code == 200
    users = page.locator("#messages .msg-user .msg-text")
    playwright_api.expect(users.last).to_have_text("from elsewhere")
    assert box.evaluate("box => box.scrollTop") == 300


HIDE = """() => {
  Object.defineProperty(document, "hidden", { value: true, configurable: true });
  Object.defineProperty(document, "visibilityState", { value: "hidden", configurable: true });
  document.dispatchEvent(new Event("visibilitychange"));
}"""
HIDDEN_FROM_THE_START = """
Object.defineProperty(document, "hidden", { value: true, configurable: true });
Object.defineProperty(document, "visibilityState", { value: "hidden", configurable: true });
"""
SHOW = """() => {
  delete document.hidden;
  delete document.visibilityState;
  document.dispatchEvent(new Event("visibilitychange"));
}"""


def test_tabs_in_the_background_leave_the_browser_connections_for_the_one_in_use(
        watched: Watched, browser: playwright_api.Browser, system: System) -> None:
    """A browser opens six connections to a host, for all its tabs: six tabs
    each holding its live feed open left none for a message, which waited
    without end."""
    page = watched.page
    sid = create_session(page)
    others = [page.context.new_page() for _ in range(5)]
    try:
        for other in others:
            open_session(other, sid)
            playwright_api.expect(other.locator("#live-status")).to_have_attribute(
                "data-live", "connected")
            other.evaluate(HIDE)
            playwright_api.expect(other.locator("#live-status")).to_have_attribute(
                "data-live", "paused")
        send(page, "heard through six tabs")
        others[0].evaluate(SHOW)  # shown again: its feed back, the session read anew
        playwright_api.expect(others[0].locator("#live-status")).to_have_attribute(
            "data-live", "connected")
        playwright_api.expect(others[0].locator("#messages .msg-user .msg-text").last
                              ).to_have_text("heard through six tabs")
    finally:
        for other in others:
            other.close()


def test_a_tab_opened_in_the_background_takes_its_feed_up_once_shown(
        watched: Watched, browser: playwright_api.Browser, system: System) -> None:
    sid = create_session(watched.page)
    background = watched.page.context.new_page()
    try:
        background.add_init_script(HIDDEN_FROM_THE_START)
        background.goto(f"/#session={sid}")
        playwright_api.expect(background.locator("#live-status")).to_have_attribute(
            "data-live", "paused")
        background.evaluate(SHOW)
        playwright_api.expect(background.locator("#live-status")).to_have_attribute(
            "data-live", "connected")
    finally:
        background.close()


def test_retry_stays_on_the_last_answer_after_a_compaction(watched: Watched) -> None:
    """The compaction's marker is the transcript's last item: Retry, offered
    only when the last item was an answer, was gone until the next turn."""
    page = watched.page
    create_session(page)
    for n in range(3):  # long enough for a summary to free room
        send(page, f"question {n}: " + "the quick brown fox jumps over the lazy dog " * 12)
    page.click("#compact-button")
    playwright_api.expect(page.locator("#messages .msg-divider")).to_have_count(1)
    answers = page.locator("#messages .msg-assistant")
    retry = answers.last.locator(".retry-button")
    playwright_api.expect(retry).to_be_enabled()
    retry.click()
    playwright_api.expect(answers).to_have_count(4)
    playwright_api.expect(page.locator("#messages .msg-pending")).to_have_count(0)
    playwright_api.expect(answers.last.locator(".msg-text")).to_contain_text("question 2")
    playwright_api.expect(answers.last.locator(".retry-button")).to_be_enabled()
    assert page.locator("#messages .msg-failed").count() == 0


def test_no_retry_once_a_compaction_folded_every_message(watched: Watched,
                                                          system: System) -> None:
    """A compaction that kept no message raw leaves no question to answer
    again: Retry, offered past its marker, could only be refused."""
    page = watched.page
    create_session(page)
    send(page, "tell me everything !long 100000")  # fills the window: past the emergency line
    page.click("#compact-button")
    playwright_api.expect(page.locator("#messages .msg-divider")).to_have_count(1)
    playwright_api.expect(page.locator("#state-badge")).to_have_attribute("data-state", "idle")
    sid = page.evaluate("localStorage.getItem('chat.currentSession')")
    with system.client() as client:
        kept = client.get(f"/api/sessions/{sid}").json()["messages"]
        refused = client.post(f"/api/sessions/{sid}/retry")
    assert kept == [] and refused.json()["error"]["code"] == "nothing_to_retry"
    assert page.locator("#messages .retry-button").count() == 0

HEBREW = "שלום, עולם!"
DIRECTION = "node => getComputedStyle(node).direction"
LAST_DIRECTION_IS = """([selector, want]) => {
  const node = [...document.querySelectorAll(`#messages ${selector}`)].at(-1);
  return node !== undefined && getComputedStyle(node).direction === want;
}"""


def test_right_to_left_text_runs_right_to_left(watched: Watched) -> None:
    """Hebrew in a bubble, the composer or the system prompt was laid out
    left to right, its punctuation on the wrong side."""
    page = watched.page
    page.click("#new-session-button")
    page.fill("#new-system", "ענה בעברית.")
    page.click("#new-session-create")
    playwright_api.expect(page.locator("#state-badge")).to_have_attribute("data-state", "idle")
    playwright_api.expect(page.locator("#system-text")).to_have_text("ענה בעברית.")
    assert page.locator("#system-text").evaluate(DIRECTION) == "rtl"
    page.fill("#message-input", HEBREW)
    assert page.locator("#message-input").evaluate(DIRECTION) == "rtl"
    send(page, HEBREW)
    user = page.locator("#messages .msg-user .msg-text").last
    playwright_api.expect(user).to_have_text(HEBREW)
    # Read as the list stands once drawn again: a bubble read while the
    # transcript was redrawn was already detached, its direction "".
    page.wait_for_function(LAST_DIRECTION_IS, arg=[".msg-user .msg-text", "rtl"])
    # Each text takes its own direction: the answer begins in Latin letters.
    answer = page.locator("#messages .msg-assistant .msg-text").last
    playwright_api.expect(answer).to_have_text(re.compile(r"^Echo: "))
    page.wait_for_function(LAST_DIRECTION_IS, arg=[".msg-assistant .msg-text", "ltr"])
    texts = page.locator(".msg-text, .pre-text")
    assert texts.count() >= 4
    for n in range(texts.count()):
        playwright_api.expect(texts.nth(n)).to_have_attribute("dir", "auto")


# 39 letters and an emoji (two UTF-16 units): the 40th unit is half of it.
LABEL_IS = """([id, label]) => JSON.parse(localStorage.getItem("chat.sessions") || "[]")
  .some((s) => s.id === id && s.label === label)
  && document.querySelector(`#session-select option[value="${id}"]`)
    .textContent.startsWith(label)"""


@pytest.mark.parametrize("emoji", ["😀", "🇫🇷"])
def test_a_session_label_never_ends_in_half_an_emoji(
        watched: Watched, system: System, emoji: str) -> None:
    """Cut at 40 UTF-16 units, the label ended in a lone surrogate, shown as
    �; cut at 40 code points, a flag ended as one of its two letters."""
    message = "a" * 39 + emoji + " and the rest of the message"
    label = "a" * 39 + emoji
    page = watched.page
    sid = create_session(page)
    send(page, message)  # labelled as it is sent
    page.wait_for_function(LABEL_IS, arg=[sid, label])
    with system.client() as client:
        other = new_session(client)
        assert ask(client, other, message).status_code == 200
    open_session(page, other)  # labelled as it is read
    page.wait_for_function(LABEL_IS, arg=[other, label])


def test_retry_waits_while_the_session_answers_another_tabs_message(
        watched: Watched, system: System, stub_url: str) -> None:
    """Retry looked only at this tab's own turn: clicked while the session
    answered another tab's message, it failed with turn_running."""
    page = watched.page
    with system.client() as client:
        sid = session_of_turns(client, 1)
    open_session(page, sid)
    retry = page.locator("#messages .msg-assistant").last.locator(".retry-button")
    playwright_api.expect(retry).to_be_enabled()
    with another_tab_answering(page, stub_url, sid):  # told by the live feed...
        playwright_api.expect(retry).to_be_disabled()
        # ...and by a read, reloaded mid-answer.
        page.reload()
        playwright_api.expect(page.locator("#state-badge")).to_have_attribute(
            "data-state", "generating")
        playwright_api.expect(retry).to_be_disabled()
    answer = page.locator("#messages .msg-assistant").last
    playwright_api.expect(answer.locator(".msg-text")).to_have_text(
        re.compile(r"^Echo: from the other tab"))
    playwright_api.expect(answer.locator(".retry-button")).to_be_enabled()
    playwright_api.expect(page.locator("#messages .retry-button")).to_have_count(1)


def test_deleting_the_session_shown_leaves_nothing_of_it_behind(
        watched: Watched, stub_url: str) -> None:
    """Deleted, the session's badge, gauges, log and Export links stayed, its
    answer being streamed went back into the disabled composer, and a reload
    opened it again, to say it does not exist."""
    page = watched.page
    create_session(page)
    send(page, "first question")
    last_prompt = page.locator("#gauge-last-text")
    playwright_api.expect(last_prompt).to_contain_text("next prompt")
    page.evaluate("() => { window.confirm = () => true; }")  # Delete asks first
    with answer_under_way(page, stub_url, "a message being answered"):
        page.click("#delete-button")
        playwright_api.expect(page.locator("#notice")).to_contain_text("was deleted")
        playwright_api.expect(page.locator("#state-badge")).to_have_attribute(
            "data-state", "unknown")
        playwright_api.expect(page.locator("#gauge")).to_have_attribute("aria-valuenow", "0")
        playwright_api.expect(last_prompt).to_have_text("No generation yet.")
        playwright_api.expect(page.locator("#log .log-line")).to_have_count(0)
        playwright_api.expect(page.locator("#stop-button")).to_be_hidden()
        playwright_api.expect(page.locator("#messages .msg")).to_have_count(0)
        assert page.get_attribute("#export-markdown", "href") is None
        assert page.get_attribute("#export-json", "href") is None
        assert page.evaluate("localStorage.getItem('chat.currentSession')") is None
    composer = page.locator("#message-input")
    playwright_api.expect(composer).to_be_disabled()
    playwright_api.expect(composer).to_have_value("")
    # A read of the session already on its way when the delete landed is
    # answered 404, which the page lets go; the browser logs it all the same.
    watched.problems[:] = [p for p in watched.problems if "status of 404" not in p]
    page.reload()
    playwright_api.expect(page.locator("#empty-hint")).to_contain_text("Create a session")
    playwright_api.expect(page.locator("#notice")).to_be_hidden()


def test_an_answer_that_came_after_all_shows_once(watched: Watched) -> None:
    """The stream lost but the message answered: the stored question and
    answer showed, and below them the same question again with its failed
    bubble and Send again, until the next turn."""
    page = watched.page
    # No live feed until the failed bubble is seen. With one, the turn's
    # report, or the read the feed asks for as it opens (still on its way as
    # the message went), read the session anew and took the bubble away, at
    # times before it was looked for. Taken up later, the feed reads it anew.
    page.evaluate(HIDE)
    create_session(page)
    def lose_the_answer(route: playwright_api.Route) -> None:
        route.fetch()  # the gateway takes the message and answers it...
        route.abort()  # ...and the page never hears of it

    page.route("**/api/sessions/*/messages", first_request_only(lose_the_answer)[0])
    page.fill("#message-input", "hello")
    page.click("#send-button")
    playwright_api.expect(page.locator("#messages .msg-failed .send-again-button")
                          ).to_be_enabled()
    page.evaluate(SHOW)
    stored = page.locator("#messages .msg-assistant", has_text="Echo: hello (turn 1)")
    playwright_api.expect(stored).to_have_count(1)
    playwright_api.expect(page.locator("#messages .msg-failed")).to_have_count(0)
    playwright_api.expect(page.locator("#messages .msg-user")).to_have_count(1)
    playwright_api.expect(page.locator("#messages .msg-assistant")).to_have_count(1)
    network_failures_only(watched)  # the aborted request, cut on purpose


def test_a_reload_mid_answer_shows_the_turn_under_way_and_stop_still_ends_it(
        watched: Watched, stub_url: str) -> None:
    """Reloaded while its answer was written, the page showed neither the
    question nor the answer, and offered Send, not Stop, until it was stored."""
    page = watched.page
    create_session(page)
    with answer_under_way(page, stub_url, "a question cut by a reload"):
        page.reload()
        playwright_api.expect(page.locator("#messages .msg-user")).to_have_text(
            re.compile("a question cut by a reload"))
        playwright_api.expect(page.locator("#messages .msg-pending")).to_have_count(1)
        # Whose turn the session's state is, a resumed answer cannot tell: it
        # claims neither a queue nor the model.
        playwright_api.expect(page.locator("#messages .msg-pending .msg-status")).to_have_text(
            "sent earlier from this tab: waiting for its answer…")
        stop_button = page.locator("#stop-button")
        playwright_api.expect(stop_button).to_be_visible()
        stop_button.click()
        playwright_api.expect(page.locator("#messages .msg-pending")).to_have_count(0)
    answer = page.locator("#messages .msg-assistant")
    playwright_api.expect(answer).to_have_count(1)
    playwright_api.expect(answer.locator(".msg-tag")).to_have_text("stopped")
    playwright_api.expect(page.locator("#messages .msg-user")).to_have_count(1)
    playwright_api.expect(page.locator("#send-button")).to_be_visible()
    # Heard to its end, the turn is not kept, nor read again by the next reload.
    assert page.evaluate(KEPT_TURNS) == []
    page.reload()
    # Stopped mid-stream, the answer has no counts: the page says so, as it
    # did before the reload, rather than that nothing was generated.
    playwright_api.expect(page.locator("#gauge-last-text")).to_have_text(
        "The model did not report prompt tokens for the last call.")
    playwright_api.expect(answer.locator(".msg-tag")).to_have_text("stopped")
    playwright_api.expect(page.locator("#messages .msg-pending")).to_have_count(0)
    playwright_api.expect(page.locator("#send-button")).to_be_visible()


KEPT_TURNS = "() => Object.keys(sessionStorage).filter((k) => k.startsWith('chat.turnUnderWay.'))"


def test_a_kept_retry_of_a_message_no_longer_the_last_is_let_go(
        watched: Watched, system: System) -> None:
    """/retry answers whichever message is last when it comes: a retry kept
    from before another message was answered would replace that one's answer."""
    page = watched.page
    with system.client() as client:
        sid = session_of_turns(client, 2)
    kept = {"key": "a-retry-sent-earlier", "retry": True, "content": "t0",
            "at": int(time.time() * 1000)}
    page.evaluate("([sid, kept]) => sessionStorage.setItem(`chat.turnUnderWay.${sid}`, kept)",
                  [sid, json.dumps(kept)])
    open_session(page, sid)
    playwright_api.expect(page.locator("#messages .msg-assistant")).to_have_count(2)
    page.wait_for_function(f"() => ({KEPT_TURNS})().length === 0")
    playwright_api.expect(page.locator("#messages .msg-pending")).to_have_count(0)
    with system.client() as client:
        context = client.get(f"/api/sessions/{sid}").json()["messages"]
    assert [m["content"] for m in context] == ["t0", "Echo: t0 (turn 1)", "t1",
                                               "Echo: t1 (turn 2)"]


def test_an_answer_left_for_another_session_shows_once_on_coming_back(
        watched: Watched, system: System, stub_url: str) -> None:
    page = watched.page
    sid = create_session(page)
    with system.client() as client:
        other = new_session(client)
    with answer_under_way(page, stub_url, "a question left behind"):
        open_session(page, other)
        page.goto(f"/#session={sid}")
        playwright_api.expect(page.locator("#messages .msg-pending")).to_have_count(1)
        playwright_api.expect(page.locator("#stop-button")).to_be_visible()
    answer = page.locator("#messages .msg-assistant")
    playwright_api.expect(answer.locator(".msg-text")).to_have_text(
        re.compile(r"^Echo: a question left behind"))
    playwright_api.expect(page.locator("#messages .msg-pending")).to_have_count(0)
    playwright_api.expect(answer).to_have_count(1)
    playwright_api.expect(page.locator("#messages .msg-user")).to_have_count(1)


def test_a_page_opened_after_a_turn_shows_its_counts_and_the_last_prompt(
        watched: Watched, system: System) -> None:
    """Read from storage, answers showed no counts, and the last prompt's gauge
    said "No generation yet." until the next turn."""
    page = watched.page
    with system.client() as client:
        sid = session_of_turns(client, 2)
    open_session(page, sid)
    counts = page.locator("#messages .msg-assistant .msg-counts")
    playwright_api.expect(counts).to_have_count(2)
    playwright_api.expect(counts.last).to_have_text(
        re.compile(r"^prompt \d[\d,]* · completion \d[\d,]* tokens$"))
    prompt = counts.last.inner_text().split()[1]
    playwright_api.expect(page.locator("#gauge-last-text")).to_contain_text(
        f"{prompt} / 2,048 tokens")


@contextlib.contextmanager
def threshold_live(nats_url: str, system: System, sid: str, value: bytes) -> Iterator[None]:
    """The compaction threshold put live for the block; then deleted, and read
    back at its start (0, off) before the module's later tests."""
    put_live_setting(nats_url, "compaction_threshold", value)
    try:
        yield
    finally:
        put_live_setting(nats_url, "compaction_threshold", None)
        with system.client() as client:
            until(lambda: client.get(f"/api/sessions/{sid}").json()["compacts_at"] is None,
                  "the threshold back to its start")


def session_without_a_threshold(page: playwright_api.Page
                                ) -> tuple[str, playwright_api.Locator, playwright_api.Locator]:
    """A new session, and the gauge's text and threshold mark, shown with
    automatic compaction off (this module's threshold is 0)."""
    sid = create_session(page)
    text, mark = page.locator("#gauge-text"), page.locator("#gauge-threshold")
    playwright_api.expect(text).to_contain_text("automatic compaction off")
    return sid, text, mark


def test_the_gauge_marks_where_automatic_compaction_begins(
        watched: Watched, system: System, nats_url: str) -> None:
    page = watched.page
    sid, text, mark = session_without_a_threshold(page)
    playwright_api.expect(mark).to_be_hidden()
    with threshold_live(nats_url, system, sid, b"0.5"), system.client() as client:
        def read() -> dict[str, object]:
            return dict(client.get(f"/api/sessions/{sid}").json())
        until(lambda: read()["compacts_at"] is not None, "the threshold read")
        session = read()
        page.reload()
        playwright_api.expect(text).to_contain_text(f"compacts from {session['compacts_at']:,}")
        playwright_api.expect(mark).to_be_visible()
        assert session["compacts_at"] == math.ceil(int(str(session["budget"])) / 2)


def test_what_happened_before_the_live_feed_listened_is_read_once_it_does(
        watched: Watched, system: System) -> None:
    """The session was read as it opened, its feed opened beside the read: a
    turn answered between the read and the feed's listening was not shown."""
    page = watched.page
    with system.client() as client:
        sid = new_session(client)
    held: list[playwright_api.Route] = []
    page.route("**/api/events*", lambda route: held.append(route))  # held back, unanswered
    page.goto(f"/#session={sid}")
    playwright_api.expect(page.locator("#empty-hint")).to_be_visible()  # read: no messages yet
    with system.client() as client:
        assert ask(client, sid, "said while the page was not listening").status_code == 200
    for route in held:
        route.continue_()
    page.unroute("**/api/events*")
    playwright_api.expect(page.locator("#live-status")).to_have_attribute("data-live",
                                                                         "connected")
    playwright_api.expect(page.locator("#messages .msg-assistant")).to_have_text(
        re.compile("Echo: said while the page was not listening"))


def test_the_gauge_follows_a_live_change_of_the_threshold_without_a_reload(
        watched: Watched, system: System, nats_url: str) -> None:
    """The mark moved only at the session's next read: after the next message."""
    page = watched.page
    sid, text, mark = session_without_a_threshold(page)
    playwright_api.expect(page.locator("#live-status")).to_have_attribute("data-live",
                                                                         "connected")
    with threshold_live(nats_url, system, sid, b"0.5"):
        playwright_api.expect(text).to_contain_text("compacts from ")
        playwright_api.expect(mark).to_be_visible()
        playwright_api.expect(page.locator("#log")).to_contain_text(
            "live settings changed (compaction threshold 0.5)")
    playwright_api.expect(text).to_contain_text("automatic compaction off")


def test_a_next_prompt_over_the_budget_says_what_the_next_message_meets(
        watched: Watched, system: System, nats_url: str) -> None:
    """A long answer may use the window's room past the budget: the gauge
    then read only a percentage over 100, as if the window had overflowed."""
    page = watched.page
    sid = create_session(page)
    send(page, LONG_QUESTION)
    text = page.locator("#gauge-text")
    # Automatic compaction is off in this module: the next message would be refused.
    playwright_api.expect(text).to_contain_text("over the budget: compact before the next message")
    with threshold_live(nats_url, system, sid, b"0.5"):
        with system.client() as client:
            until(lambda: client.get(f"/api/sessions/{sid}").json()["compacts_at"] is not None,
                  "the threshold read")
        page.reload()
        playwright_api.expect(text).to_contain_text(
            "over the budget: the next message compacts first")


def test_a_resumed_answer_goes_on_streaming(watched: Watched, stub_url: str) -> None:
    """Tokens went only to the request first sent: a reloaded page saw nothing
    more of the answer until it was whole, for minutes with a long one."""
    page = watched.page
    create_session(page)
    pending = page.locator("#messages .msg-pending")
    configure_stub_now(stub_url, ms_per_token=5)
    try:
        page.fill("#message-input", LONG_QUESTION)
        page.click("#send-button")
        playwright_api.expect(pending.locator(".msg-text")).not_to_have_text("")
        page.reload()
        playwright_api.expect(pending.locator(".msg-text")).to_have_text(re.compile(r"^… \S"))
        playwright_api.expect(pending.locator(".msg-status")).to_have_text("writing…")
        page.click("#stop-button")
        playwright_api.expect(pending).to_have_count(0)
    finally:
        configure_stub_now(stub_url, ms_per_token=0)


def test_a_retry_cut_by_a_reload_still_marks_the_answer_it_replaces(
        watched: Watched, stub_url: str) -> None:
    page = watched.page
    create_session(page)
    send(page, "hello")
    configure_stub_now(stub_url, paused_models=[ANSWER_MODEL])
    try:
        page.locator("#messages .retry-button").click()
        playwright_api.expect(page.locator("#messages .msg-pending .msg-text")
                              ).not_to_have_text("")
        page.reload()
        playwright_api.expect(page.locator("#messages .msg-pending")).to_have_count(1)
        old = page.locator("#messages .msg-assistant").first
        playwright_api.expect(old.locator(".msg-tag")).to_have_text("superseded")
        playwright_api.expect(old.locator(".retry-button")).to_be_hidden()
    finally:
        configure_stub_now(stub_url, paused_models=[])
    answers = page.locator("#messages .msg-assistant")
    playwright_api.expect(page.locator("#messages .msg-pending")).to_have_count(0)
    playwright_api.expect(answers).to_have_count(2)
    playwright_api.expect(answers.first.locator(".msg-tag")).to_have_text("superseded")


def deletes_refused(watched: Watched) -> playwright_api.Page:
    """A session open on the page, whose deletes the gateway refuses (503)."""
    page = watched.page
    create_session(page)
    page.evaluate("() => { window.confirm = () => true; }")  # Delete asks first
    watched.ignore("status of 503")  # the delete refused on purpose
    page.route("**/api/sessions/*", lambda route: route.fulfill(
        status=503, json={"error": {"code": "nats_unavailable", "message": "NATS is away"}})
        if route.request.method == "DELETE" else route.continue_())
    return page


def test_a_refused_delete_stays_said_through_the_sessions_later_reads(
        watched: Watched) -> None:
    """The page reads its session again whenever its live feed opens and after
    every turn; those reads took away whatever notice was shown, so a refused
    delete was said and then, a moment later, no longer."""
    page = deletes_refused(watched)
    page.click("#delete-button")
    notice = page.locator("#notice")
    playwright_api.expect(notice).to_contain_text("Could not delete the session")
    send(page, "a message after the refused delete")
    # The turn's end reads the session; its two messages show once that read is in.
    playwright_api.expect(page.locator("#fact-messages")).to_have_text("2")
    playwright_api.expect(notice).to_contain_text("Could not delete the session")


def test_a_delete_that_fails_picks_the_answer_under_way_up_again(
        watched: Watched, stub_url: str) -> None:
    page = deletes_refused(watched)
    with answer_under_way(page, stub_url, "a message outliving a delete"):
        page.click("#delete-button")
        playwright_api.expect(page.locator("#notice")).to_contain_text(
            "Could not delete the session")
        playwright_api.expect(page.locator("#messages .msg-pending")).to_have_count(1)
        playwright_api.expect(page.locator("#stop-button")).to_be_visible()
    playwright_api.expect(page.locator("#messages .msg-assistant .msg-text")).to_have_text(
        re.compile(r"^Echo: a message outliving a delete"))
    playwright_api.expect(page.locator("#messages .msg-failed")).to_have_count(0)
    playwright_api.expect(page.locator("#messages .msg-assistant")).to_have_count(1)


def test_a_message_whose_send_again_was_offered_is_not_sent_by_a_reload(
        watched: Watched, system: System) -> None:
    """Kept for Send again, it was sent by the next reload, unasked."""
    page = watched.page
    sid = create_session(page)
    page.route("**/api/sessions/*/messages",
               first_request_only(lambda route: route.abort())[0])
    page.fill("#message-input", "never sent")
    page.click("#send-button")
    playwright_api.expect(page.locator("#messages .msg-failed .send-again-button")
                          ).to_be_enabled()
    page.reload()
    playwright_api.expect(page.locator("#state-badge")).to_have_attribute("data-state", "idle")
    assert page.evaluate(KEPT_TURNS) == []
    with system.client() as client:
        assert client.get(f"/api/sessions/{sid}").json()["messages"] == []
    network_failures_only(watched)


def test_after_a_gap_in_the_live_feed_the_last_prompt_is_the_newest_answers(
        watched: Watched, system: System) -> None:
    """A report missed while the feed was down left the gauge on an older one."""
    page = watched.page
    sid = create_session(page)
    send(page, "short")
    last = page.locator("#gauge-last-text")
    playwright_api.expect(last).to_contain_text("next prompt")  # from the turn's report
    page.evaluate(HIDE)
    with system.client() as client:
        newer = ask(client, sid, "a longer question " * 20).json()["prompt_tokens"]
    page.evaluate(SHOW)
    playwright_api.expect(page.locator("#messages .msg-assistant")).to_have_count(2)
    playwright_api.expect(last).to_contain_text(f"{newer:,} / 2,048 tokens")


def test_a_session_opened_while_a_delete_is_on_its_way_stays_shown(
        watched: Watched, system: System) -> None:
    """The delete's end cleared whatever session was shown by then, and left
    its live feed running for a session the page no longer showed."""
    page = watched.page
    deleted = create_session(page)
    with system.client() as client:
        other = session_of_turns(client, 1)
    page.evaluate("() => { window.confirm = () => true; }")  # Delete asks first
    held: list[playwright_api.Route] = []
    page.route("**/api/sessions/*", lambda route: held.append(route)
               if route.request.method == "DELETE" else route.continue_())
    with page.expect_request(lambda r: r.method == "DELETE"):
        page.click("#delete-button")
    page.evaluate("(id) => { location.hash = `session=${id}`; }", other)
    playwright_api.expect(page.locator("#messages .msg-assistant")).to_have_count(1)
    held[0].continue_()
    page.wait_for_function("(id) => !JSON.parse(localStorage.getItem('chat.sessions') || '[]')"
                           ".some((s) => s.id === id)", arg=deleted)
    playwright_api.expect(page.locator("#messages .msg-assistant")).to_have_count(1)
    playwright_api.expect(page.locator("#state-badge")).to_have_attribute("data-state", "idle")
    playwright_api.expect(page.locator("#message-input")).to_be_enabled()
    assert page.evaluate("decodeURIComponent(location.hash)") == f"#session={other}"


def test_the_timeline_is_read_when_a_session_opens_and_a_compaction_ends_only(
        watched: Watched) -> None:
    """Every turn's report read the newest 100 compactions again."""
    page = watched.page
    timeline_reads: list[str] = []
    page.on("request", lambda r: timeline_reads.append(r.url)
            if "kind=compaction" in r.url else None)
    create_session(page)
    for n in range(3):
        send(page, f"turn {n}: " + "the quick brown fox jumps over the lazy dog " * 12)
    playwright_api.expect(page.locator("#gauge-last-text")).to_contain_text("next prompt")
    assert len(timeline_reads) == 1, timeline_reads
    page.click("#compact-button")
    playwright_api.expect(page.locator("#compact-status")).to_contain_text(
        "Compaction completed")
    playwright_api.expect(page.locator("#timeline .timeline-row")).to_have_count(1)
    assert len(timeline_reads) == 2, timeline_reads


def test_the_conversation_says_it_is_busy_while_the_session_is_read(watched: Watched) -> None:
    page = watched.page
    sid = create_session(page)
    messages = page.locator("#messages")
    playwright_api.expect(messages).to_have_attribute("aria-busy", "false")
    held: list[playwright_api.Route] = []
    page.route(f"**/api/sessions/{sid}", first_request_only(held.append)[0])
    page.reload()  # its first read of the session held back, unanswered
    playwright_api.expect(messages).to_have_attribute("aria-busy", "true")
    held[0].continue_()
    playwright_api.expect(page.locator("#state-badge")).to_have_attribute("data-state", "idle")
    playwright_api.expect(messages).to_have_attribute("aria-busy", "false")


def test_a_transcript_read_that_finds_the_session_gone_closes_it(
        watched: Watched, system: System) -> None:
    """Deleted between the session's read and its transcript's: the page said
    it could not load the transcript, and left the session open to messages."""
    page = watched.page
    watched.ignore("status of 404")
    # No live feed: its `session.deleted`, or the read it asks for as it
    # opens, would close the session by another way.
    page.evaluate(HIDE)
    with system.client() as client:
        sid = new_session(client)

    def deleted_first(route: playwright_api.Route) -> None:
        with system.client() as client:
            assert client.delete(f"/api/sessions/{sid}").status_code == 204
        route.continue_()  # answered 404 by the gateway

    page.route("**/transcript?before=end&limit=*", first_request_only(deleted_first)[0])
    page.goto(f"/#session={sid}")
    playwright_api.expect(page.locator("#notice")).to_contain_text(
        f"Session {sid} does not exist (any more)")
    playwright_api.expect(page.locator("#message-input")).to_be_disabled()


def test_a_session_deleted_elsewhere_is_closed_before_a_message_goes_into_it(
        watched: Watched, system: System) -> None:
    page = watched.page
    watched.ignore("status of 404")  # the read that finds it gone
    sid = create_session(page)
    playwright_api.expect(page.locator("#live-status")).to_have_attribute("data-live", "connected")
    # Until the read the feed asks for as it opens has ended: answered after
    # the delete, it found the session gone and closed the feed before the
    # feed's event came.
    playwright_api.expect(page.locator("#messages")).to_have_attribute("aria-busy", "false")
    with system.client() as client:
        assert client.delete(f"/api/sessions/{sid}").status_code == 204
    playwright_api.expect(page.locator("#notice")).to_contain_text("does not exist (any more)")
    playwright_api.expect(page.locator("#message-input")).to_be_disabled()
    playwright_api.expect(page.locator("#log")).to_contain_text("the session was deleted")


def test_a_state_change_the_feed_brings_late_is_passed_over(
        watched: Watched, nats_url: str, system: System) -> None:
    """The live feed may bring a turn's last changes after the read that saw
    it end: "generating" then stood for the session's state, and Retry was
    off until the next change, a click on it lost."""
    page = watched.page
    sid = create_session(page)
    send(page, "first")
    badge = page.locator("#state-badge")
    playwright_api.expect(badge).to_have_attribute("data-state", "idle")
    with system.client() as client:
        generator = client.get(f"/api/sessions/{sid}").json()["state_by"]
    late = Envelope[StateChange](
        message_type=StateChange.MESSAGE_TYPE, subject=subjects.state(sid),
        sender_id="generator", session_id=sid, timestamp=utc_now() - timedelta(minutes=1),
        payload=StateChange(session_id=sid, from_state="receiving", to_state="generating",
                            action="start_generation", generator_id=generator))
    publish_now(nats_url, subjects.state(sid), late.model_dump_json().encode())
    playwright_api.expect(page.locator("#log")).to_contain_text("late, passed over")
    playwright_api.expect(badge).to_have_attribute("data-state", "idle")
    playwright_api.expect(page.locator("#messages .retry-button")).to_be_enabled()


def test_stop_on_a_message_still_queued_withdraws_it(watched: Watched, stub_url: str) -> None:
    """Refused before (nothing of it was being written): the message was then
    answered after the other, though its Stop was pressed."""
    page = watched.page
    watched.ignore("status of 409")  # the withdrawn message's own request
    sid = create_session(page)
    with another_tab_answering(page, stub_url, sid):
        page.fill("#message-input", "queued behind it")
        page.click("#send-button")
        status = page.locator("#messages .msg-assistant .msg-status").last
        playwright_api.expect(status).to_contain_text("queued")
        page.click("#stop-button")
        playwright_api.expect(status).to_contain_text("withdrawn before its turn")
        playwright_api.expect(page.locator("#messages .msg-user.msg-withdrawn")).to_have_text(
            re.compile("queued behind it"))
        playwright_api.expect(page.locator("#message-input")).to_have_value("queued behind it")
        playwright_api.expect(page.locator("#send-button")).to_be_visible()
    page.reload()
    playwright_api.expect(page.locator("#messages .msg-assistant")).to_have_count(1)
    playwright_api.expect(page.locator("#messages")).not_to_contain_text("queued behind it")
