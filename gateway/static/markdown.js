// A small Markdown renderer that builds DOM nodes.
//
// It knows paragraphs, line breaks, emphasis, strikethrough, inline code,
// fenced code blocks, lists, block quotes, headings, rules, links and bare
// URLs. Text only ever becomes a text node, and a link only gets an href
// when its URL parses as absolute http, https or mailto, so nothing a
// member or an agent writes can run script or add markup.

import { h } from "./dom.js";

const SAFE_PROTOCOLS = new Set(["http:", "https:", "mailto:"]);

/** The URL if it is an absolute http, https or mailto URL, else null. */
export function safeHref(raw) {
  let url;
  try {
    url = new URL(String(raw).trim());
  } catch {
    return null;
  }
  return SAFE_PROTOCOLS.has(url.protocol) ? url.href : null;
}

function link(href, children) {
  const a = h("a", { class: "md-link", target: "_blank", rel: "noopener noreferrer nofollow" }, children);
  a.href = href;
  return a;
}

const FENCE = /^ {0,3}(`{3,}|~{3,})\s*([\w+#.-]*)\s*$/;
const HEADING = /^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$/;
const RULE = /^ {0,3}([-*_])(?:\s*\1){2,}\s*$/;
const QUOTE = /^ {0,3}> ?(.*)$/;
const LIST_ITEM = /^( {0,3})([-*+]|\d{1,9}[.)])\s+(.*)$/;

function startsBlock(line) {
  return FENCE.test(line) || HEADING.test(line) || RULE.test(line) || QUOTE.test(line) || LIST_ITEM.test(line);
}

function renderBlocks(lines, ctx, depth) {
  const out = [];
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    let m;
    if (!line.trim()) {
      i += 1;
    } else if ((m = FENCE.exec(line))) {
      const fence = m[1];
      const body = [];
      i += 1;
      const closing = new RegExp(`^ {0,3}[${fence[0]}]{${fence.length},}\\s*$`);
      while (i < lines.length && !closing.test(lines[i])) {
        body.push(lines[i]);
        i += 1;
      }
      i += 1; // the closing fence (or the end)
      const code = h("code", {}, body.join("\n"));
      if (m[2]) code.dataset.lang = m[2];
      out.push(h("pre", { class: "md-pre" }, code));
    } else if ((m = HEADING.exec(line))) {
      const level = m[1].length;
      out.push(h(`h${Math.min(level + 2, 6)}`, { class: `md-h md-h${level}` }, renderInline(m[2], ctx)));
      i += 1;
    } else if (RULE.test(line)) {
      out.push(h("hr", { class: "md-hr" }));
      i += 1;
    } else if (QUOTE.test(line)) {
      const body = [];
      while (i < lines.length && (m = QUOTE.exec(lines[i]))) {
        body.push(m[1]);
        i += 1;
      }
      out.push(h("blockquote", { class: "md-quote" }, nested(body, ctx, depth)));
    } else if ((m = LIST_ITEM.exec(line))) {
      const ordered = /\d/.test(m[2]);
      const list = h(ordered ? "ol" : "ul", { class: "md-list" });
      if (ordered && parseInt(m[2], 10) !== 1) list.setAttribute("start", String(parseInt(m[2], 10)));
      while (i < lines.length && (m = LIST_ITEM.exec(lines[i])) && /\d/.test(m[2]) === ordered) {
        const body = [m[3]];
        i += 1;
        // Indented lines (and blank lines followed by indented ones) belong to the item.
        while (i < lines.length) {
          if (/^\s{2,}\S/.test(lines[i])) {
            body.push(lines[i].replace(/^\s{2,4}/, ""));
            i += 1;
          } else if (!lines[i].trim() && i + 1 < lines.length && /^\s{2,}\S/.test(lines[i + 1])) {
            body.push("");
            i += 1;
          } else {
            break;
          }
        }
        list.append(h("li", {}, nested(body, ctx, depth)));
      }
      out.push(list);
    } else {
      const body = [];
      while (i < lines.length && lines[i].trim() && (body.length === 0 || !startsBlock(lines[i]))) {
        body.push(lines[i].trim());
        i += 1;
      }
      out.push(h("p", { class: "md-p" }, renderInline(body.join("\n"), ctx)));
    }
  }
  return out;
}

function nested(lines, ctx, depth) {
  // Deeply nested quotes or lists are shown as text rather than recursing without end.
  if (depth >= 8) return [h("p", { class: "md-p" }, lines.join("\n"))];
  return renderBlocks(lines, ctx, depth + 1);
}

function escapeRegExp(text) {
  return text.replace(/[.*+?^${}()|[\]\\]/g, "\\$&");
}

// Inline patterns, in priority order when two start at the same place.
const INLINE = [
  { kind: "code", re: /(`+)([^`]|[^`][\s\S]*?[^`])\1(?!`)/g },
  { kind: "link", re: /\[([^\]\n]{1,1000})\]\(\s*<?([^()\s<>]*(?:\([^()\s]*\)[^()\s<>]*)*)>?(?:\s+"[^"\n]*")?\s*\)/g },
  { kind: "autolink", re: /<((?:https?|mailto):[^>\s]+)>/g },
  { kind: "url", re: /\bhttps?:\/\/[^\s<>"]*[^\s<>"'.,;:!?)\]]/g },
  { kind: "strongEm", re: /\*\*\*(?=[^\s*])([\s\S]*?[^\s*])\*\*\*/g },
  { kind: "strong", re: /\*\*(?=[^\s*])([\s\S]*?\S)\*\*|__(?=[^\s_])([\s\S]*?\S)__(?!\w)/g },
  { kind: "strike", re: /~~(?=\S)([\s\S]*?\S)~~/g },
  { kind: "em", re: /\*(?=[^\s*])([^*]*?[^\s*])\*|(?<!\w)_(?=[^\s_])([^_]*?[^\s_])_(?!\w)/g },
  { kind: "break", re: /\n/g },
];

const LINKS = new Set(["link", "autolink", "url"]);

/** Renders inline Markdown (no blocks) into an array of nodes. */
export function renderInline(text, ctx = {}) {
  const usable = ctx.inLink ? INLINE.filter((p) => !LINKS.has(p.kind)) : INLINE;
  const patterns = usable.map((p) => ({ kind: p.kind, re: new RegExp(p.re.source, p.re.flags), next: undefined }));
  if (ctx.mentionPattern) patterns.push({ kind: "mention", re: new RegExp(ctx.mentionPattern.source, "g"), next: undefined });
  const nodes = [];
  let pos = 0;
  while (pos < text.length) {
    let best = null;
    for (const p of patterns) {
      if (p.next === undefined || (p.next !== null && p.next.index < pos)) {
        p.re.lastIndex = pos;
        p.next = p.re.exec(text);
      }
      if (p.next && (!best || p.next.index < best.match.index)) best = { kind: p.kind, match: p.next };
    }
    if (!best) break;
    const { kind, match } = best;
    if (match.index > pos) nodes.push(document.createTextNode(text.slice(pos, match.index)));
    nodes.push(inlineNode(kind, match, ctx));
    pos = match.index + Math.max(match[0].length, 1);
  }
  if (pos < text.length) nodes.push(document.createTextNode(text.slice(pos)));
  return nodes;
}

function inlineNode(kind, match, ctx) {
  switch (kind) {
    case "code":
      return h("code", { class: "md-code" }, match[2]);
    case "link": {
      const href = safeHref(match[2]);
      // A link to anything but http, https or mailto stays visible as inert text.
      return href ? link(href, renderInline(match[1], { ...ctx, inLink: true })) : document.createTextNode(match[0]);
    }
    case "autolink":
    case "url": {
      const raw = kind === "url" ? match[0] : match[1];
      const href = safeHref(raw);
      return href ? link(href, raw) : document.createTextNode(match[0]);
    }
    case "strongEm":
      return h("strong", {}, h("em", {}, renderInline(match[1], ctx)));
    case "strong":
      return h("strong", {}, renderInline(match[1] ?? match[2], ctx));
    case "em":
      return h("em", {}, renderInline(match[1] ?? match[2], ctx));
    case "strike":
      return h("del", {}, renderInline(match[1], ctx));
    case "mention":
      return h("span", { class: "mention" }, match[0]);
    case "break":
      return h("br");
    default:
      return document.createTextNode(match[0]);
  }
}

/**
 * Renders Markdown into a container element.
 *
 * Options: mentions, display names to highlight when written as @name.
 */
export function renderMarkdown(text, { mentions = [], className = "md" } = {}) {
  const names = mentions.filter(Boolean).sort((a, b) => b.length - a.length);
  const ctx = names.length ? { mentionPattern: new RegExp(`(?<![\\w@])@(?:${names.map(escapeRegExp).join("|")})(?![\\w])`) } : {};
  const lines = String(text ?? "").replace(/\r\n?/g, "\n").split("\n");
  return h("div", { class: className }, renderBlocks(lines, ctx, 0));
}
