// The chat view: the transcript (pages, compaction dividers, faded and
// superseded messages), the turn not yet stored (its question, and its answer
// being streamed: answer.js), the composer (send, stop, retry), and a turn cut
// by a reload or a visit elsewhere, read again.

import { API, newKey, postStop, postTurn, queryIdFor, readError, requestJson } from "./api.js";
import {
  announce, app, clearNotice, el, fmt, lastItem, nearBottom, scrollToEnd, show, showNotice, ui,
} from "./shared.js";
import { SseParser } from "./sse.js";
import { renderCompactButton, renderGauge } from "./panel.js";
import { forgetKeptTurn, leaving, readKeptTurn, saveKeptTurn } from "./kept.js";
import {
  OWN_DIRECTION, PendingAnswer, offersSendAgain, thinkingBlock, thoughts, tokenCounts,
} from "./answer.js";

const TRANSCRIPT_PAGE = 100;

// The phases in which the session takes a retry: in any other, it is answering
// a message (this tab's, or one sent from elsewhere) and /retry answers
// 409 turn_running.
const RETRY_PHASES = ["idle", "error"];

// A compaction marker's one line: "compacted · automatic · 1,255 → 1,002 tokens · 14:02".
export function dividerText(marker) {
  const parts = ["compacted"];
  if (marker.auto === true) parts.push("automatic");
  if (marker.auto === false) parts.push("manual");
  if (marker.level && marker.level !== "gentle") parts.push(marker.level);
  if (Number.isFinite(marker.tokens_before) && Number.isFinite(marker.tokens_after)) {
    parts.push(`${fmt(marker.tokens_before)} → ${fmt(marker.tokens_after)} tokens`);
  }
  const at = marker.at ? new Date(marker.at) : null;
  if (at && !Number.isNaN(at.getTime())) {
    const two = (n) => String(n).padStart(2, "0");
    parts.push(`${two(at.getHours())}:${two(at.getMinutes())}`);
  }
  return parts.join(" · ");
}

// Indexes of the transcript items (oldest first) no longer in the model's context:
// the messages before the latest compaction marker, except the ones it kept.
// An answer a retry replaced before the marker had left the context already,
// so it is not one of the kept ones the marker counts.
export function fadedIndexes(items) {
  const faded = new Set();
  let last = -1;
  items.forEach((item, i) => { if (item.kind === "compaction") last = i; });
  if (last < 0) return faded;
  const replaced = supersededIndexes(items.slice(0, last));
  let keep = Number(items[last].kept_messages) || 0;
  for (let i = last - 1; i >= 0; i -= 1) {
    if (items[i].kind !== "message") continue;
    if (keep > 0 && !replaced.has(i)) keep -= 1;
    else faded.add(i);
  }
  return faded;
}

// Indexes of the answers a retry replaced: the messages of a query that a
// later item `supersedes`. They stay in the transcript, out of the context.
export function supersededIndexes(items) {
  const replaced = new Set(items.map((item) => item.supersedes).filter(Boolean));
  const indexes = new Set();
  items.forEach((item, i) => {
    if (item.kind === "message" && item.role !== "user" && replaced.has(item.query_id)) indexes.add(i);
  });
  return indexes;
}

const ROLE_LABEL = { user: "You", assistant: "Assistant", tool: "Tool result" };

function renderToolCall(call) {
  let args;
  try {
    args = JSON.stringify(call.arguments ?? {}, null, 2);
  } catch {
    args = String(call.arguments);
  }
  return el("div", { className: "tool-call" }, [
    el("div", { className: "tool-call-head" }, [
      el("span", { className: "tool-tag", text: "tool call" }),
      el("span", { className: "tool-name", text: call.name ?? "?" }),
    ]),
    el("pre", { className: "tool-args", text: args }),
  ]);
}

function messageItem(message) {
  const role = ["user", "assistant", "tool"].includes(message.role) ? message.role : "other";
  const item = el("li", { className: `msg msg-${role}` });
  const head = el("div", { className: "msg-head" }, [
    el("span", { className: "msg-role", text: ROLE_LABEL[role] ?? message.role }),
  ]);
  if (role === "tool" && message.tool_name) {
    head.append(el("span", { className: "tool-name", text: message.tool_name }));
  }
  if (message.stopped) head.append(el("span", { className: "msg-tag", text: "stopped" }));
  item.append(head);
  const thinking = role === "assistant" && !message.tool_calls?.length && thoughts.get(message.query_id);
  if (thinking) item.append(thinkingBlock(thinking));
  if (role === "tool") {
    item.append(el("pre", { className: "tool-result", text: message.content ?? "" }));
  } else if (message.content) {
    item.append(el("div", { className: "msg-text", text: message.content, attrs: OWN_DIRECTION }));
  }
  for (const call of message.tool_calls ?? []) item.append(renderToolCall(call));
  if (role === "assistant" && typeof message.prompt_tokens === "number") {
    item.append(el("div", { className: "msg-counts", text: tokenCounts(message) }));
  }
  return item;
}

