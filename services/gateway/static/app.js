// The gateway's single page: chat on the left, the live generator panel on the right.
//
// Plain ES2020 module, no dependencies, no build step. Every piece of data that comes
// from the user, the model, a tool or the server is put into the page as text
// (textContent / createTextNode), never parsed as markup.

// --------------------------------------------------------------------------- constants

const API = {
  sessions: "/api/sessions",
  session: (id) => `/api/sessions/${encodeURIComponent(id)}`,
  messages: (id) => `/api/sessions/${encodeURIComponent(id)}/messages`,
  compact: (id) => `/api/sessions/${encodeURIComponent(id)}/compact`,
  transcript: (id, params) =>
    `/api/sessions/${encodeURIComponent(id)}/transcript?${new URLSearchParams(params)}`,
  exportAs: (id, format) => `/api/sessions/${encodeURIComponent(id)}/export?format=${format}`,
  stop: (id) => `/api/sessions/${encodeURIComponent(id)}/stop`,
  retry: (id) => `/api/sessions/${encodeURIComponent(id)}/retry`,
  events: (id) => `/api/events?session_id=${encodeURIComponent(id)}`,
};

// The live feed names each server-sent event after the message type it carries.
export const LIVE_EVENT_TYPES = [
  "generator.state",
  "response.generation",
  "compaction.request",
  "compaction.event",
  "compaction.result",
];

export const STATES = [
  "idle", "receiving", "generating", "dispatching_tool", "waiting_for_tool",
  "publishing", "compacting", "error",
];

const SESSION_ID = /^[A-Za-z0-9_-]{1,64}$/;
const STORE_KNOWN = "chat.sessions";
const STORE_CURRENT = "chat.currentSession";
const MAX_KNOWN_SESSIONS = 50;
const MAX_LOG_LINES = 50;
const TRANSCRIPT_PAGE = 100;
const WARN_AT = 0.8;
const DANGER_AT = 0.95;

// --------------------------------------------------------------------------- SSE parsing

// Parses a text/event-stream incrementally: push() decoded text as it arrives and get
// back the complete events ({event, data}) it finished; finish() flushes the rest.
export class SseParser {
  constructor() {
    this.buffer = "";
  }

  push(text) {
    this.buffer = (this.buffer + text).replace(/\r\n/g, "\n");
    const events = [];
    let end;
    while ((end = this.buffer.indexOf("\n\n")) !== -1) {
      const block = this.buffer.slice(0, end);
      this.buffer = this.buffer.slice(end + 2);
      const event = parseSseBlock(block);
      if (event) events.push(event);
    }
    return events;
  }

  finish(text = "") {
    const events = this.push(text);
    const rest = this.buffer;
    this.buffer = "";
    const event = rest.trim() ? parseSseBlock(rest) : null;
    if (event) events.push(event);
    return events;
  }
}

export function parseSseBlock(block) {
  let event = "message";
  const data = [];
  for (const raw of block.split("\n")) {
    const line = raw.endsWith("\r") ? raw.slice(0, -1) : raw;
    if (line === "" || line.startsWith(":")) continue; // blank or comment (keep-alive)
    const colon = line.indexOf(":");
    const field = colon === -1 ? line : line.slice(0, colon);
    let value = colon === -1 ? "" : line.slice(colon + 1);
    if (value.startsWith(" ")) value = value.slice(1);
    if (field === "event") event = value || "message";
    else if (field === "data") data.push(value);
  }
  if (data.length === 0) return null;
  return { event, data: data.join("\n") };
}

// --------------------------------------------------------------------------- formatting

const numberFormat = new Intl.NumberFormat("en-US");

export function fmt(n) {
  return typeof n === "number" && Number.isFinite(n) ? numberFormat.format(Math.round(n)) : "?";
}

export function percent(part, whole) {
  if (typeof part !== "number" || typeof whole !== "number" || whole <= 0) return 0;
  return Math.round((part / whole) * 100);
}

// "ok" below 80 % of the budget, "warn" from 80 %, "danger" from 95 %.
export function gaugeLevel(tokens, budget) {
  if (typeof tokens !== "number" || typeof budget !== "number" || budget <= 0) return "ok";
  const ratio = tokens / budget;
  if (ratio >= DANGER_AT) return "danger";
  if (ratio >= WARN_AT) return "warn";
  return "ok";
}

// The session as the gauge shows it once a compaction completed: its result's
// `tokens_after` is the same count as the session's `token_count` (tools
// included), so the gauge moves to it at once, even while a turn defers the reload.
export function sessionAfterCompaction(session, result) {
  if (!session || result?.status !== "completed" || typeof result.tokens_after !== "number") {
    return session;
  }
  return { ...session, token_count: result.tokens_after };
}

// The compaction the "compacting" banner stands for (its correlation id), after
// a live event. Only that compaction's own result ends it: a second request,
// skipped because one already runs, must not hide the banner. One known only
// from a read of the session ("unknown") ends with any result. Events of the
// compaction whose result came last (`ended`) are late or a redelivery's
// echo, and do not bring the banner back.
export function compactingAfter(current, type, correlationId, event, ended = null) {
  const echo = correlationId != null && correlationId === ended;
  if (type === "compaction.event" && event === "started" && !echo) return correlationId ?? "unknown";
  // Progress of a compaction whose start this page did not see (it was loaded later).
  if (type === "compaction.event" && event === "progress" && current === null && !echo) {
    return correlationId ?? "unknown";
  }
  if (type === "compaction.result" &&
      (correlationId == null || correlationId === current || current === "unknown")) {
    return null;
  }
  return current;
}

