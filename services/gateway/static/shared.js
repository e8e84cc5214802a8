// What every part of the page shares: its state (`app`), the elements it binds
// (`ui`, filled by bindUi() in app.js), number and time formatting, the DOM
// helpers, and the announcements that pass up between the modules. Data is put
// into the page as text only (textContent / createTextNode).

const SESSION_ID = /^[A-Za-z0-9_-]{1,64}$/;


const numberFormat = new Intl.NumberFormat("en-US");

export function fmt(n) {
  return typeof n === "number" && Number.isFinite(n) ? numberFormat.format(Math.round(n)) : "?";
}

export function percent(part, whole) {
  if (typeof part !== "number" || typeof whole !== "number" || whole <= 0) return 0;
  return Math.round((part / whole) * 100);
}

export function clockTime(timestamp) {
  const date = timestamp ? new Date(timestamp) : new Date();
  const valid = Number.isNaN(date.getTime()) ? new Date() : date;
  return valid.toLocaleTimeString([], { hour12: false });
}

export function isValidSessionId(id) {
  return typeof id === "string" && SESSION_ID.test(id);
}

export function byId(id) {
  const node = document.getElementById(id);
  if (!node) throw new Error(`page is missing #${id}`);
  return node;
}

// Builds an element. `text` is always set as text; children may be nodes or strings
// (strings become text nodes). No markup is ever parsed.
export function el(tag, { className, text, attrs } = {}, children = []) {
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

// The newest item of the transcript shown that `wanted` accepts, or null.
export function lastItem(wanted) {
  for (let i = app.items.length - 1; i >= 0; i -= 1) {
    if (wanted(app.items[i])) return app.items[i];
  }
  return null;
}

export function show(node, visible) {
  node.hidden = !visible;
}

// Whether the reader is at the end of the message list, where new text keeps them.
export function nearBottom() {
  const box = ui.messages;
  return box.scrollHeight - box.scrollTop - box.clientHeight < 80;
}

export function scrollToEnd(force = false) {
  if (force || nearBottom()) ui.messages.scrollTop = ui.messages.scrollHeight;
}

// The chat and the live feed say here that the session is to be read again,
// or that a message went into it; the session picker, above them, listens.
// So the modules stand in layers, none importing one that imports it.
const happenings = new EventTarget();

export function announce(name, detail = {}) {
  happenings.dispatchEvent(new CustomEvent(name, { detail }));
}

export function whenAnnounced(name, handler) {
  happenings.addEventListener(name, (event) => handler(event.detail));
}

export const app = {
  sessionId: null,
  session: null, // last GET /api/sessions/{id}
  busy: false, // a message is being answered
  abort: null, // AbortController of the answer being read
  events: null, // EventSource
  eventsRetry: null, // timer of the next try at the live feed, after the browser gave up
  lastGeneration: null, // payload of the latest response.generation
  lastReply: null, // prompt/completion tokens of the latest done event
  reloadAfterTurn: false, // a reload was asked for while an answer was streaming
  loadSeq: 0,
  refreshTimer: null,
  phase: "unknown", // the turn's phase, from generator.state events and reads
  stateSeen: null, // { at, by }: when, and by which generator, the newest of those was entered
  compacting: null, // correlation id of the compaction running, if one is
  compactingSeenAt: 0, // loadSeq when that compaction's start arrived
  compactionEndSeenAt: 0, // loadSeq when the last compaction result arrived
  compactionEnded: null, // that result's correlation id
  items: [], // the transcript items shown, oldest first
  older: null, // cursor of the page before them; null at the start
  loadingOlder: false,
  pending: null, // the answer being waited for, while one is (a PendingAnswer, answer.js)
  turnKey: null, // { key, retry } of that answer's turn: a Stop names it
  timelineStale: false, // the compaction timeline is to be read with the session's next read
  resumeFor: null, // the session opened, whose cut turn, if any, is read again once shown
  compactionProgress: null, // the running compaction's last progress event
  noticeAbout: null, // what the notice shown says failed (showNotice)
};

export const ui = {};

// A notice says what failed; `about` says what it was: "read" (the session or
// its messages), "stop" or "delete". Only a later success of the same kind
// takes it away (`clearNotice`): a read of the session, which the live feed
// asks for at any moment, must not wipe out a refused delete. Opening another
// session takes any away (an empty message).
export function showNotice(message, about = "read") {
  app.noticeAbout = message ? about : null;
  ui.notice.textContent = message;
  show(ui.notice, Boolean(message));
}

export function clearNotice(about) {
  if (app.noticeAbout === about) showNotice("");
}