// Summaries the reader opened, by position: drawn again, they stay open.
const openDividers = new Set();

function dividerItem(marker) {
  const details = el("details", { className: "divider-details" }, [
    el("summary", { text: dividerText(marker) }),
    el("p", {
      className: "pre-text",
      text: marker.summary ?? "(no summary: old tool output elided)",
      attrs: OWN_DIRECTION,
    }),
  ]);
  details.open = openDividers.has(marker.position);
  details.addEventListener("toggle", () => {
    if (details.open) openDividers.add(marker.position);
    else openDividers.delete(marker.position);
  });
  return el("li", { className: "msg-divider", attrs: { role: "separator" } }, [details]);
}

// The turn not yet in the stored transcript: its user message (none for a
// retry) and its answer bubble, streaming or failed. Drawing the transcript
// again puts them back after it: dropped, the message would vanish unseen,
// and the answer's tokens, its error and Send again would go to a bubble no
// longer on the page. The turn's stored messages take their place once it is
// answered; a new turn, Send again or another session lets them go. Each
// carries its turn's query id (data-query-id), once known.
let unsaved = [];

// An unsaved turn the stored transcript holds after all (its answer came
// though its stream was lost) shows from the transcript only, not twice.
function dropStoredTurns() {
  const stored = new Set(app.items.map((item) => item.query_id).filter(Boolean));
  unsaved = unsaved.filter((node) => !stored.has(node.dataset.queryId));
}

// Names the unsaved turn's nodes by its query id: the page never hears it
// when the answer's stream is lost, but can work it out from the key.
async function tagUnsaved(nodes, sessionId, key, retry) {
  const queryId = await queryIdFor(sessionId, key, retry).catch(() => null);
  if (queryId) for (const node of nodes) node.dataset.queryId = queryId;
}

// The whole transcript loaded so far; older pages come as the list scrolls up.
function renderTranscript({ toEnd = false } = {}) {
  const faded = fadedIndexes(app.items);
  const superseded = supersededIndexes(app.items);
  const nodes = app.items.map((item, i) => {
    if (item.kind === "compaction") return dividerItem(item);
    const node = messageItem(item);
    if (faded.has(i)) {
      node.classList.add("msg-compacted");
      node.title = "Compacted: no longer in the model's context";
    }
    if (superseded.has(i)) markSuperseded(node);
    return node;
  });
  const answer = retriableIndex(app.items);
  if (answer >= 0) nodes[answer].append(el("div", { className: "msg-actions" }, [retryButton()]));
  if (app.older) nodes.unshift(el("li", { className: "msg-more", text: "Scroll up for earlier messages…" }));
  dropStoredTurns();
  ui.messages.replaceChildren(...nodes, ...unsaved);
  const empty = nodes.length === 0 && unsaved.length === 0;
  show(ui.emptyHint, empty);
  if (empty) ui.emptyHint.textContent = "No messages yet — say something.";
  if (toEnd) scrollToEnd(true);
}

// Index of the answer Retry stands under: the last message, when it is an
// assistant's answer (not a tool call). A compaction marker after it does not
// count: a compaction changes the context, not the last answer, and /retry
// still answers it; unless it kept no message raw, leaving no question to
// answer again (409 nothing_to_retry).
function retriableIndex(items) {
  let i = items.length - 1;
  while (i >= 0 && items[i].kind === "compaction") {
    if (!items[i].kept_messages) return -1;
    i -= 1;
  }
  const last = items[i];
  const answer = last?.kind === "message" && last.role === "assistant" && !last.tool_calls?.length;
  return answer ? i : -1;
}

// The transcript with a page of newer items added: an item already shown (by
// position) is not added twice, whichever read brought it first.
export function withNewer(items, newer) {
  const shown = new Set(items.map((item) => item.position));
  return [...items, ...newer.filter((item) => !shown.has(item.position))];
}

// Reads of newer items run one after another: a reload at a turn's end and one
// asked for by its live events would otherwise read from the same position.
let newerReads = Promise.resolve();