// The banner after a read of the session, sent as load `readSeq`, given the
// loads current when this page last saw a compaction start and a result end
// one. A read races the live events: one sent before a result was seen may
// still say "compacting" and must not bring the banner back; one sent after a
// start was seen that says anything else means the compaction ended, its
// result perhaps missed while live events were down.
export function compactingAfterRead(current, state, readSeq, startSeenAtSeq, endSeenAtSeq) {
  if (state === "compacting") return readSeq > endSeenAtSeq ? current ?? "unknown" : current;
  return readSeq > startSeenAtSeq ? null : current;
}

// The banner's text for a compaction's progress event (pieces of its summary).
export function progressText(progress) {
  const done = progress?.pieces_done;
  const total = progress?.pieces_total;
  if (typeof done !== "number" || typeof total !== "number" || total < 1) {
    return "Compacting the conversation…";
  }
  if (done >= total) return `Compacting… all ${total} piece${total === 1 ? "" : "s"} written`;
  return `Compacting… piece ${done + 1} of ${total}`;
}

// What an answer not yet begun waits for, after a state change of its session
// (action, to_state). Sent while the session answered an earlier message, it
// is queued until that turn ends (reset); once its own turn runs and before
// any token, it waits for the model (a free slot of the model server).
export function pendingAfter(pending, action, toState) {
  if (pending.queued) return action === "reset" ? { queued: false, started: false } : pending;
  if (toState === "receiving" || toState === "generating") return { queued: false, started: true };
  return pending;
}

export function pendingText(pending) {
  if (pending.queued) return "queued: the session's earlier message is answered first…";
  if (pending.started) return "waiting for the model…";
  return "waiting for a generator…";
}

const QUIET_PHASES = ["idle", "unknown", "error"];

// The session's state as the server computes it (services/core/state_machine.py):
// a running compaction, whichever generator runs it, else the turn's phase.
export function sessionState(phase, compacting) {
  return compacting ? "compacting" : phase;
}

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
export function fadedIndexes(items) {
  const faded = new Set();
  let last = -1;
  items.forEach((item, i) => { if (item.kind === "compaction") last = i; });
  if (last < 0) return faded;
  let keep = Number(items[last].kept_messages) || 0;
  for (let i = last - 1; i >= 0; i -= 1) {
    if (items[i].kind !== "message") continue;
    if (keep > 0) keep -= 1;
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

function clockTime(timestamp) {
  const date = timestamp ? new Date(timestamp) : new Date();
  const valid = Number.isNaN(date.getTime()) ? new Date() : date;
  return valid.toLocaleTimeString([], { hour12: false });
}

function errorText(err) {
  if (!err || typeof err !== "object") return String(err ?? "unknown error");
  const code = err.code ? `${err.code}: ` : "";
  const field = err.field ? ` (field ${err.field})` : "";
  return `${code}${err.message ?? "unknown error"}${field}`;
}

function isValidSessionId(id) {
  return typeof id === "string" && SESSION_ID.test(id);
}

// --------------------------------------------------------------------------- DOM helpers

function byId(id) {
  const node = document.getElementById(id);
  if (!node) throw new Error(`page is missing #${id}`);
  return node;
}

// Builds an element. `text` is always set as text; children may be nodes or strings
// (strings become text nodes). No markup is ever parsed.
function el(tag, { className, text, attrs } = {}, children = []) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (attrs) for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, String(v));
  if (text !== undefined && text !== null) node.textContent = String(text);
  for (const child of children) {
    if (child === null || child === undefined) continue;
    node.append(typeof child === "string" ? document.createTextNode(child) : child);
  }
  return node;
}

function show(node, visible) {
  node.hidden = !visible;
}

// --------------------------------------------------------------------------- HTTP

class ApiError extends Error {
  constructor(status, error) {
    super(errorText(error));
    this.status = status;
    this.error = error;
  }
}

async function readError(response) {
  let error = { code: `http_${response.status}`, message: response.statusText || "request failed" };
  try {
    const body = await response.json();
    if (body && typeof body.error === "object" && body.error) error = body.error;
  } catch {
    // not JSON: keep the status line
  }
  return new ApiError(response.status, error);
}

async function requestJson(url, { method = "GET", body } = {}) {
  const init = { method, headers: { Accept: "application/json" } };
  if (body !== undefined) {
    init.headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(body);
  }
  let response;
  try {
    response = await fetch(url, init);
  } catch (err) {
    throw new ApiError(0, { code: "network_error", message: `gateway unreachable: ${err.message}` });
  }
  if (!response.ok) throw await readError(response);
  return response.status === 204 ? null : response.json();
}

// --------------------------------------------------------------------------- state

const app = {
  sessionId: null,
  session: null, // last GET /api/sessions/{id}
  busy: false, // a message is being answered
  abort: null, // AbortController of the answer being read
  events: null, // EventSource
  lastGeneration: null, // payload of the latest response.generation
  lastReply: null, // prompt/completion tokens of the latest done event
  reloadAfterTurn: false, // a reload was asked for while an answer was streaming
  loadSeq: 0,
  refreshTimer: null,
  phase: "unknown", // the turn's phase, from generator.state events and reads
  compacting: null, // correlation id of the compaction running, if one is
  compactingSeenAt: 0, // loadSeq when that compaction's start arrived
  compactionEndSeenAt: 0, // loadSeq when the last compaction result arrived
  compactionEnded: null, // that result's correlation id
  items: [], // the transcript items shown, oldest first
  older: null, // cursor of the page before them; null at the start
  loadingOlder: false,
  pending: null, // the answer being waited for, while one is (see pendingAnswer)
  compactionProgress: null, // the running compaction's last progress event
};

