// The generator panel: the state badge, the compacting banner, the context
// gauge, the session's facts, the compaction form, the event log and the
// compaction timeline.

import { API, requestJson } from "./api.js";
import { app, clockTime, el, fmt, lastItem, percent, show, ui } from "./shared.js";

export const STATES = [
  "idle", "receiving", "generating", "dispatching_tool", "waiting_for_tool",
  "publishing", "compacting", "error",
];

const MAX_LOG_LINES = 50;

// The timeline shows this many of the newest compactions, oldest first; the
// session's facts count them all.
const TIMELINE_ROWS = 100;

const WARN_AT = 0.8;

const DANGER_AT = 0.95;

// "danger" from 95 % of the budget; "warn" from where automatic compaction
// begins (`compactsAt`, tokens), or from 80 % for a session never compacted by
// itself; "ok" below.
export function gaugeLevel(tokens, budget, compactsAt = null) {
  if (typeof tokens !== "number" || typeof budget !== "number" || budget <= 0) return "ok";
  if (tokens / budget >= DANGER_AT) return "danger";
  const warnAt = typeof compactsAt === "number" ? compactsAt : WARN_AT * budget;
  return tokens >= warnAt ? "warn" : "ok";
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

// The session's state as the server computes it (services/core/state_machine.py):
// a running compaction, whichever generator runs it, else the turn's phase.
export function sessionState(phase, compacting) {
  return compacting ? "compacting" : phase;
}

export async function loadTimeline(id) {
  let page;
  try {
    const newest = { before: "end", kind: "compaction", limit: TIMELINE_ROWS };
    page = await requestJson(API.transcript(id, newest));
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

export function setState(stateName, detail = "") {
  const known = STATES.includes(stateName) ? stateName : "unknown";
  ui.stateBadge.dataset.state = known;
  ui.stateBadge.textContent = (stateName || "unknown").replace(/_/g, " ");
  ui.stateDetail.textContent = detail;
}

// The badge says what the session does: compacting while a compaction runs,
// with the turn answered meanwhile, if any, in the detail.
export function renderState(detail = "") {
  const compacting = app.compacting !== null;
  const turn = compacting && app.phase !== "idle" && app.phase !== "unknown"
    ? `answering meanwhile: ${app.phase.replace(/_/g, " ")}` : "";
  setState(sessionState(app.phase, compacting), compacting ? turn : detail);
}

export function renderCompacting() {
  const visible = compactingNow();
  show(ui.compactingBanner, visible);
  ui.compactingBanner.textContent = progressText(app.compactionProgress);
  document.body.classList.toggle("is-compacting", visible);
  renderCompactButton();
}

function compactingNow() {
  return app.compacting !== null || app.phase === "compacting";
}

// Compact now, for a session open and not compacting: a second click during a
// compaction was skipped ("nothing to compact"), and its line replaced the
// first one's result.
export function renderCompactButton() {
  ui.compactButton.disabled = !app.sessionId || ui.input.disabled || compactingNow();
}

function fillBar(bar, fill, fraction, level) {
  const pct = Math.max(0, Math.min(100, fraction * 100));
  fill.style.width = `${pct}%`;
  bar.dataset.level = level;
  bar.setAttribute("aria-valuenow", String(Math.round(pct)));
}

// A mark on the gauge at `tokens` of the window; hidden without a number.
function markAt(mark, tokens, numCtx) {
  show(mark, typeof tokens === "number");
  if (typeof tokens === "number") mark.style.left = `${Math.min(100, (tokens / numCtx) * 100)}%`;
}

export function renderGauge() {
  renderNextPrompt(app.session);
  renderLastPrompt(app.session, app.lastGeneration);
}

// The estimate of the next prompt, against the budget and where automatic compaction begins.
function renderNextPrompt(s) {
  if (s && typeof s.token_count === "number" && s.num_ctx > 0) {
    const compactsAt = typeof s.compacts_at === "number" ? s.compacts_at : null;
    fillBar(ui.gauge, ui.gaugeFill, s.token_count / s.num_ctx,
      gaugeLevel(s.token_count, s.budget, compactsAt));
    markAt(ui.gaugeBudget, s.budget, s.num_ctx);
    markAt(ui.gaugeThreshold, compactsAt, s.num_ctx);
    const compaction = compactsAt === null ? "automatic compaction off"
      : `compacts from ${fmt(compactsAt)}`;
    const over = s.token_count > s.budget ? ` · ${overBudget(compactsAt)}` : "";
    ui.gaugeText.textContent =
      `${fmt(s.token_count)} / ${fmt(s.budget)} tokens (${percent(s.token_count, s.budget)}%) · window ${fmt(s.num_ctx)} · ${compaction}${over}`;
    ui.gauge.setAttribute("aria-valuetext", ui.gaugeText.textContent);
  } else {
    fillBar(ui.gauge, ui.gaugeFill, 0, "ok");
    markAt(ui.gaugeBudget, null);
    markAt(ui.gaugeThreshold, null);
    ui.gaugeText.textContent = "—";
  }
}

// An answer may use the window's room beyond the budget, so the next prompt
// can be over it: say what the next message meets, not only a figure past 100 %.
function overBudget(compactsAt) {
  return compactsAt === null ? "over the budget: compact before the next message"
    : "over the budget: the next message compacts first";
}

// The last prompt as the model counted it: from its report (`g`), this page's
// last reply, or the newest answer stored.
function renderLastPrompt(s, g) {
  const numCtx = g?.num_ctx ?? s?.num_ctx;
  const budget = s?.budget ?? numCtx;
  const promptTokens = typeof g?.prompt_tokens === "number" ? g.prompt_tokens
    : app.lastReply?.prompt_tokens ?? lastStoredAnswer()?.prompt_tokens;
  if (typeof promptTokens === "number" && numCtx > 0) {
    fillBar(ui.gaugeLast, ui.gaugeLastFill, promptTokens / numCtx,
      gaugeLevel(promptTokens, budget, s?.compacts_at));
    const parts = [`${fmt(promptTokens)} / ${fmt(numCtx)} tokens (${percent(promptTokens, numCtx)}% of the window)`];
    if (g) {
      if (typeof g.completion_tokens === "number") parts.push(`${fmt(g.completion_tokens)} generated`);
      if (typeof g.duration_ms === "number") parts.push(`${fmt(g.duration_ms)} ms`);
    }
    ui.gaugeLastText.textContent = parts.join(" · ");
    ui.gaugeLast.setAttribute("aria-valuetext", parts[0]);
  } else {
    fillBar(ui.gaugeLast, ui.gaugeLastFill, 0, "ok");
    const answered = g || app.lastReply || lastStoredAnswer();
    ui.gaugeLastText.textContent = answered ? "The model did not report prompt tokens for the last call." : "No generation yet.";
  }
  if (g && (typeof g.next_prompt_chars === "number" || typeof g.compactable_chars === "number")) {
    ui.gaugeLastText.append(el("br"), el("span", {
      className: "hint",
      text: `next prompt ≈ ${fmt(g.next_prompt_chars)} chars · compactable ${fmt(g.compactable_chars)} chars`,
    }));
  }
}

// The newest answer of the transcript shown, which a page opened after its
// turn reads its counts from: it heard neither that turn's reply nor its report.
function lastStoredAnswer() {
  return lastItem((item) => item.kind === "message" && item.role === "assistant" && !item.tool_calls?.length);
}

function autoCompaction(s) {
  if (!s.auto_compact) return "off";
  return s.compacts_at === null ? "on, but off for every session (threshold 0)" : "on";
}

// `s` null clears the facts (while another session loads).
export function renderSessionFacts(s) {
  ui.factModel.textContent = s?.model ?? "—";
  ui.factAuto.textContent = s ? autoCompaction(s) : "—";
  ui.factCompactions.textContent = s ? String(s.compactions ?? 0) : "—";
  ui.factMessages.textContent = s ? String((s.messages ?? []).length) : "—";
  ui.summaryText.textContent = s?.summary ?? "";
  show(ui.summaryBox, Boolean(s?.summary));
  ui.systemText.textContent = s?.system ?? "";
  show(ui.systemBox, Boolean(s?.system));
}

export async function requestCompaction(event) {
  event.preventDefault();
  const id = app.sessionId;
  if (!id) return;
  const instructions = ui.compactInstructions.value.trim();
  ui.compactButton.disabled = true;
  ui.compactStatus.dataset.kind = "info";
  const requesting = "Requesting compaction…";
  ui.compactStatus.textContent = requesting;
  try {
    await requestJson(API.compact(id), { method: "POST", body: instructions ? { instructions } : {} });
    if (app.sessionId !== id) return; // the user moved to another session meanwhile
    // Unless the live feed told its outcome already (it can outrun this answer).
    if (ui.compactStatus.textContent === requesting) {
      ui.compactStatus.textContent = "Compaction requested — progress shows in the events below.";
    }
    ui.compactInstructions.value = "";
  } catch (err) {
    if (app.sessionId !== id) return;
    ui.compactStatus.dataset.kind = "error";
    ui.compactStatus.textContent = `Compaction not requested: ${err.message}`;
  } finally {
    renderCompactButton();
  }
}

export function logLine(kind, text, timestamp) {
  const item = el("li", { className: `log-line log-${kind.replace(/[^a-z]/gi, "-")}` }, [
    el("time", { className: "log-time", text: clockTime(timestamp) }),
    el("span", { className: "log-kind", text: kind }),
    el("span", { className: "log-text", text }),
  ]);
  ui.log.prepend(item);
  while (ui.log.children.length > MAX_LOG_LINES) ui.log.lastElementChild.remove();
}
