// The live feed: the session's live events (GET /api/events), what each one
// changes on the page, and the feed's own connection.

import { openEvents } from "./api.js";
import { announce, app, fmt, ui } from "./shared.js";
import {
  logLine,
  renderCompacting,
  renderGauge,
  renderState,
  sessionAfterCompaction,
} from "./panel.js";
import { renderRetry } from "./chat.js";

// The live feed names each server-sent event after the message type it
// carries; one handler per type: (payload, timestamp, correlation id).
const LIVE_HANDLERS = new Map([
  ["generator.state", onStateChange],
  ["response.generation", onGeneration],
  ["compaction.request", onCompactionRequest],
  ["compaction.event", onCompactionEvent],
  ["compaction.result", onCompactionResult],
  ["session.deleted", onSessionDeleted],
  ["settings.changed", onSettingsChanged],
]);

export const LIVE_EVENT_TYPES = [...LIVE_HANDLERS.keys()];

// Whether a live state change, stamped `at` by generator `by`, is older than
// the newest state this page knows (`seen`: { at, by }, from a read or an
// earlier event): the feed may bring a turn's last changes after a read that
// saw the turn end, and they would stand for the session's state until the
// next. Only one generator's stamps are compared: two clocks may disagree.
export function staleState(seen, at, by) {
  if (!seen || seen.by !== by) return false;
  const known = micros(seen.at);
  const stamp = micros(at);
  return Number.isFinite(known) && Number.isFinite(stamp) && stamp < known;
}

// A stamp in microseconds since the epoch (NaN if it is none). The services
// stamp to the microsecond, and a turn's changes often fall within one
// millisecond, which is all Date.parse keeps.
export function micros(at) {
  const ms = Date.parse(at ?? "");
  if (!Number.isFinite(ms)) return NaN;
  const fraction = /\.(\d+)/.exec(at)?.[1] ?? "";
  return ms * 1000 + Number(fraction.padEnd(6, "0").slice(3, 6));
}

// The newest state known once a change (or a read) stamped `at` by `by` is
// taken in; one with no time leaves it as it was.
export function newestSeen(seen, at, by) {
  if (!Number.isFinite(micros(at)) || staleState(seen, at, by)) return seen;
  return { at, by };
}