const ui = {};

// --------------------------------------------------------------------------- known sessions

function knownSessions() {
  try {
    const list = JSON.parse(localStorage.getItem(STORE_KNOWN) || "[]");
    return Array.isArray(list) ? list.filter((s) => s && isValidSessionId(s.id)) : [];
  } catch {
    return [];
  }
}

function saveKnownSessions(list) {
  try {
    localStorage.setItem(STORE_KNOWN, JSON.stringify(list.slice(0, MAX_KNOWN_SESSIONS)));
  } catch {
    // storage full or disabled: the picker just forgets
  }
}

function rememberSession(id, label) {
  const list = knownSessions();
  const existing = list.find((s) => s.id === id);
  if (existing) {
    if (!label || existing.label) return; // nothing new
    existing.label = label;
  } else {
    list.unshift({ id, label: label || "", created: new Date().toISOString() });
  }
  saveKnownSessions(list);
  renderSessionPicker();
}

// Sessions created elsewhere (another browser, the API) join the picker.
async function mergeServerSessions() {
  let body;
  try {
    const response = await fetch("/api/sessions?limit=50");
    if (!response.ok) return;
    body = await response.json();
  } catch {
    return; // the picker keeps what this browser knows
  }
  const list = knownSessions();
  let added = false;
  for (const s of body.sessions ?? []) {
    if (!isValidSessionId(s.session_id) || list.some((k) => k.id === s.session_id)) continue;
    list.push({ id: s.session_id, label: "", created: s.created_at });
    added = true;
  }
  if (!added) return;
  saveKnownSessions(list);
  renderSessionPicker();
}

function forgetSession(id) {
  saveKnownSessions(knownSessions().filter((s) => s.id !== id));
  renderSessionPicker();
}

function sessionLabel(entry) {
  const name = entry.label ? entry.label : `session ${entry.id.slice(0, 8)}`;
  const when = entry.created ? new Date(entry.created) : null;
  const date = when && !Number.isNaN(when.getTime()) ? ` · ${when.toLocaleDateString()}` : "";
  return `${name}${date}`;
}

function renderSessionPicker() {
  const select = ui.sessionSelect;
  const list = knownSessions();
  const options = [el("option", { text: list.length ? "(choose a session)" : "(no session)", attrs: { value: "" } })];
  for (const entry of list) {
    options.push(el("option", { text: sessionLabel(entry), attrs: { value: entry.id, title: entry.id } }));
  }
  select.replaceChildren(...options);
  select.value = app.sessionId && list.some((s) => s.id === app.sessionId) ? app.sessionId : "";
}

function sessionFromHash() {
  const match = /(?:^#|&)session=([^&]*)/.exec(window.location.hash);
  if (!match) return null;
  let id;
  try {
    id = decodeURIComponent(match[1]);
  } catch {
    return null;
  }
  return isValidSessionId(id) ? id : null;
}

// --------------------------------------------------------------------------- notices

function showNotice(message) {
  ui.notice.textContent = message;
  show(ui.notice, Boolean(message));
}

// --------------------------------------------------------------------------- session switching

function selectSession(id, { updateHash = true } = {}) {
  if (!isValidSessionId(id)) return;
  if (app.sessionId === id && app.events) return;
  if (app.abort) {
    app.abort.abort(); // stop reading the other session's answer
    app.abort = null;
  }
  setBusy(false);
  app.sessionId = id;
  app.session = null;
  app.lastGeneration = null;
  app.lastReply = null;
  app.compacting = null;
  app.phase = "unknown";
  app.items = [];
  app.older = null;
  try {
    localStorage.setItem(STORE_CURRENT, id);
  } catch {
    // ignore
  }
  if (updateHash && sessionFromHash() !== id) {
    history.replaceState(null, "", `#session=${encodeURIComponent(id)}`);
  }
  rememberSession(id);
  showNotice("");
  ui.messages.replaceChildren();
  ui.log.replaceChildren();
  renderSessionFacts(null);
  setState("unknown");
  renderGauge();
  renderCompacting();
  ui.compactStatus.textContent = "";
  setComposerEnabled(true);
  setExportLinks(id);
  ui.timeline.replaceChildren();
  connectEvents(id);
  loadSession();
}

async function loadSession({ messages = true } = {}) {
  const id = app.sessionId;
  if (!id) return;
  const seq = ++app.loadSeq;
  let session;
  try {
    session = await requestJson(API.session(id));
  } catch (err) {
    if (seq !== app.loadSeq || id !== app.sessionId) return;
    if (err.status === 404) {
      showNotice(`Session ${id} does not exist (any more). It was removed from the list; create a new one.`);
      forgetSession(id);
      disconnectEvents();
      setComposerEnabled(false);
    } else {
      showNotice(`Could not load the session: ${err.message}`);
    }
    return;
  }
  const current = () => seq === app.loadSeq && id === app.sessionId;
  if (!current()) return; // a newer load or another session
  app.session = session;
  showNotice("");
  if (messages && !app.busy) await loadNewer(id);
  if (!current()) return; // overtaken while the messages loaded
  loadTimeline(id);
  if (messages && app.busy) app.reloadAfterTurn = true; // the end of the turn reloads them
  renderSessionFacts(session);
  renderGauge();
  const wasCompacting = app.compacting;
  app.compacting = compactingAfterRead(app.compacting, session.state, seq,
    app.compactingSeenAt, app.compactionEndSeenAt);
  // During a turn its phase follows the live events, which a read may trail.
  if (session.state && !app.busy) {
    app.phase = session.phase ?? session.state;
    renderState();
  } else if (app.compacting !== wasCompacting) {
    renderState();
  }
  renderCompacting();
  const firstUser = (session.messages || []).find((m) => m.role === "user");
  if (firstUser) rememberSession(id, firstUser.content.slice(0, 40));
}

// Coalesces refreshes asked for by a burst of live events.
function scheduleRefresh() {
  clearTimeout(app.refreshTimer);
  app.refreshTimer = setTimeout(() => loadSession({ messages: !app.busy }), 250);
}

async function createSession(event) {
  event.preventDefault();
  const body = { auto_compact: ui.newAutoCompact.checked };
  const system = ui.newSystem.value;
  const model = ui.newModel.value.trim();
  if (system.trim()) body.system = system;
  if (model) body.model = model;
  ui.newSessionCreate.disabled = true;
  show(ui.newSessionError, false);
  try {
    const created = await requestJson(API.sessions, { method: "POST", body });
    ui.newSessionDialog.close();
    ui.newSystem.value = "";
    ui.newModel.value = "";
    selectSession(created.session_id);
    ui.input.focus();
  } catch (err) {
    ui.newSessionError.textContent = `Could not create the session: ${err.message}`;
    show(ui.newSessionError, true);
  } finally {
    ui.newSessionCreate.disabled = false;
  }
}

function openSessionById(event) {
  event.preventDefault();
  const id = ui.openSessionId.value.trim();
  if (!isValidSessionId(id)) {
    ui.newSessionError.textContent = "A session id is 1-64 letters, digits, '-' or '_'.";
    show(ui.newSessionError, true);
    return;
  }
  ui.newSessionDialog.close();
  ui.openSessionId.value = "";
  selectSession(id);
}

// --------------------------------------------------------------------------- messages

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
  if (role === "tool") {
    item.append(el("pre", { className: "tool-result", text: message.content ?? "" }));
  } else if (message.content) {
    item.append(el("div", { className: "msg-text", text: message.content }));
  }
  for (const call of message.tool_calls ?? []) item.append(renderToolCall(call));
  return item;
}

