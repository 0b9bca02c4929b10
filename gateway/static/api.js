// The gateway's HTTP API and its Server-Sent Event streams.
//
// Requests and responses are the proto3 JSON mapping of the gRPC messages
// (lowerCamelCase fields, enum names, int64 as strings). The person is
// signed in by the session cookie (HttpOnly: no script here sees a token);
// every state-changing request carries the session's CSRF token. The member
// whose view is shown (the person, or one of their agents) goes in
// X-View-As; EventSource cannot send headers, so streams take it as a
// query parameter (it is no credential: the cookie is).

/**
 * An error the API answered with: its HTTP status, gRPC status name and
 * readable message; `signInRequired` when the session is missing or over.
 */
export class ApiError extends Error {
  constructor(httpStatus, status, message) {
    super(message);
    this.name = "ApiError";
    this.httpStatus = httpStatus;
    this.status = status;
    this.signInRequired = httpStatus === 401;
  }
}

let actingMember = "";
let csrfToken = "";
let unauthorizedHandler = null;

export function setActingMember(memberId) {
  actingMember = memberId || "";
}

export function getActingMember() {
  return actingMember;
}

/** The session's CSRF token (GET /v1/auth/session tells it). */
export function setCsrfToken(token) {
  csrfToken = token || "";
}

/** Sets what happens when a call finds no session (401): `handler(error)`. */
export function onUnauthorized(handler) {
  unauthorizedHandler = handler;
}

function buildUrl(path, query) {
  const url = new URL(path, window.location.origin);
  for (const [key, value] of Object.entries(query || {})) {
    if (value === undefined || value === null || value === "") continue;
    url.searchParams.set(key, String(value));
  }
  return url;
}

async function readError(response) {
  let status = response.statusText || "ERROR";
  let message = `${response.status} ${response.statusText}`.trim();
  try {
    const body = await response.json();
    if (body && body.error) {
      status = body.error.status || status;
      message = body.error.message || message;
    }
  } catch {
    // Not JSON (a proxy's error page): keep the HTTP status line.
  }
  return new ApiError(response.status, status, message);
}

/**
 * Calls the API. Options: body (sent as JSON), query, member (overrides the
 * acting member; "" sends none).
 */
export async function api(method, path, { body, query, member } = {}) {
  const headers = { Accept: "application/json" };
  const who = member === undefined ? actingMember : member;
  if (who) headers["X-View-As"] = who;
  if (method !== "GET" && csrfToken) headers["X-CSRF-Token"] = csrfToken;
  if (body !== undefined) headers["Content-Type"] = "application/json";
  let response;
  try {
    response = await fetch(buildUrl(path, query), {
      method,
      headers,
      body: body === undefined ? undefined : JSON.stringify(body),
      cache: "no-store",
      credentials: "same-origin",
    });
  } catch (error) {
    throw new ApiError(0, "UNAVAILABLE", `The server cannot be reached (${error.message}).`);
  }
  if (response.ok) {
    const text = await response.text();
    return text ? JSON.parse(text) : {};
  }
  const error = await readError(response);
  if (error.signInRequired && unauthorizedHandler) unauthorizedHandler(error);
  throw error;
}

/** Fetches every page of a list call; `key` names the repeated field. */
export async function listAll(path, key, { query = {}, pageSize = 200, maxPages = 50 } = {}) {
  const items = [];
  let pageToken = "";
  for (let page = 0; page < maxPages; page += 1) {
    const response = await api("GET", path, { query: { ...query, page_size: pageSize, page_token: pageToken } });
    items.push(...(response[key] || []));
    pageToken = response.nextPageToken || "";
    if (!pageToken) break;
  }
  return items;
}

function snakeToCamel(name) {
  return name.replace(/_([a-z])/g, (_, c) => c.toUpperCase());
}

/**
 * A Server-Sent Event stream that survives disconnects.
 *
 * EventSource reconnects by itself (sending Last-Event-ID); when it gives up
 * (the server answered with an error) this reopens it with a backoff,
 * resuming through `resumeParam` after the last event id (or what
 * `resume()` returns). `onStatus` hears "open", "reconnecting" and
 * "closed"; `onEvent(kind, data, id)` hears each event whose name is one of
 * `kinds` (snake_case or camelCase); `onServerError(error)` hears the
 * gateway's `error` events; `onRefused()` runs when the server refused to
 * open the stream.
 */
export class LiveStream {
  constructor(path, { query = {}, kinds = [], resumeParam = "", resume = null, onEvent, onStatus = () => {}, onServerError = () => {}, onRefused = () => {} }) {
    this.resume = resume;
    this.onServerError = onServerError;
    this.onRefused = onRefused;
    this.path = path;
    this.query = query;
    this.kinds = kinds;
    this.resumeParam = resumeParam;
    this.onEvent = onEvent;
    this.onStatus = onStatus;
    this.lastId = "";
    this.source = null;
    this.retryTimer = null;
    this.backoff = 1000;
    this.closed = false;
    this.wasOpen = false;
    this.open();
  }

  open() {
    if (this.closed) return;
    const query = { ...this.query, member_id: actingMember };
    const resumeFrom = this.resume ? this.resume() : this.lastId;
    if (resumeFrom && this.resumeParam) query[this.resumeParam] = resumeFrom;
    const source = new EventSource(buildUrl(this.path, query));
    this.source = source;
    const handle = (kind) => (event) => {
      if (event.lastEventId) this.lastId = event.lastEventId;
      let data = {};
      try {
        data = event.data ? JSON.parse(event.data) : {};
      } catch {
        return;
      }
      this.onEvent(kind, data, event.lastEventId);
    };
    for (const kind of this.kinds) {
      source.addEventListener(kind, handle(kind));
      const camel = snakeToCamel(kind);
      if (camel !== kind) source.addEventListener(camel, handle(kind));
    }
    source.addEventListener("message", handle("message"));
    source.onopen = () => {
      this.backoff = 1000;
      this.onStatus("open", this.wasOpen);
      this.wasOpen = true;
    };
    source.onerror = (event) => {
      if (this.closed || source !== this.source) return;
      if (event.data) {
        // The gateway's own `event: error` (the upstream stream failed); it then reconnects.
        try {
          const body = JSON.parse(event.data);
          this.onServerError(new ApiError(body.error?.code || 0, body.error?.status || "UNKNOWN", body.error?.message || "the stream failed"));
        } catch {
          this.onServerError(new ApiError(0, "UNKNOWN", "the stream failed"));
        }
        return;
      }
      this.onStatus("reconnecting");
      if (source.readyState === EventSource.CLOSED) {
        // The server refused the stream (EventSource does not retry that):
        // find out why with an ordinary call, then try again later.
        source.close();
        this.onRefused();
        this.retryTimer = setTimeout(() => this.open(), this.backoff);
        this.backoff = Math.min(this.backoff * 2, 15000);
      }
    };
  }

  close() {
    this.closed = true;
    clearTimeout(this.retryTimer);
    if (this.source) this.source.close();
    this.onStatus("closed");
  }
}