export function loadNewer(id) {
  const read = newerReads.then(() => readNewer(id));
  newerReads = read.catch(() => {});
  return read;
}

// True once the transcript shown is the stored one, up to its end.
async function readNewer(id) {
  if (id !== app.sessionId) return false;
  const first = app.items.length === 0;
  try {
    if (first) {
      const page = await requestJson(API.transcript(id, { before: "end", limit: TRANSCRIPT_PAGE }));
      if (id !== app.sessionId) return false;
      app.items = page.items;
      app.older = page.previous;
    } else {
      let after = app.items[app.items.length - 1].position;
      while (after) {
        const page = await requestJson(API.transcript(id, { after, limit: 1000 }));
        if (id !== app.sessionId) return false;
        app.items = withNewer(app.items, page.items);
        after = page.next;
      }
    }
  } catch (err) {
    if (id !== app.sessionId) return false;
    // Gone since its read (deleted elsewhere): said and acted on as a read
    // of the session answered so, not as a transcript that failed to load.
    if (err.status === 404) announce("session-gone", { id });
    else showNotice(`Could not load the transcript: ${err.message}`);
    return false;
  }
  // To the end on a first read, or for a reader there already; one reading
  // earlier messages stays where they are.
  renderTranscript({ toEnd: first || nearBottom() });
  return true;
}

export async function loadOlder() {
  const id = app.sessionId;
  if (!id || !app.older || app.loadingOlder || ui.messages.scrollTop > 40) return;
  app.loadingOlder = true;
  try {
    const page = await requestJson(API.transcript(id, { before: app.older, limit: TRANSCRIPT_PAGE }));
    if (id !== app.sessionId) return;
    const height = ui.messages.scrollHeight;
    app.items = [...page.items, ...app.items];
    app.older = page.previous;
    renderTranscript();
    ui.messages.scrollTop += ui.messages.scrollHeight - height; // stay where the reader was
  } catch (err) {
    showNotice(`Could not load earlier messages: ${err.message}`);
  } finally {
    app.loadingOlder = false;
  }
}

export function setComposerEnabled(enabled) {
  ui.input.disabled = !enabled;
  ui.sendButton.disabled = !enabled || app.busy;
  ui.deleteButton.disabled = !enabled;
  renderCompactButton();
  if (!enabled) {
    ui.emptyHint.textContent = "Create a session with “New session…” to start chatting.";
    show(ui.emptyHint, true);
  }
}

// While an answer streams, Stop takes the place of Send.
export function setBusy(busy) {
  app.busy = busy;
  ui.sendButton.disabled = busy || !app.sessionId;
  show(ui.sendButton, !busy);
  show(ui.stopButton, busy);
  ui.stopButton.disabled = !busy;
  ui.composer.setAttribute("aria-busy", String(busy));
  for (const button of ui.messages.querySelectorAll(".send-again-button")) button.disabled = busy;
  renderRetry();
}

function retryAllowed() {
  return !app.busy && RETRY_PHASES.includes(app.phase);
}

// Retry follows the session's phase as the live events and reads tell it,
// not only this tab's own turn.
export function renderRetry() {
  for (const button of ui.messages.querySelectorAll(".retry-button")) button.disabled = !retryAllowed();
}

function retryButton() {
  const button = el("button", { className: "retry-button", text: "Retry", attrs: { type: "button" } });
  button.title = "Ask for a fresh answer to the last message";
  button.disabled = !retryAllowed();
  // The answer it stands under, not the list's last item: a failed message
  // may follow that answer on the page.
  button.addEventListener("click", () => retryAnswer(button.closest(".msg-assistant")));
  return button;
}

let resuming = null; // the session whose kept turn is being looked at

// The turn kept for this session, read again once its stored transcript is
// shown. Not when that transcript holds its answer already, nor a retry of a
// message that is no longer the last: /retry answers whichever is last now.
export async function resumeTurn(id) {
  const turn = readKeptTurn(id);
  if (!turn || resuming === id || app.busy) return;
  resuming = id;
  try {
    const queryId = await queryIdFor(id, turn.key, turn.retry).catch(() => null);
    if (id !== app.sessionId || app.busy) return;
    const stale = turn.retry && lastQuestion() !== turn.content;
    if (!queryId || stale || app.items.some((item) => item.query_id === queryId)) {
      forgetKeptTurn(id);
      return;
    }
    const options = { resumed: true, question: turn.content, since: turn.at };
    dropUnsaved();
    if (turn.retry) retryAnswer(retriedAnswer(), turn.key, options);
    else {
      showAsked(turn.content);
      runTurn(API.messages(id), { content: turn.content }, turn.key, options);
    }
  } finally {
    if (resuming === id) resuming = null;
  }
}

