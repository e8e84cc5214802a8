// The API client: the gateway's URLs and the only place the page makes requests
// (fetch, the live EventSource). Every write says Content-Type application/json,
// body or not: the gateway refuses any other, as a cross-site form could send one.

import { sha256Hex } from "./sha256.js";

export const API = {
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

function errorText(err) {
  if (!err || typeof err !== "object") return String(err ?? "unknown error");
  const code = err.code ? `${err.code}: ` : "";
  const field = err.field ? ` (field ${err.field})` : "";
  return `${code}${err.message ?? "unknown error"}${field}`;
}

class ApiError extends Error {
  constructor(status, error) {
    super(errorText(error));
    this.status = status;
    this.error = error;
  }
}

export async function readError(response) {
  let error = { code: `http_${response.status}`, message: response.statusText || "request failed" };
  try {
    const body = await response.json();
    if (body && typeof body.error === "object" && body.error) error = body.error;
  } catch {
    // not JSON: keep the status line
  }
  return new ApiError(response.status, error);
}

export async function requestJson(url, { method = "GET", body } = {}) {
  const init = { method, headers: { Accept: "application/json" } };
  if (method !== "GET") init.headers["Content-Type"] = "application/json";
  if (body !== undefined) init.body = JSON.stringify(body);
  let response;
  try {
    response = await fetch(url, init);
  } catch (err) {
    throw new ApiError(0, { code: "network_error", message: `gateway unreachable: ${err.message}` });
  }
  if (!response.ok) throw await readError(response);
  return response.status === 204 ? null : response.json();
}

// The session list as the server has it; a plain Response, the caller decides.
export function listSessions() {
  return fetch("/api/sessions?limit=50");
}

// Asks the generator to stop the answer being streamed: 202 when it was asked.
// Stops the answer to the turn sent under `key` only: a message of this page
// still queued behind another client's answer must not stop that one.
export function postStop(id, { key, retry }) {
  return fetch(API.stop(id), {
    method: "POST",
    headers: { "Content-Type": "application/json", "Idempotency-Key": key },
    body: JSON.stringify({ retry }),
  });
}

// A message (or a retry, `body` null) whose answer streams back as server-sent events.
// `key` names it: sent again under the same key, it is answered once.
export function postTurn(url, body, key, signal) {
  return fetch(url, {
    method: "POST",
    headers: { "Content-Type": "application/json", Accept: "text/event-stream", "Idempotency-Key": key },
    body: body === null ? undefined : JSON.stringify(body),
    signal,
  });
}

// A fresh Idempotency-Key. Not crypto.randomUUID: a page served over plain
// HTTP to another machine is no secure context, and has none.
export function newKey() {
  return hex(crypto.getRandomValues(new Uint8Array(16)));
}

function hex(bytes) {
  return Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join("");
}

// The id the gateway gives the query sent under `key`, as it derives it: the
// first 32 hex digits of SHA-256 over the session, the route and the key.
// Without crypto.subtle (no secure context), by the page's own SHA-256.
export async function queryIdFor(sessionId, key, retry) {
  const named = `${sessionId}\n${retry ? "retry" : "message"}\n${key}`;
  if (!crypto.subtle) return sha256Hex(named).slice(0, 32);
  const digest = await crypto.subtle.digest("SHA-256", new TextEncoder().encode(named));
  return hex(new Uint8Array(digest)).slice(0, 32);
}

// The session's live events (GET /api/events), reconnected by the browser.
export function openEvents(id) {
  return new EventSource(API.events(id));
}
