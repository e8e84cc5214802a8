// The session picker: sessions this browser knows (localStorage) and the
// server lists, the #session= hash, switching to a session and reading it,
// creating, opening and deleting one.

import { API, listSessions, requestJson } from "./api.js";
import { app, clearNotice, el, isValidSessionId, show, showNotice, ui } from "./shared.js";
import { compactingAfterRead, connectEvents, disconnectEvents, newestSeen, staleState } from "./live.js";
import { abandonAnswer, clearTranscript, loadNewer, renderRetry, resumeTurn, setComposerEnabled } from "./chat.js";
import { forgetKeptTurn } from "./kept.js";
import {
  loadTimeline,
  renderCompacting,
  renderGauge,
  renderSessionFacts,
  renderState,
  setState,
} from "./panel.js";

const STORE_KNOWN = "chat.sessions";

export const STORE_CURRENT = "chat.currentSession";

const MAX_KNOWN_SESSIONS = 50;

const LABEL_CHARACTERS = 40;

// A session's label in the picker: the start of its first message, cut
// between the characters a person sees. Cut between UTF-16 units it split an
// emoji in two; between code points, a flag or a family into its parts.
const GRAPHEMES = typeof Intl.Segmenter === "function" ? new Intl.Segmenter(undefined, { granularity: "grapheme" }) : null;

export function labelOf(content) {
  const characters = GRAPHEMES
    ? Array.from(GRAPHEMES.segment(content), (part) => part.segment)
    : Array.from(content);
  return characters.slice(0, LABEL_CHARACTERS).join("");
}

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

