// An answer as the chat shows it: the bubble of the one being written (what it
// waits for, its pieces as they stream, its end or its failure), and the parts
// a stored answer shares with it (its thinking, its token counts).

import { app, el, fmt, nearBottom, scrollToEnd } from "./shared.js";

// Text written by people and models takes its direction from its first
// letter: Hebrew or Arabic runs right to left, its punctuation on the left.
export const OWN_DIRECTION = { dir: "auto" };

// Failures after which the message may or may not have been taken: sending it
// again under its key is answered once (stored or not, it is never doubled).
// (An error status without our JSON, from a proxy on the way, reads as http_<status>.)
const UNKNOWN_OUTCOME = [
  "network_error", "stream_ended", "nats_unavailable", "reply_timeout", "gateway_stopping",
  "http_502", "http_503", "http_504",
];

export function offersSendAgain(error) {
  return UNKNOWN_OUTCOME.includes(error?.code);
}

// Stop on a message still waiting for its turn withdraws it (the gateway
// answers the message so); the message goes back into the composer.
const WITHDRAWN_NOTE = "withdrawn before its turn: not answered, and nothing of it kept";

const QUIET_PHASES = ["idle", "unknown", "error"];

// What an answer not yet begun waits for, after a state change of its session
// (action, to_state). Sent while the session answered an earlier message, it
// is queued until that turn ends (reset); once its own turn runs and before
// any token, it waits for the model (a free slot of the model server).
export function pendingAfter(pending, action, toState) {
  if (pending.resumed) return pending; // whose turn a state is, the page cannot tell
  if (pending.queued) return action === "reset" ? { queued: false, started: false } : pending;
  if (toState === "receiving" || toState === "generating") return { queued: false, started: true };
  return pending;
}

export function pendingText(pending) {
  if (pending.resumed) return "sent earlier from this tab: waiting for its answer…";
  if (pending.queued) return "queued: the session's earlier message is answered first…";
  if (pending.started) return "waiting for the model…";
  return "waiting for a generator…";
}

// A thinking model's thinking, by the query it answered: never stored, so
// kept here for this page's life, or drawing the transcript again (as every
// turn's end does) took it away the moment it was shown.
export const thoughts = new Map();

// Apart from the answer, folded: it is not part of the conversation.
export function thinkingBlock(thinking) {
  return el("details", { className: "msg-thinking" }, [
    el("summary", { text: "thinking" }),
    el("div", { className: "msg-text", text: thinking, attrs: OWN_DIRECTION }),
  ]);
}

// An answer's counts, as the model reported them for the call that wrote it.
export function tokenCounts(answer) {
  return `prompt ${fmt(answer.prompt_tokens)} · completion ${fmt(answer.completion_tokens)} tokens`;
}

// The answer being streamed into the list. `again` sends its request again,
// offered after a failure of unknown outcome. `resumed`: the turn ran before
// this page read it again (after a reload or a visit to another session), so
// its first pieces are not heard; the whole answer shows at its end.
export class PendingAnswer {
  constructor(again, resumed = false) {
    this.again = again;
    this.failure = null;
    this.writing = false;
    this.waiting = resumed ? { resumed: true }
      : { queued: !QUIET_PHASES.includes(app.phase), started: false };
    this.text = el("div", { className: "msg-text", attrs: OWN_DIRECTION, text: resumed ? "… " : "" });
    this.status = el("div", { className: "msg-status", text: pendingText(this.waiting) });
    this.item = el("li", { className: "msg msg-assistant msg-pending", attrs: { "aria-busy": "true" } }, [
      el("div", { className: "msg-head" }, [el("span", { className: "msg-role", text: "Assistant" })]),
      this.text,
      this.status,
    ]);
    // Pieces are added once a frame, not one by one: each added piece, with the
    // look at the scroll position after it, made the browser lay the list out
    // again, and a long answer froze the tab for a time growing as its square.
    this.unshown = "";
    this.frame = 0;
  }

  stateChanged(action, toState) {
    if (this.writing) return;
    this.waiting = pendingAfter(this.waiting, action, toState);
    this.status.textContent = pendingText(this.waiting);
  }

  stopping() {
    this.status.textContent = "stopping…";
  }

  notStopping() {
    this.status.textContent = this.writing ? "writing…" : pendingText(this.waiting);
  }

  notYetStoppable() {
    if (!this.writing) this.status.textContent = "not being written yet, so not stopped: Stop works once it is";
  }

  append(piece) {
    if (!this.writing) this.status.textContent = "writing…";
    this.writing = true;
    this.unshown += piece;
    if (!this.frame) this.frame = requestAnimationFrame(() => this.showUnshown());
  }

  // The generator died mid-answer and another one starts it over.
  restart() {
    this.forgetUnshown();
    this.text.textContent = "";
    this.status.textContent = "generating again…";
  }

  done(body) {
    if (typeof body.reply === "string") {
      this.forgetUnshown();
      this.text.textContent = body.reply;
    } else {
      this.showUnshown();
    }
    if (typeof body.thinking === "string" && body.thinking) {
      if (typeof body.query_id === "string") thoughts.set(body.query_id, body.thinking);
      this.text.before(thinkingBlock(body.thinking));
    }
    const counts = tokenCounts(body);
    this.status.textContent = body.stopped ? `stopped · ${counts}` : counts;
    this.ended();
  }

  fail(error) {
    this.showUnshown();
    this.failure = error ?? { code: "error" };
    this.ended();
    if (this.failure.code === "withdrawn") {
      this.status.textContent = WITHDRAWN_NOTE;
      return;
    }
    this.item.classList.add("msg-failed");
    this.status.remove();
    this.item.append(this.errorBox(error));
    scrollToEnd(true);
  }

  ended() {
    this.item.classList.remove("msg-pending");
    this.item.removeAttribute("aria-busy");
  }

  errorBox(error) {
    const box = el("div", { className: "msg-error", attrs: { role: "alert" } }, [
      el("strong", { text: "Error " }),
      el("code", { text: error?.code ?? "error" }),
      ": ",
      error?.message ?? "the answer failed",
    ]);
    if (offersSendAgain(error)) box.append(this.sendAgainButton());
    return box;
  }

  sendAgainButton() {
    const button = el("button", {
      className: "send-again-button",
      text: "Send again",
      attrs: { type: "button", title: "Sent under the same key: answered once, never twice" },
    });
    button.disabled = app.busy;
    button.addEventListener("click", () => {
      this.item.remove();
      this.again();
    });
    return button;
  }

  forgetUnshown() {
    cancelAnimationFrame(this.frame);
    this.frame = 0;
    this.unshown = "";
  }

  showUnshown() {
    const pieces = this.unshown;
    this.forgetUnshown();
    if (!pieces) return;
    const stick = nearBottom();
    this.text.append(document.createTextNode(pieces));
    if (stick) scrollToEnd(true);
  }
}