function dividerItem(marker) {
  const details = el("details", { className: "divider-details" }, [
    el("summary", { text: dividerText(marker) }),
    el("p", { className: "pre-text", text: marker.summary ?? "(no summary: old tool output elided)" }),
  ]);
  return el("li", { className: "msg-divider", attrs: { role: "separator" } }, [details]);
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
  const last = app.items.at(-1);
  if (last?.kind === "message" && last.role === "assistant" && !last.tool_calls?.length) {
    nodes.at(-1).append(el("div", { className: "msg-actions" }, [retryButton()]));
  }
  if (app.older) nodes.unshift(el("li", { className: "msg-more", text: "Scroll up for earlier messages…" }));
  ui.messages.replaceChildren(...nodes);
  show(ui.emptyHint, nodes.length === 0);
  if (nodes.length === 0) ui.emptyHint.textContent = "No messages yet — say something.";
  if (toEnd) scrollToEnd(true);
}

async function loadNewer(id) {
  const first = app.items.length === 0;
  try {
    if (first) {
      const page = await requestJson(API.transcript(id, { before: "end", limit: TRANSCRIPT_PAGE }));
      if (id !== app.sessionId) return;
      app.items = page.items;
      app.older = page.previous;
    } else {
      let after = app.items[app.items.length - 1].position;
      while (after) {
        const page = await requestJson(API.transcript(id, { after, limit: 1000 }));
        if (id !== app.sessionId) return;
        app.items.push(...page.items);
        after = page.next;
      }
    }
  } catch (err) {
    if (id === app.sessionId) showNotice(`Could not load the transcript: ${err.message}`);
    return;
  }
  renderTranscript({ toEnd: true });
}