export function rememberSession(id, label) {
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
export async function mergeServerSessions() {
  let body;
  try {
    const response = await listSessions();
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

export function renderSessionPicker() {
  const select = ui.sessionSelect;
  const list = knownSessions();
  const options = [el("option", { text: list.length ? "(choose a session)" : "(no session)", attrs: { value: "" } })];
  for (const entry of list) {
    options.push(el("option", { text: sessionLabel(entry), attrs: { value: entry.id, title: entry.id } }));
  }
  select.replaceChildren(...options);
  select.value = app.sessionId && list.some((s) => s.id === app.sessionId) ? app.sessionId : "";
}

export function sessionFromHash() {
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

// The session shown goes, with all the page shows of it: its answer being
// read, its state, numbers, log, transcript and timeline. Another one, or
// none, is shown next.
function leaveSession() {
  abandonAnswer();
  app.session = null;
  app.lastGeneration = null;
  app.lastReply = null;
  app.compacting = null;
  app.phase = "unknown";
  app.stateSeen = null;
  app.items = [];
  app.older = null;
  clearTranscript();
  ui.log.replaceChildren();
  renderSessionFacts(null);
  setState("unknown");
  renderGauge();
  renderCompacting();
  ui.compactStatus.textContent = "";
  ui.timeline.replaceChildren();
}

export function selectSession(id, { updateHash = true } = {}) {
  if (!isValidSessionId(id)) return;
  if (app.sessionId === id && app.events) return;
  leaveSession();
  app.sessionId = id;
  try {
    localStorage.setItem(STORE_CURRENT, id);
  } catch {
    // ignore
  }
  if (updateHash && sessionFromHash() !== id) {
    history.replaceState(null, "", `#session=${encodeURIComponent(id)}`);
  }
  rememberSession(id);
  renderSessionPicker(); // a session known already, with its label, left it showing another
  showNotice("");
  setComposerEnabled(true);
  setExportLinks(id);
  connectEvents(id);
  // Once the stored messages show (whichever read brings them first), a turn
  // this tab sent and did not hear the end of, cut by a reload or a visit
  // elsewhere, is read again.
  app.resumeFor = id;
  app.timelineStale = true;
  loadSession();
}

// Reads of the session under way. While there are any, or one is scheduled
// (`scheduleRefresh`), the conversation says it is being brought up to date
// (aria-busy): a screen reader waits for the whole of it before reading it
// out, and so can a test before it acts.
let readsUnderWay = 0;

function showReading() {
  const reading = readsUnderWay > 0 || app.refreshTimer !== null;
  ui.messages.setAttribute("aria-busy", String(reading));
}

export async function loadSession(options) {
  readsUnderWay += 1;
  showReading();
  try {
    await readSession(options);
  } finally {
    readsUnderWay -= 1;
    showReading();
  }
}

async function readSession({ messages = true } = {}) {
  const id = app.sessionId;
  if (!id) return;
  const seq = ++app.loadSeq;
  const current = () => seq === app.loadSeq && id === app.sessionId;
  let session;
  try {
    session = await requestJson(API.session(id));
  } catch (err) {
    if (current()) sessionUnread(id, err);
    return;
  }
  if (!current()) return; // a newer load or another session
  app.session = session;
  clearNotice("read");
  const shown = messages && !app.busy && await loadNewer(id);
  if (!current()) return; // overtaken while the messages loaded
  if (shown && app.resumeFor === id) {
    app.resumeFor = null;
    resumeTurn(id);
  }
  if (app.timelineStale) { // not on every turn's read: only a compaction changes it
    app.timelineStale = false;
    loadTimeline(id);
  }
  if (messages && app.busy) app.reloadAfterTurn = true; // the end of the turn reloads them
  renderSessionFacts(session);
  renderGauge();
  renderPhase(session, seq);
  labelSession(id, session);
}

function sessionUnread(id, err) {
  if (err.status === 404) closeGoneSession(id);
  else showNotice(`Could not load the session: ${err.message}`);
}

// The session is not on the server (any more): nothing can go into it here.
export function closeGoneSession(id) {
  showNotice(`Session ${id} does not exist (any more). It was removed from the list; create a new one.`);
  forgetSession(id);
  disconnectEvents();
  setComposerEnabled(false);
}

// The badge and banner after read `seq` of the session.
function renderPhase(session, seq) {
  const wasCompacting = app.compacting;
  app.compacting = compactingAfterRead(app.compacting, session.state, seq,
    app.compactingSeenAt, app.compactionEndSeenAt);
  // During a turn its phase follows the live events, which a read may trail,
  // as it may any event newer than itself.
  const trailing = staleState(app.stateSeen, session.state_at, session.state_by);
  app.stateSeen = newestSeen(app.stateSeen, session.state_at, session.state_by);
  if (session.state && !app.busy && !trailing) {
    app.phase = session.phase ?? session.state;
    renderState();
    renderRetry();
  } else if (app.compacting !== wasCompacting) {
    renderState();
  }
  renderCompacting();
}

// A session is labelled by its first message. The context holds that one only
// until a compaction: after one, its first message was a later one, and the
// transcript's first page says.
async function labelSession(id, session) {
  if (knownSessions().some((s) => s.id === id && s.label)) return;
  let messages = session.messages || [];
  if (session.compactions > 0) {
    try {
      messages = (await requestJson(API.transcript(id, { kind: "message", limit: 10 }))).items ?? [];
    } catch {
      return; // labelled on a later read
    }
  }
  const firstUser = messages.find((m) => m.role === "user");
  if (firstUser) rememberSession(id, labelOf(firstUser.content));
}

// Coalesces refreshes asked for by a burst of live events.
export function scheduleRefresh() {
  clearTimeout(app.refreshTimer);
  app.refreshTimer = setTimeout(() => {
    app.refreshTimer = null;
    loadSession({ messages: !app.busy }); // under way, and shown so, at once
  }, 250);
  showReading();
}

function cancelRefresh() {
  clearTimeout(app.refreshTimer);
  app.refreshTimer = null;
  showReading();
}

export async function createSession(event) {
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

export function openSessionById(event) {
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

export async function deleteSession() {
  const id = app.sessionId;
  if (!id) return;
  const ok = window.confirm("Delete this session for good? Its whole transcript, summary and "
    + "queued messages are removed; this cannot be undone.");
  if (!ok) return;
  // Before the deletion ends its stream: the message would go back into the
  // composer, and the turn's end read a session no longer there. Its live
  // events too: each asked for a read of the session, answered 404.
  abandonAnswer();
  disconnectEvents();
  cancelRefresh();
  try {
    await requestJson(API.session(id), { method: "DELETE" });
  } catch (err) {
    if (err.status !== 404) {
      if (app.sessionId === id) await deleteRefused(id, err);
      return;
    }
  }
  forgetSession(id);
  forgetCurrentSession(id);
  forgetKeptTurn(id);
  // Another session opened while the delete was on its way stays shown.
  if (app.sessionId !== id) return;
  leaveSession();
  app.sessionId = null;
  setComposerEnabled(false);
  setExportLinks(null);
  history.replaceState(null, "", "#");
  showNotice(`Session ${id} was deleted.`, "delete");
}

// The session stays: its feed and its answer under way are taken up again.
async function deleteRefused(id, err) {
  showNotice(`Could not delete the session: ${err.message}`, "delete");
  connectEvents(id);
  app.resumeFor = id;
  await loadSession();
}

// A reload is not to open a deleted session again (and report it missing),
// unless another tab has made another session its current one meanwhile.
function forgetCurrentSession(id) {
  try {
    if (localStorage.getItem(STORE_CURRENT) === id) localStorage.removeItem(STORE_CURRENT);
  } catch {
    // storage disabled: nothing was kept
  }
}

function setExportLinks(id) {
  for (const [link, format] of [[ui.exportMarkdown, "markdown"], [ui.exportJson, "json"]]) {
    if (id) link.setAttribute("href", API.exportAs(id, format));
    else link.removeAttribute("href");
  }
}

export function openNewSessionDialog() {
  show(ui.newSessionError, false);
  if (typeof ui.newSessionDialog.showModal === "function") ui.newSessionDialog.showModal();
  else ui.newSessionDialog.setAttribute("open", "");
  ui.newSystem.focus();
}
