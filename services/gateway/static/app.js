// The gateway's single page: chat on the left, the live generator panel on the right.
//
// Plain ES2020 modules, no dependencies, no build step: this one binds the page's
// elements and wires the others. They stand in layers, each importing only those
// below it: shared, api, sse and kept; panel and answer; chat; live; sessions.
// Every piece of data that comes from the user, the model, a tool or the server is put into
// the page as text (textContent / createTextNode), never parsed as markup.

import { app, byId, isValidSessionId, ui, whenAnnounced } from "./shared.js";
import { loadOlder, onComposerKey, sendMessage, setComposerEnabled, stopAnswer } from "./chat.js";
import { followVisibility } from "./live.js";
import { renderGauge, requestCompaction } from "./panel.js";
import {
  STORE_CURRENT,
  closeGoneSession,
  createSession,
  deleteSession,
  labelOf,
  loadSession,
  mergeServerSessions,
  openNewSessionDialog,
  openSessionById,
  rememberSession,
  renderSessionPicker,
  scheduleRefresh,
  selectSession,
  sessionFromHash,
} from "./sessions.js";

// The page's elements by the names the modules use for them (`ui.<name>`).
const UI_IDS = {
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
  gaugeThreshold: "gauge-threshold",
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

function bindUi() {
  for (const [name, id] of Object.entries(UI_IDS)) ui[name] = byId(id);
}

// What the chat and the live feed announce, the session picker acts on.
function followAnnouncements() {
  whenAnnounced("session-stale", ({ messages }) => loadSession({ messages }));
  whenAnnounced("refresh-wanted", scheduleRefresh);
  whenAnnounced("message-sent", ({ id, content }) => rememberSession(id, labelOf(content)));
  whenAnnounced("session-gone", ({ id }) => closeGoneSession(id));
}

// Each control of the page, to what it does.
function bindControls() {
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
  followVisibility();
  ui.deleteButton.addEventListener("click", deleteSession);
  window.addEventListener("hashchange", () => {
    const id = sessionFromHash();
    if (id && id !== app.sessionId) selectSession(id, { updateHash: false });
  });
}

// The session the address names, else the one this browser showed last.
function openFirstSession() {
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

function start() {
  bindUi();
  followAnnouncements();
  bindControls();
  renderSessionPicker();
  mergeServerSessions();
  renderGauge();
  openFirstSession();
}

// Importable without a DOM (the tests load the parser and helpers under node).
if (typeof document !== "undefined") {
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start);
  else start();
}