// The compaction the "compacting" banner stands for (its correlation id), after
// a live event. Only that compaction's own result ends it: a second request,
// skipped because one already runs, must not hide the banner. One known only
// from a read of the session ("unknown") ends with any result. Progress of the
// compaction whose result came last (`ended`) is late, and does not bring the
// banner back; a start always does (a turn's second emergency compaction runs
// under the query's id, as its first did).
export function compactingAfter(current, type, correlationId, event, ended = null) {
  const echo = correlationId != null && correlationId === ended;
  if (type === "compaction.event" && event === "started") return correlationId ?? "unknown";
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

function setLive(status) {
  ui.liveStatus.dataset.live = status;
  ui.liveStatus.textContent = `live: ${status}`;
}

// The browser tries a dropped stream again by itself, but gives up on one
// answered with an error status (429 too many streams, 503 while the gateway
// stops): the page then tries again itself, waiting longer each time.
const RETRY_FIRST_MS = 1000;
const RETRY_MOST_MS = 30000;

export function disconnectEvents() {
  clearTimeout(app.eventsRetry);
  app.eventsRetry = null;
  if (app.events) app.events.close();
  app.events = null;
  setLive("off");
}

// A browser opens at most six connections to one host, for all its tabs: a
// few tabs each holding its live feed open left none for a message, a Stop or
// a read, which then waited without end. A hidden tab lets its feed go, and
// takes it up again, reloading the session, when it is shown.
let pausedFor = null;

export function followVisibility() {
  document.addEventListener("visibilitychange", () => {
    if (document.hidden) {
      if (app.events || app.eventsRetry) pauseEvents(app.sessionId);
    } else if (pausedFor) {
      const id = pausedFor;
      pausedFor = null;
      if (id === app.sessionId && !app.events) connectEvents(id, { wasDown: true });
    }
  });
}

function pauseEvents(id) {
  disconnectEvents();
  pausedFor = id;
  setLive("paused");
}

export function connectEvents(id, { retryMs = RETRY_FIRST_MS, wasDown = false } = {}) {
  if (document.hidden) {
    pauseEvents(id); // opened in the background (or restored so): taken up once shown
    return;
  }
  disconnectEvents();
  setLive("connecting");
  const source = openEvents(id);
  const feed = { id, source, retryMs, wasDown };
  app.events = source;
  source.onopen = () => {
    if (app.events === source) feedOpened(feed);
  };
  source.onerror = () => {
    if (app.events === source) feedFailed(feed);
  };
  for (const type of LIVE_EVENT_TYPES) {
    source.addEventListener(type, (event) => {
      if (app.events === source) onLiveEvent(type, event.data);
    });
  }
}

// Open means listening (the gateway's headers wait for it). What happened
// before is read now: while the feed was down, or, on a first open, between
// the session's read as it opened and the feed's listening.
function feedOpened(feed) {
  setLive("connected");
  feed.retryMs = RETRY_FIRST_MS;
  if (feed.wasDown) {
    logLine("live", "reconnected; reloading the session");
    // Reports may have been missed meanwhile: the last prompt is read from
    // the newest stored answer until the next one comes.
    app.lastGeneration = null;
    app.lastReply = null;
    app.timelineStale = true; // a compaction may have ended meanwhile too
  }
  announce("refresh-wanted");
  feed.wasDown = false;
}

function feedFailed(feed) {
  feed.wasDown = true;
  if (feed.source.readyState !== EventSource.CLOSED) {
    setLive("reconnecting");
    return;
  }
  setLive("closed");
  const next = { retryMs: Math.min(feed.retryMs * 2, RETRY_MOST_MS), wasDown: true };
  app.eventsRetry = setTimeout(() => {
    if (app.events === feed.source) connectEvents(feed.id, next);
  }, feed.retryMs);
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
  const handle = LIVE_HANDLERS.get(type);
  if (handle) handle(p, envelope.timestamp, envelope.correlation_id);
  else logLine(type, "event", envelope.timestamp);
}

// A live setting changed (the compaction threshold): the session is read
// again, whose answer says where automatic compaction now begins.
function onSettingsChanged(p, ts) {
  const threshold = typeof p.compaction_threshold === "number"
    ? ` (compaction threshold ${p.compaction_threshold})` : "";
  logLine("settings.changed", `live settings changed${threshold}`, ts);
  announce("refresh-wanted");
}

// Deleted elsewhere (another tab, another client): the read that follows
// finds it gone, says so and closes it here, before a message is sent into it.
function onSessionDeleted(p, ts) {
  logLine("session.deleted", "the session was deleted", ts);
  announce("session-stale");
}

function onStateChange(p, ts) {
  const change = `${p.from_state ?? "?"} → ${p.to_state ?? "?"}${p.action ? ` (${p.action})` : ""}`;
  if (staleState(app.stateSeen, ts, p.generator_id)) {
    logLine("generator.state", `${change}: late, passed over`, ts);
    return;
  }
  app.stateSeen = newestSeen(app.stateSeen, ts, p.generator_id);
  app.phase = p.to_state ?? "unknown";
  app.pending?.stateChanged(p.action, p.to_state);
  renderState(p.action ? `after ${p.action}` : "");
  renderCompacting();
  renderRetry();
  logLine("generator.state", change, ts);
}

function onGeneration(p, ts) {
  app.lastGeneration = p;
  renderGauge();
  logLine("response.generation", `prompt ${fmt(p.prompt_tokens)} · completion ${fmt(p.completion_tokens)} tokens · ` +
    `${fmt(p.sent_chars)} chars sent · ${fmt(p.duration_ms)} ms`, ts);
  announce("refresh-wanted");
}

function onCompactionRequest(p, ts) {
  logLine("compaction.request", `${p.auto ? "automatic" : "manual"} compaction requested (${p.level ?? "gentle"})` +
    `${p.reason ? `: ${p.reason}` : ""}`, ts);
}

function onCompactionEvent(p, ts, correlationId) {
  const type = "compaction.event";
  app.compacting = compactingAfter(app.compacting, type, correlationId, p.event,
    app.compactionEnded);
  if (p.event === "started") app.compactingSeenAt = app.loadSeq;
  app.compactionProgress = p.event === "progress" ? p : null;
  renderState();
  renderCompacting();
  if (p.event === "progress") {
    logLine(type, `compaction progress: ${fmt(p.pieces_done)} of ${fmt(p.pieces_total)} pieces written`, ts);
    return;
  }
  logLine(type, `compaction ${p.event ?? "?"} (${p.level ?? "?"}, ${p.auto ? "auto" : "manual"})` +
    `${typeof p.tokens_before === "number" ? ` at ${fmt(p.tokens_before)} tokens` : ""}` +
    `${p.reason ? `: ${p.reason}` : ""}`, ts);
}

function onCompactionResult(p, ts, correlationId) {
  const type = "compaction.result";
  app.compacting = compactingAfter(app.compacting, type, correlationId);
  app.compactionEndSeenAt = app.loadSeq;
  app.compactionEnded = correlationId ?? null;
  if (app.compacting === null) app.compactionProgress = null;
  renderState();
  renderCompacting();
  const status = p.status ?? "completed";
  const text = compactionResultText(status, p);
  logLine(type, text, ts);
  ui.compactStatus.dataset.kind = status === "failed" ? "error" : "info";
  ui.compactStatus.textContent = text.charAt(0).toUpperCase() + text.slice(1);
  if (status === "completed") {
    app.session = sessionAfterCompaction(app.session, p);
    app.timelineStale = true;
    renderGauge();
    if (app.busy) app.reloadAfterTurn = true; // the turn's end reloads
    else announce("session-stale");
  }
}

function compactionResultText(status, p) {
  if (status === "completed") {
    return `compaction completed: ${fmt(p.tokens_before)} → ${fmt(p.tokens_after)} tokens`;
  }
  if (status === "skipped") return `compaction skipped${p.error ? `: ${p.error}` : ""}`;
  return `compaction failed: ${p.error ?? "unknown error"}`;
}