// The answer a retry stands to replace: the one Retry stands under.
function retriedAnswer() {
  return ui.messages.querySelector(".retry-button")?.closest(".msg-assistant") ?? null;
}

// The unsaved turn shown, gone: a turn cut while its read ended in an error
// here is shown again from the start when it is read again.
function dropUnsaved() {
  for (const node of unsaved) node.remove();
  unsaved = [];
}

// The last question of the transcript shown: the one a retry answers again.
function lastQuestion() {
  return lastItem((item) => item.kind === "message" && item.role === "user")?.content ?? null;
}

// The question of the turn about to be sent, shown until the turn is stored.
function showAsked(content) {
  const asked = messageItem({ role: "user", content });
  dropUnsaved();
  unsaved = [asked];
  ui.messages.append(asked);
  show(ui.emptyHint, false);
}

export async function sendMessage(event) {
  event?.preventDefault();
  const id = app.sessionId;
  const content = ui.input.value;
  if (!id || app.busy || !content.trim()) return;
  ui.input.value = "";
  showAsked(content);
  announce("message-sent", { id, content });
  await runTurn(API.messages(id), { content }, newKey());
}

// A fresh answer to the last message: the old one stays on screen, marked
// superseded, until the new one is stored; if none is, it stands again.
// `key` and `options`: a retry sent before this page was loaded (resumeTurn).
async function retryAnswer(old, key = null, options = { question: lastQuestion() }) {
  const id = app.sessionId;
  if (!id || (!key && !retryAllowed())) return;
  const actions = old?.querySelector(".msg-actions");
  if (old) {
    if (actions) show(actions, false);
    markSuperseded(old);
  }
  unsaved = [];
  const answered = await runTurn(API.retry(id), null, key ?? newKey(), options);
  if (!answered && old?.isConnected) {
    unmarkSuperseded(old);
    if (actions) show(actions, true);
  }
}

function markSuperseded(node) {
  node.classList.add("msg-superseded");
  node.title = "Superseded by a retry: no longer in the model's context";
  node.querySelector(".msg-head")?.append(el("span", { className: "msg-tag superseded-tag", text: "superseded" }));
}

function unmarkSuperseded(node) {
  node.classList.remove("msg-superseded");
  node.removeAttribute("title");
  node.querySelector(".msg-head .superseded-tag")?.remove();
}

export async function stopAnswer() {
  const id = app.sessionId;
  if (!id || !app.busy) return;
  const turn = app.turnKey;
  if (!turn) return;
  ui.stopButton.disabled = true;
  app.pending?.stopping();
  const response = await postStop(id, turn).catch(() => null);
  if (response?.status === 202) clearNotice("stop");
  if (response?.status === 202 || app.sessionId !== id) return;
  const err = response ? await readError(response) : null;
  // The answer goes on: it can still be stopped once it is being written.
  if (app.pending && app.sessionId === id) {
    app.pending.notStopping();
    ui.stopButton.disabled = !app.busy;
  }
  if (err?.error?.code === "nothing_running") {
    // Said on the answer itself: a notice went with the session's next read.
    app.pending?.notYetStoppable();
  } else if (response) {
    showNotice(`Could not stop: ${err.error?.message ?? response.status}`, "stop");
  } else {
    showNotice("Could not stop: the gateway is unreachable", "stop");
  }
}

// Stops reading the answer being streamed, and leaves it to the server: the
// page moves to another session or deletes this one. The turn's end is
// skipped, so its message does not go back into the composer.
export function abandonAnswer() {
  app.abort?.abort();
  app.abort = null;
  app.pending = null;
  app.turnKey = null;
  setBusy(false);
}

// The bubble of the answer about to be read, shown last, part of the unsaved
// turn until it is stored (or sent again, which starts a bubble of its own).
function showPendingAnswer(again, resumed) {
  const answer = new PendingAnswer(() => {
    unsaved = unsaved.filter((node) => node !== answer.item);
    again();
  }, resumed);
  ui.messages.append(answer.item);
  unsaved.push(answer.item);
  scrollToEnd(true);
  return answer;
}

