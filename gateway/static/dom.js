// Small DOM helpers. Everything a member or an agent wrote reaches the page
// through textContent or createTextNode, never through innerHTML.

/**
 * Creates an element. `attrs` keys: class, text, testid, dataset, on<event>
 * handlers, and plain attributes (never href: use safeHref in markdown.js).
 */
export function h(tag, attrs, ...children) {
  const el = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (key === "class") el.className = value;
    else if (key === "text") el.textContent = value;
    else if (key === "testid") el.dataset.testid = value;
    else if (key === "dataset") Object.assign(el.dataset, value);
    else if (key.startsWith("on") && typeof value === "function") el.addEventListener(key.slice(2), value);
    else if (key === "value") el.value = value;
    else if (key === "checked" || key === "disabled" || key === "selected" || key === "hidden") el[key] = Boolean(value);
    else el.setAttribute(key, value === true ? "" : String(value));
  }
  append(el, children);
  return el;
}

/** Appends children (nodes, strings, arrays, null) to a parent. */
export function append(parent, children) {
  for (const child of children.flat(Infinity)) {
    if (child === null || child === undefined || child === false) continue;
    parent.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return parent;
}

/** Removes every child of an element. */
export function clear(el) {
  while (el.firstChild) el.removeChild(el.firstChild);
  return el;
}

/** Replaces the children of an element. */
export function setChildren(el, ...children) {
  clear(el);
  return append(el, children);
}

const AVATAR_COLORS = ["#5b8def", "#e5734a", "#3aa57a", "#9a6bd6", "#d4a13a", "#d65a8a", "#3d9db3", "#7c8a99"];

function hash(text) {
  let n = 0;
  for (const ch of text) n = (n * 31 + ch.codePointAt(0)) >>> 0;
  return n;
}

/** An avatar: the member's emoji avatar if it has a short one, else its initial on a colour. */
export function avatar(name, { avatarText = "", kind = "", size = "", seed = "" } = {}) {
  const short = avatarText && !/[:/.]/.test(avatarText) && [...avatarText].length <= 2;
  const letter = short ? avatarText : [...(name || "?").trim()][0]?.toUpperCase() || "?";
  const el = h("span", { class: `avatar ${size}`.trim(), title: name || "", "aria-hidden": "true" }, letter);
  el.style.backgroundColor = AVATAR_COLORS[hash(seed || name || "?") % AVATAR_COLORS.length];
  if (kind === "MEMBER_KIND_AGENT") el.append(h("span", { class: "avatar-badge", title: "agent" }, "AI"));
  return el;
}

/** Parses a proto3 JSON timestamp ("" or null gives null). */
export function parseTime(value) {
  if (!value) return null;
  const date = new Date(value);
  return Number.isNaN(date.getTime()) ? null : date;
}

/** A chat-list style time: 14:05 today, "Yesterday", weekday this week, else the date. */
export function shortTime(value) {
  const date = parseTime(value);
  if (!date) return "";
  const now = new Date();
  const startOfToday = new Date(now.getFullYear(), now.getMonth(), now.getDate());
  const dayMs = 86400000;
  if (date >= startOfToday) return date.toLocaleTimeString([], { hour: "2-digit", minute: "2-digit" });
  if (date >= new Date(startOfToday - dayMs)) return "Yesterday";
  if (date >= new Date(startOfToday - 6 * dayMs)) return date.toLocaleDateString([], { weekday: "short" });
  return date.toLocaleDateString();
}

/** Date and time, for tooltips and separators. */
export function longTime(value) {
  const date = parseTime(value);
  return date ? date.toLocaleString([], { dateStyle: "medium", timeStyle: "short" }) : "";
}

/** A milliseconds figure for people: 850 ms, 1.2 s, 3 min. */
export function duration(ms) {
  const n = Number(ms) || 0;
  if (n < 1000) return `${Math.round(n)} ms`;
  if (n < 60000) return `${(n / 1000).toFixed(1)} s`;
  return `${Math.round(n / 60000)} min`;
}

/** Cuts a text to one line of at most `max` characters. */
export function snippet(text, max = 80) {
  const line = String(text || "").replace(/\s+/g, " ").trim();
  return line.length > max ? `${line.slice(0, max - 1)}…` : line;
}

const SVG_NS = "http://www.w3.org/2000/svg";
const ICONS = {
  chat: "M4 3h16a2 2 0 0 1 2 2v10a2 2 0 0 1-2 2H10l-5 4v-4H4a2 2 0 0 1-2-2V5a2 2 0 0 1 2-2z",
  contacts:
    "M9 11a4 4 0 1 0 0-8 4 4 0 0 0 0 8zm7.5 0a3 3 0 1 0 0-6 3 3 0 0 0 0 6zM9 13c-3.3 0-7 1.6-7 4.5V20h14v-2.5C16 14.6 12.3 13 9 13zm7.5 0c-.6 0-1.2.1-1.8.2 1.4 1 2.3 2.4 2.3 4.3V20h5v-2.5c0-2.9-3-4.5-5.5-4.5z",
  agent:
    "M11 2h2v3h4a3 3 0 0 1 3 3v9a3 3 0 0 1-3 3H7a3 3 0 0 1-3-3V8a3 3 0 0 1 3-3h4V2zM9 10a1.5 1.5 0 1 0 0 3 1.5 1.5 0 0 0 0-3zm6 0a1.5 1.5 0 1 0 0 3 1.5 1.5 0 0 0 0-3zm-6 5v1.5h6V15H9zM1 10h2v5H1zm20 0h2v5h-2z",
  key: "M7 17a5 5 0 1 1 4.6-7H23v4h-3v3h-4v-3h-4.4A5 5 0 0 1 7 17zm0-3a2 2 0 1 0 0-4 2 2 0 0 0 0 4z",
  exit: "M10 3h9a2 2 0 0 1 2 2v14a2 2 0 0 1-2 2h-9v-2h9V5h-9V3zM8.6 7.6 10 9l-2 2h8v2H8l2 2-1.4 1.4L4.2 12l4.4-4.4z",
  group:
    "M7 8a3 3 0 1 0 0-6 3 3 0 0 0 0 6zm10 0a3 3 0 1 0 0-6 3 3 0 0 0 0 6zM7 10c-2.8 0-6 1.3-6 3.8V16h12v-2.2C13 11.3 9.8 10 7 10zm10 0c-.9 0-1.9.1-2.8.4 1.1.9 1.8 2 1.8 3.4V16h7v-2.2c0-2.5-3.2-3.8-6-3.8zM2 18h20v2H2z",
  person: "M12 12a5 5 0 1 0 0-10 5 5 0 0 0 0 10zm0 2c-3.9 0-9 2-9 5.5V22h18v-2.5c0-3.5-5.1-5.5-9-5.5z",
  search: "M10 2a8 8 0 0 1 6.3 12.9l5.4 5.4-1.4 1.4-5.4-5.4A8 8 0 1 1 10 2zm0 2a6 6 0 1 0 0 12 6 6 0 0 0 0-12z",
  tool: "M22.7 19 13.6 9.9a6 6 0 0 0-7.7-7.7l3.9 3.9-2.8 2.8-4-3.9a6 6 0 0 0 7.7 7.7l9.1 9.1a1 1 0 0 0 1.4 0l1.5-1.5a1 1 0 0 0 0-1.3z",
};

/** A small built-in icon (SVG drawn from fixed path data, never from content). */
export function icon(name, size = 20) {
  const svg = document.createElementNS(SVG_NS, "svg");
  svg.setAttribute("viewBox", "0 0 24 24");
  svg.setAttribute("width", String(size));
  svg.setAttribute("height", String(size));
  svg.setAttribute("aria-hidden", "true");
  svg.setAttribute("class", "icon");
  const shape = document.createElementNS(SVG_NS, "path");
  shape.setAttribute("d", ICONS[name] || ICONS.chat);
  shape.setAttribute("fill", "currentColor");
  svg.append(shape);
  return svg;
}