async function loadOlder() {
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

async function loadTimeline(id) {
  let page;
  try {
    page = await requestJson(API.transcript(id, { kind: "compaction", limit: 1000 }));
  } catch {
    return; // the chat shows the error, if any
  }
  if (id !== app.sessionId) return;
  const rows = page.items.map((m) => el("li", { className: "timeline-row" }, [
    el("span", { className: "timeline-when", text: m.at ? clockTime(m.at) : "—" }),
    el("span", { text: m.auto === false ? "manual" : "automatic" }),
    el("span", { text: m.level ?? "" }),
    el("span", { text: Number.isFinite(m.tokens_before)
      ? `${fmt(m.tokens_before)} → ${fmt(m.tokens_after)}` : "" }),
  ]));
  ui.timeline.replaceChildren(...rows);
  show(ui.timelineEmpty, rows.length === 0);
}

async function deleteSession() {
  const id = app.sessionId;
  if (!id) return;
  const ok = window.confirm("Delete this session for good? Its whole transcript, summary and "
    + "queued messages are removed; this cannot be undone.");
  if (!ok) return;
  try {
    await requestJson(API.session(id), { method: "DELETE" });
  } catch (err) {
    if (err.status !== 404) {
      showNotice(`Could not delete the session: ${err.message}`);
      return;
    }
  }
  forgetSession(id);
  disconnectEvents();
  app.sessionId = null;
  app.items = [];
  app.older = null;
  ui.messages.replaceChildren();
  ui.timeline.replaceChildren();
  renderSessionFacts(null);
  setComposerEnabled(false);
  history.replaceState(null, "", "#");
  showNotice(`Session ${id} was deleted.`);
}

function setExportLinks(id) {
  for (const [link, format] of [[ui.exportMarkdown, "markdown"], [ui.exportJson, "json"]]) {
    if (id) link.setAttribute("href", API.exportAs(id, format));
    else link.removeAttribute("href");
  }
}

function nearBottom() {
  const box = ui.messages;
  return box.scrollHeight - box.scrollTop - box.clientHeight < 80;
}

function scrollToEnd(force = false) {
  if (force || nearBottom()) ui.messages.scrollTop = ui.messages.scrollHeight;
}

// The assistant answer being streamed into the list.
function pendingAnswer() {
  const text = el("div", { className: "msg-text" });
  let waiting = { queued: !QUIET_PHASES.includes(app.phase), started: false };
  let writing = false;
  const status = el("div", { className: "msg-status", text: pendingText(waiting) });
  const item = el("li", { className: "msg msg-assistant msg-pending", attrs: { "aria-busy": "true" } }, [
    el("div", { className: "msg-head" }, [el("span", { className: "msg-role", text: "Assistant" })]),
    text,
    status,
  ]);
  ui.messages.append(item);
  scrollToEnd(true);
  return {
    stateChanged(action, toState) {
      if (writing) return;
      waiting = pendingAfter(waiting, action, toState);
      status.textContent = pendingText(waiting);
    },
    stopping() {
      status.textContent = "stopping…";
    },
    append(piece) {
      const stick = nearBottom();
      writing = true;
      text.append(document.createTextNode(piece));
      status.textContent = "writing…";
      if (stick) scrollToEnd(true);
    },
    restart() {
      // The generator died mid-answer and another one starts it over.
      text.textContent = "";
      status.textContent = "generating again…";
    },
    done(body) {
      if (typeof body.reply === "string") text.textContent = body.reply;
      if (typeof body.thinking === "string" && body.thinking) {
        // Apart from the answer, folded: it is not part of the conversation.
        text.before(el("details", { className: "msg-thinking" }, [
          el("summary", { text: "thinking" }),
          el("div", { className: "msg-text", text: body.thinking }),
        ]));
      }
      const counts = `prompt ${fmt(body.prompt_tokens)} · completion ${fmt(body.completion_tokens)} tokens`;
      status.textContent = body.stopped ? `stopped · ${counts}` : counts;
      item.classList.remove("msg-pending");
      item.removeAttribute("aria-busy");
    },
    fail(error) {
      item.classList.remove("msg-pending");
      item.classList.add("msg-failed");
      item.removeAttribute("aria-busy");
      status.remove();
      item.append(el("div", { className: "msg-error", attrs: { role: "alert" } }, [
        el("strong", { text: "Error " }),
        el("code", { text: error?.code ?? "error" }),
        ": ",
        error?.message ?? "the answer failed",
      ]));
      scrollToEnd(true);
    },
  };
}

function setComposerEnabled(enabled) {
  ui.input.disabled = !enabled;
  ui.sendButton.disabled = !enabled || app.busy;
  ui.compactButton.disabled = !enabled;
  if (!enabled) {
    ui.emptyHint.textContent = "Create a session with “New session…” to start chatting.";
    show(ui.emptyHint, true);
  }
}

// While an answer streams, Stop takes the place of Send.
function setBusy(busy) {
  app.busy = busy;
  ui.sendButton.disabled = busy || !app.sessionId;
  show(ui.sendButton, !busy);
  show(ui.stopButton, busy);
  ui.stopButton.disabled = !busy;
  ui.composer.setAttribute("aria-busy", String(busy));
  for (const button of ui.messages.querySelectorAll(".retry-button")) button.disabled = busy;
}

function retryButton() {
  const button = el("button", { className: "retry-button", text: "Retry", attrs: { type: "button" } });
  button.title = "Ask for a fresh answer to the last message";
  button.disabled = app.busy;
  button.addEventListener("click", retryAnswer);
  return button;
}

async function sendMessage(event) {
  event?.preventDefault();
  const id = app.sessionId;
  const content = ui.input.value;
  if (!id || app.busy || !content.trim()) return;
  ui.input.value = "";
  show(ui.emptyHint, false);
  ui.messages.append(messageItem({ role: "user", content }));
  rememberSession(id, content.slice(0, 40));
  await runTurn(API.messages(id), { content });
}

// A fresh answer to the last message: the old one stays on screen, marked
// superseded, until the new one is stored.
async function retryAnswer() {
  const id = app.sessionId;
  if (!id || app.busy) return;
  const last = ui.messages.lastElementChild;
  if (last?.classList.contains("msg-assistant")) {
    last.querySelector(".msg-actions")?.remove();
    markSuperseded(last);
  }
  await runTurn(API.retry(id), null);
}

function markSuperseded(node) {
  node.classList.add("msg-superseded");
  node.title = "Superseded by a retry: no longer in the model's context";
  node.querySelector(".msg-head")?.append(el("span", { className: "msg-tag", text: "superseded" }));
}

async function stopAnswer() {
  const id = app.sessionId;
  if (!id || !app.busy) return;
  ui.stopButton.disabled = true;
  app.pending?.stopping();
  const response = await fetch(API.stop(id), { method: "POST" }).catch(() => null);
  if (response && response.status !== 202) {
    const err = await readError(response);
    showNotice(`Could not stop: ${err.error?.message ?? response.status}`);
  } else if (!response) {
    showNotice("Could not stop: the gateway is unreachable");
  }
}

// Sends a message (or a retry) and streams its answer into a pending bubble.
async function runTurn(url, body) {
  const id = app.sessionId;
  const answer = pendingAnswer();
  app.pending = answer;
  const controller = new AbortController();
  app.abort = controller;
  app.reloadAfterTurn = false;
  setBusy(true);
  let succeeded = false;
  try {
    const response = await fetch(url, {
      method: "POST",
      headers: { "Content-Type": "application/json", Accept: "text/event-stream" },
      body: body === null ? undefined : JSON.stringify(body),
      signal: controller.signal,
    });
    if (!response.ok) {
      const err = await readError(response);
      answer.fail(err.error);
      return;
    }
    const type = response.headers.get("content-type") || "";
    if (!type.includes("text/event-stream") || !response.body) {
      const body = await response.json(); // a plain JSON answer
      if (body.error) answer.fail(body.error);
      else {
        answer.done(body);
        succeeded = true;
      }
      return;
    }
    succeeded = await readAnswerStream(response.body, answer);
  } catch (err) {
    if (err.name === "AbortError") answer.fail({ code: "cancelled", message: "stopped reading (switched session)" });
    else answer.fail({ code: "network_error", message: String(err.message || err) });
  } finally {
    // Unless the page moved to another session meanwhile (which aborted this read).
    if (app.abort === controller) {
      app.abort = null;
      app.pending = null;
      setBusy(false);
      // On success the stored history (with tool calls) replaces the streamed bubble;
      // after an error the inline error stays and only the gauge and facts refresh
      // (unless a compaction rewrote the history meanwhile).
      loadSession({ messages: succeeded || app.reloadAfterTurn });
      app.reloadAfterTurn = false;
      if (document.activeElement === document.body) ui.input.focus();
    }
  }
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

function onComposerKey(event) {
  if (event.key === "Enter" && !event.shiftKey && !event.isComposing && !event.altKey && !event.ctrlKey && !event.metaKey) {
    event.preventDefault();
    sendMessage();
  }
}

// --------------------------------------------------------------------------- panel: state

function setState(stateName, detail = "") {
  const known = STATES.includes(stateName) ? stateName : "unknown";
  ui.stateBadge.dataset.state = known;
  ui.stateBadge.textContent = (stateName || "unknown").replace(/_/g, " ");
  ui.stateDetail.textContent = detail;
}

// The badge says what the session does: compacting while a compaction runs,
// with the turn answered meanwhile, if any, in the detail.
function renderState(detail = "") {
  const compacting = app.compacting !== null;
  const turn = compacting && app.phase !== "idle" && app.phase !== "unknown"
    ? `answering meanwhile: ${app.phase.replace(/_/g, " ")}` : "";
  setState(sessionState(app.phase, compacting), compacting ? turn : detail);
}

function renderCompacting() {
  const visible = app.compacting !== null || app.phase === "compacting";
  show(ui.compactingBanner, visible);
  ui.compactingBanner.textContent = progressText(app.compactionProgress);
  document.body.classList.toggle("is-compacting", visible);
}

// --------------------------------------------------------------------------- panel: gauge

function fillBar(bar, fill, fraction, level) {
  const pct = Math.max(0, Math.min(100, fraction * 100));
  fill.style.width = `${pct}%`;
  bar.dataset.level = level;
  bar.setAttribute("aria-valuenow", String(Math.round(pct)));
}

function renderGauge() {
  const s = app.session;
  if (s && typeof s.token_count === "number" && s.num_ctx > 0) {
    const level = gaugeLevel(s.token_count, s.budget);
    fillBar(ui.gauge, ui.gaugeFill, s.token_count / s.num_ctx, level);
    ui.gaugeBudget.style.left = `${Math.min(100, (s.budget / s.num_ctx) * 100)}%`;
    show(ui.gaugeBudget, true);
    ui.gaugeText.textContent =
      `${fmt(s.token_count)} / ${fmt(s.budget)} tokens (${percent(s.token_count, s.budget)}%) · window ${fmt(s.num_ctx)}`;
    ui.gauge.setAttribute("aria-valuetext", ui.gaugeText.textContent);
  } else {
    fillBar(ui.gauge, ui.gaugeFill, 0, "ok");
    show(ui.gaugeBudget, false);
    ui.gaugeText.textContent = "—";
  }

  const g = app.lastGeneration;
  const numCtx = g?.num_ctx ?? s?.num_ctx;
  const budget = s?.budget ?? numCtx;
  const promptTokens = typeof g?.prompt_tokens === "number" ? g.prompt_tokens : app.lastReply?.prompt_tokens;
  if (typeof promptTokens === "number" && numCtx > 0) {
    fillBar(ui.gaugeLast, ui.gaugeLastFill, promptTokens / numCtx, gaugeLevel(promptTokens, budget));
    const parts = [`${fmt(promptTokens)} / ${fmt(numCtx)} tokens (${percent(promptTokens, numCtx)}% of the window)`];
    if (g) {
      if (typeof g.completion_tokens === "number") parts.push(`${fmt(g.completion_tokens)} generated`);
      if (typeof g.duration_ms === "number") parts.push(`${fmt(g.duration_ms)} ms`);
    }
    ui.gaugeLastText.textContent = parts.join(" · ");
    ui.gaugeLast.setAttribute("aria-valuetext", parts[0]);
  } else {
    fillBar(ui.gaugeLast, ui.gaugeLastFill, 0, "ok");
    ui.gaugeLastText.textContent = g ? "The model did not report prompt tokens for the last call." : "No generation yet.";
  }
  if (g && (typeof g.next_prompt_chars === "number" || typeof g.compactable_chars === "number")) {
    ui.gaugeLastText.append(el("br"), el("span", {
      className: "hint",
      text: `next prompt ≈ ${fmt(g.next_prompt_chars)} chars · compactable ${fmt(g.compactable_chars)} chars`,
    }));
  }
}

// `s` null clears the facts (while another session loads).
function renderSessionFacts(s) {
  ui.factModel.textContent = s?.model ?? "—";
  ui.factAuto.textContent = s ? (s.auto_compact ? "on" : "off") : "—";
  ui.factCompactions.textContent = s ? String(s.compactions ?? 0) : "—";
  ui.factMessages.textContent = s ? String((s.messages ?? []).length) : "—";
  ui.summaryText.textContent = s?.summary ?? "";
  show(ui.summaryBox, Boolean(s?.summary));
  ui.systemText.textContent = s?.system ?? "";
  show(ui.systemBox, Boolean(s?.system));
}

// --------------------------------------------------------------------------- panel: compaction

async function requestCompaction(event) {
  event.preventDefault();
  const id = app.sessionId;
  if (!id) return;
  const instructions = ui.compactInstructions.value.trim();
  ui.compactButton.disabled = true;
  ui.compactStatus.dataset.kind = "info";
  ui.compactStatus.textContent = "Requesting compaction…";
  try {
    await requestJson(API.compact(id), { method: "POST", body: instructions ? { instructions } : {} });
    if (app.sessionId !== id) return; // the user moved to another session meanwhile
    ui.compactStatus.textContent = "Compaction requested — progress shows in the events below.";
    ui.compactInstructions.value = "";
  } catch (err) {
    if (app.sessionId !== id) return;
    ui.compactStatus.dataset.kind = "error";
    ui.compactStatus.textContent = `Compaction not requested: ${err.message}`;
  } finally {
    ui.compactButton.disabled = !app.sessionId;
  }
}

// --------------------------------------------------------------------------- panel: live events

function logLine(kind, text, timestamp) {
  const item = el("li", { className: `log-line log-${kind.replace(/[^a-z]/gi, "-")}` }, [
    el("time", { className: "log-time", text: clockTime(timestamp) }),
    el("span", { className: "log-kind", text: kind }),
    el("span", { className: "log-text", text }),
  ]);
  ui.log.prepend(item);
  while (ui.log.children.length > MAX_LOG_LINES) ui.log.lastElementChild.remove();
}

function setLive(status) {
  ui.liveStatus.dataset.live = status;
  ui.liveStatus.textContent = `live: ${status}`;
}

function disconnectEvents() {
  if (app.events) app.events.close();
  app.events = null;
  setLive("off");
}

function connectEvents(id) {
  disconnectEvents();
  setLive("connecting");
  const source = new EventSource(API.events(id));
  app.events = source;
  let wasDown = false;
  source.onopen = () => {
    if (app.events !== source) return;
    setLive("connected");
    if (wasDown) {
      logLine("live", "reconnected; reloading the session");
      scheduleRefresh();
    }
    wasDown = false;
  };
  source.onerror = () => {
    if (app.events !== source) return;
    wasDown = true;
    setLive(source.readyState === EventSource.CLOSED ? "closed" : "reconnecting");
  };
  for (const type of LIVE_EVENT_TYPES) {
    source.addEventListener(type, (event) => {
      if (app.events === source) onLiveEvent(type, event.data);
    });
  }
}

function onLiveEvent(type, raw) {
  let envelope;
  try {
    envelope = JSON.parse(raw);
  } catch {
    return;
  }
  if (!envelope || typeof envelope !== "object") return;
  if (envelope.session_id && envelope.session_id !== app.sessionId) return;
  const p = envelope.payload && typeof envelope.payload === "object" ? envelope.payload : {};
  const ts = envelope.timestamp;
  switch (type) {
    case "generator.state": {
      app.phase = p.to_state ?? "unknown";
      app.pending?.stateChanged(p.action, p.to_state);
      renderState(p.action ? `after ${p.action}` : "");
      renderCompacting();
      logLine(type, `${p.from_state ?? "?"} → ${p.to_state ?? "?"}${p.action ? ` (${p.action})` : ""}`, ts);
      break;
    }
    case "response.generation": {
      app.lastGeneration = p;
      renderGauge();
      logLine(type, `prompt ${fmt(p.prompt_tokens)} · completion ${fmt(p.completion_tokens)} tokens · ` +
        `${fmt(p.sent_chars)} chars sent · ${fmt(p.duration_ms)} ms`, ts);
      scheduleRefresh();
      break;
    }
    case "compaction.request": {
      logLine(type, `${p.auto ? "automatic" : "manual"} compaction requested (${p.level ?? "gentle"})` +
        `${p.reason ? `: ${p.reason}` : ""}`, ts);
      break;
    }
    case "compaction.event": {
      app.compacting = compactingAfter(app.compacting, type, envelope.correlation_id, p.event,
        app.compactionEnded);
      if (p.event === "started") app.compactingSeenAt = app.loadSeq;
      app.compactionProgress = p.event === "progress" ? p : null;
      renderState();
      renderCompacting();
      if (p.event === "progress") {
        logLine(type, `compaction progress: ${fmt(p.pieces_done)} of ${fmt(p.pieces_total)} pieces written`, ts);
        break;
      }
      logLine(type, `compaction ${p.event ?? "?"} (${p.level ?? "?"}, ${p.auto ? "auto" : "manual"})` +
        `${typeof p.tokens_before === "number" ? ` at ${fmt(p.tokens_before)} tokens` : ""}` +
        `${p.reason ? `: ${p.reason}` : ""}`, ts);
      break;
    }
    case "compaction.result": {
      app.compacting = compactingAfter(app.compacting, type, envelope.correlation_id);
      app.compactionEndSeenAt = app.loadSeq;
      app.compactionEnded = envelope.correlation_id ?? null;
      if (app.compacting === null) app.compactionProgress = null;
      renderState();
      renderCompacting();
      const status = p.status ?? "completed";
      let text;
      if (status === "completed") {
        text = `compaction completed: ${fmt(p.tokens_before)} → ${fmt(p.tokens_after)} tokens`;
      } else if (status === "skipped") {
        text = `compaction skipped${p.error ? `: ${p.error}` : ""}`;
      } else {
        text = `compaction failed: ${p.error ?? "unknown error"}`;
      }
      logLine(type, text, ts);
      ui.compactStatus.dataset.kind = status === "failed" ? "error" : "info";
      ui.compactStatus.textContent = text.charAt(0).toUpperCase() + text.slice(1);
      if (status === "completed") {
        app.session = sessionAfterCompaction(app.session, p);
        renderGauge();
        if (app.busy) app.reloadAfterTurn = true; // the turn's end reloads
        else loadSession();
      }
      break;
    }
    default:
      logLine(type, "event", ts);
  }
}

// --------------------------------------------------------------------------- start

function bindUi() {
  const ids = {
    sessionSelect: "session-select",
    newSessionButton: "new-session-button",
    newSessionDialog: "new-session-dialog",
    newSessionForm: "new-session-form",
    newSessionCancel: "new-session-cancel",
    newSessionCreate: "new-session-create",
    newSessionError: "new-session-error",
    newSystem: "new-system",
    newModel: "new-model",
    newAutoCompact: "new-auto-compact",
    openSessionForm: "open-session-form",
    openSessionId: "open-session-id",
    liveStatus: "live-status",
    notice: "notice",
    systemBox: "system-box",
    systemText: "system-text",
    messages: "messages",
    emptyHint: "empty-hint",
    composer: "composer",
    input: "message-input",
    sendButton: "send-button",
    stopButton: "stop-button",
    stateBadge: "state-badge",
    stateDetail: "state-detail",
    compactingBanner: "compacting-banner",
    gauge: "gauge",
    gaugeFill: "gauge-fill",
    gaugeBudget: "gauge-budget",
    gaugeText: "gauge-text",
    gaugeLast: "gauge-last",
    gaugeLastFill: "gauge-last-fill",
    gaugeLastText: "gauge-last-text",
    factModel: "fact-model",
    factAuto: "fact-auto",
    factCompactions: "fact-compactions",
    factMessages: "fact-messages",
    summaryBox: "summary-box",
    summaryText: "summary-text",
    compactForm: "compact-form",
    compactInstructions: "compact-instructions",
    compactButton: "compact-button",
    compactStatus: "compact-status",
    log: "log",
    logClear: "log-clear",
    timeline: "timeline",
    timelineEmpty: "timeline-empty",
    exportMarkdown: "export-markdown",
    exportJson: "export-json",
    deleteButton: "delete-button",
  };
  for (const [name, id] of Object.entries(ids)) ui[name] = byId(id);
}

function openNewSessionDialog() {
  show(ui.newSessionError, false);
  if (typeof ui.newSessionDialog.showModal === "function") ui.newSessionDialog.showModal();
  else ui.newSessionDialog.setAttribute("open", "");
  ui.newSystem.focus();
}

function start() {
  bindUi();
  ui.newSessionButton.addEventListener("click", openNewSessionDialog);
  ui.newSessionCancel.addEventListener("click", () => ui.newSessionDialog.close());
  ui.newSessionForm.addEventListener("submit", createSession);
  ui.openSessionForm.addEventListener("submit", openSessionById);
  ui.sessionSelect.addEventListener("change", () => {
    if (ui.sessionSelect.value) selectSession(ui.sessionSelect.value);
  });
  ui.composer.addEventListener("submit", sendMessage);
  ui.stopButton.addEventListener("click", stopAnswer);
  ui.input.addEventListener("keydown", onComposerKey);
  ui.compactForm.addEventListener("submit", requestCompaction);
  ui.logClear.addEventListener("click", () => ui.log.replaceChildren());
  ui.messages.addEventListener("scroll", loadOlder);
  ui.deleteButton.addEventListener("click", deleteSession);
  window.addEventListener("hashchange", () => {
    const id = sessionFromHash();
    if (id && id !== app.sessionId) selectSession(id, { updateHash: false });
  });

  renderSessionPicker();
  mergeServerSessions();
  renderGauge();
  let stored = null;
  try {
    stored = localStorage.getItem(STORE_CURRENT);
  } catch {
    // ignore
  }
  const initial = sessionFromHash() ?? (isValidSessionId(stored) ? stored : null);
  if (initial) selectSession(initial);
  else setComposerEnabled(false);
}

// Importable without a DOM (the tests load the parser and helpers under node).
if (typeof document !== "undefined") {
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start);
  else start();
}