// Sends a message (or a retry) and streams its answer into a pending bubble;
// under `key`, so that sending it again after a failure is answered once.
// `resumed`: sent by this tab before a reload, at `since` (see resumeTurn);
// `question`: for a retry, the message it answers again.
async function runTurn(url, body, key, { resumed = false, question = null, since = Date.now() } = {}) {
  const sessionId = app.sessionId;
  const answer = showPendingAnswer(() => runTurn(url, body, key, { question }), resumed);
  const content = body?.content ?? question;
  if (typeof content === "string") {
    saveKeptTurn(sessionId, { key, retry: body === null, content, at: since });
  }
  tagUnsaved([...unsaved], sessionId, key, body === null);
  app.pending = answer;
  app.turnKey = { key, retry: body === null };
  const controller = new AbortController();
  app.abort = controller;
  app.reloadAfterTurn = false;
  setBusy(true);
  let succeeded = false;
  try {
    succeeded = await readAnswer(await postTurn(url, body, key, controller.signal), answer);
  } catch (err) {
    if (err.name === "AbortError") answer.fail({ code: "cancelled", message: "stopped reading (switched or deleted session)" });
    else answer.fail({ code: "network_error", message: String(err.message || err) });
  } finally {
    // Unless the page moved to another session meanwhile (which aborted this
    // read) or is being left (whose unloading cut it), the turn is over: it is
    // no longer kept. Any end this page showed, Send again included, is the
    // person's to act on.
    if (app.abort === controller) {
      if (succeeded || !leaving()) forgetKeptTurn(sessionId);
      endTurn(answer, body, succeeded);
    }
  }
  return succeeded;
}

function endTurn(answer, body, succeeded) {
  app.abort = null;
  app.pending = null;
  app.turnKey = null;
  setBusy(false);
  if (succeeded) unsaved = [];
  else if (body && !offersSendAgain(answer.failure)) giveBack(body.content);
  if (answer.failure?.code === "withdrawn") {
    for (const node of unsaved) node.classList.add("msg-withdrawn");
  }
  // On success the stored history (with tool calls) replaces the streamed bubble;
  // after an error the inline error stays and only the gauge and facts refresh
  // (unless a compaction rewrote the history meanwhile).
  announce("session-stale", { messages: succeeded || app.reloadAfterTurn });
  app.reloadAfterTurn = false;
  if (document.activeElement === document.body) ui.input.focus();
}

// A message that was surely not taken goes back into the composer, to be sent
// again or changed, unless the user has begun another one meanwhile.
function giveBack(content) {
  if (!ui.input.value.trim()) ui.input.value = content;
}

// Another session's transcript (or none) is to be shown: this one's goes,
// its unsaved turn too.
export function clearTranscript() {
  unsaved = [];
  openDividers.clear();
  ui.messages.replaceChildren();
}

// Reads the answer of a message's POST into the pending bubble; true when it completed.
async function readAnswer(response, answer) {
  if (!response.ok) {
    const err = await readError(response);
    answer.fail(err.error);
    return false;
  }
  const type = response.headers.get("content-type") || "";
  if (!type.includes("text/event-stream") || !response.body) {
    const body = await response.json(); // a plain JSON answer
    if (body.error) {
      answer.fail(body.error);
      return false;
    }
    answer.done(body);
    return true;
  }
  return readAnswerStream(response.body, answer);
}

// Reads the POST's server-sent events; true when the answer completed.
async function readAnswerStream(body, answer) {
  const reader = body.getReader();
  const decoder = new TextDecoder();
  const parser = new SseParser();
  let outcome = null;
  const handle = (frame) => {
    let data;
    try {
      data = JSON.parse(frame.data);
    } catch {
      return;
    }
    if (frame.event === "token") {
      if (typeof data.text === "string") answer.append(data.text);
    } else if (frame.event === "restart") {
      answer.restart();
    } else if (frame.event === "done") {
      outcome = "done";
      answer.done(data);
      app.lastReply = data;
      renderGauge();
    } else if (frame.event === "error") {
      outcome = "error";
      answer.fail(data.error ?? { code: "error", message: "the answer failed" });
    }
  };
  for (;;) {
    const { value, done } = await reader.read();
    const frames = done ? parser.finish(decoder.decode()) : parser.push(decoder.decode(value, { stream: true }));
    for (const frame of frames) handle(frame);
    if (done || outcome) break;
  }
  if (outcome) {
    reader.cancel().catch(() => {});
  } else {
    answer.fail({ code: "stream_ended", message: "the answer stream ended without a result" });
  }
  return outcome === "done";
}

export function onComposerKey(event) {
  if (event.key === "Enter" && !event.shiftKey && !event.isComposing && !event.altKey && !event.ctrlKey && !event.metaKey) {
    event.preventDefault();
    sendMessage();
  }
}
