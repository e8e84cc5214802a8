// The turn this tab sent and has not heard the end of, kept per session in the
// tab's session storage: a reload, or a visit to another session, stops the
// page reading its answer, not the answer. Back on the session, the chat view
// sends it again under its key, which is answered once (the same answer, never
// a second turn), and shows it as before: the question, the answer being
// written, Stop. A turn kept longer than RESUME_WITHIN_MS is let go.
const TURN_STORE = "chat.turnUnderWay.";
const RESUME_WITHIN_MS = 60 * 60 * 1000;

export function saveKeptTurn(sessionId, turn) {
  try {
    sessionStorage.removeItem(TURN_STORE + sessionId); // not an older one, should this fail
    sessionStorage.setItem(TURN_STORE + sessionId, JSON.stringify(turn));
  } catch {
    // storage disabled: a reload loses sight of the turn, as it did
  }
}

export function forgetKeptTurn(sessionId) {
  try {
    sessionStorage.removeItem(TURN_STORE + sessionId);
  } catch {
    // storage disabled: nothing was kept
  }
}

export function readKeptTurn(sessionId) {
  let turn;
  try {
    turn = JSON.parse(sessionStorage.getItem(TURN_STORE + sessionId) ?? "null");
  } catch {
    return null;
  }
  const usable = turn && typeof turn.key === "string" && typeof turn.at === "number" &&
    typeof turn.retry === "boolean" && typeof turn.content === "string";
  if (usable && Date.now() - turn.at < RESUME_WITHIN_MS) return turn;
  forgetKeptTurn(sessionId);
  return null;
}

// A reload or a move to another address cuts the answer's read like a network
// failure would; that turn is not over. Marked as the leaving begins: on a
// loaded machine the cut read was seen before `pagehide`.
let unloading = false;
if (typeof window !== "undefined") { // not in the page's unit checks, run outside a browser
  for (const event of ["beforeunload", "pagehide"]) {
    window.addEventListener(event, () => {
      unloading = true;
    });
  }
  // Back from the browser's cache, or used again after a navigation was
  // cancelled: the page goes on.
  for (const event of ["pageshow", "pointerdown", "keydown"]) {
    window.addEventListener(event, () => {
      unloading = false;
    });
  }
}

// Whether the page is being left: a read cut now ends no turn.
export function leaving() {
  return unloading;
}
