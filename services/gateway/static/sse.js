// Server-sent events, read from a fetch's body: an answer's stream (the live
// feed is read by the browser's EventSource itself).

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
