// Long-term memory: the Memory tab of the agent panel (search an agent's
// memory, expand a hit, go to its step) and the workspace search for people.
// What the memory service shows follows its rule: only segments from chats
// the person searching was in (and the agent's own tasks, in its tab).

import { h, longTime, setChildren, shortTime } from "./dom.js";

export const SEGMENT_TYPES = [
  ["SEGMENT_TYPE_USER_MESSAGE", "Messages"],
  ["SEGMENT_TYPE_RESPONSE", "Answers"],
  ["SEGMENT_TYPE_REASONING", "Thinking"],
  ["SEGMENT_TYPE_TOOL_CALL", "Tool calls"],
  ["SEGMENT_TYPE_TOOL_RESULT", "Tool results"],
  ["SEGMENT_TYPE_SUMMARY", "Summaries"],
];
const TYPE_LABELS = Object.fromEntries(SEGMENT_TYPES.map(([type, label]) => [type, label.replace(/s$/, "")]));
const CJK = /[\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff]/;

/** The pieces of the query to mark in a text: words, and Chinese as pairs of characters. */
export function queryMarks(query) {
  const marks = new Set();
  for (const run of query.toLowerCase().match(/[\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff]+|[\p{L}\p{N}_]{2,}/gu) || []) {
    if (CJK.test(run)) {
      if (run.length === 1) marks.add(run);
      for (let i = 0; i + 1 < run.length; i += 1) marks.add(run.slice(i, i + 2));
    } else marks.add(run);
  }
  return [...marks].sort((a, b) => b.length - a.length);
}

// How the runtime hands an agent an IM message: "[chat | group_id=…] name (member_id=…): text".
const ENVELOPE = /^\[[^\]\n]*\| group_id=[0-9a-f-]+\] ([^\n]*?) \(member_id=[0-9a-f-]+\): /;

/** A segment's text for people: an IM message as "name: text". */
export function readable(text) {
  return (text || "").replace(ENVELOPE, "$1: ");
}

/** `text` as nodes, the query's words in <mark>. */
export function highlighted(text, marks) {
  if (!marks.length) return [text];
  const escaped = marks.map((m) => m.replace(/[.*+?^${}()|[\]\\]/g, "\\$&"));
  const pattern = new RegExp(`(${escaped.join("|")})`, "giu");
  return text.split(pattern).map((part, index) => (index % 2 ? h("mark", {}, part) : part));
}

function segmentRow(segment, { marks = [], score = null, duplicates = 0, agentName = "", chatName = "", actions = [] } = {}) {
  const text = readable(segment.text);
  const clipped = text.length > 600 ? `${text.slice(0, 600)}…` : text;
  return h(
    "div",
    { class: "memory-hit", testid: "memory-hit", dataset: { ref: segment.ref, type: segment.type } },
    h(
      "div",
      { class: "memory-hit-head" },
      h("span", { class: `memory-type memory-type-${(segment.type || "").replace("SEGMENT_TYPE_", "").toLowerCase()}` }, TYPE_LABELS[segment.type] || "Segment"),
      agentName ? h("span", { class: "memory-agent" }, agentName) : null,
      chatName ? h("span", { class: "muted small" }, chatName) : null,
      h("span", { class: "muted small", title: longTime(segment.createTime) }, shortTime(segment.createTime)),
      duplicates ? h("span", { class: "muted small", title: "near-identical segments collapsed into this one" }, `+${duplicates} alike`) : null,
      score !== null ? h("span", { class: "memory-score muted small", title: "relevance" }, Number(score).toFixed(2)) : null,
    ),
    h("div", { class: "memory-text", testid: "memory-text" }, ...highlighted(clipped, marks)),
    actions.length ? h("div", { class: "memory-actions" }, ...actions) : null,
  );
}

function chatLabel(ctx, groupId) {
  if (!groupId) return "from a task";
  const group = ctx.state.chats.get(groupId)?.group;
  if (!group) return "in a chat";
  return group.kind === "GROUP_KIND_DIRECT" || !group.name ? "in a direct chat" : `in ${group.name}`;
}

/**
 * A search form and its results.
 *
 * Options: path (the search route), scope (the body's scope fields),
 * agentName(segment), onExpand(segment) -> Promise of the expanded view,
 * onGoTo(segment) (the "Go to step" action), placeholder.
 */
function searchView(ctx, { path, scope = {}, agentName = () => "", expandPath, onGoTo, placeholder, testid }) {
  const query = h("input", { type: "search", maxlength: 2000, placeholder, testid: "memory-query", "aria-label": "Search memory" });
  const since = h("input", { type: "date", testid: "memory-since", "aria-label": "From" });
  const until = h("input", { type: "date", testid: "memory-until", "aria-label": "Until" });
  const chosen = new Set();
  const chips = SEGMENT_TYPES.map(([type, label]) => {
    const chip = h("button", { type: "button", class: "chip", testid: "memory-type", dataset: { type }, "aria-pressed": "false" }, label);
    chip.addEventListener("click", () => {
      if (chosen.has(type)) chosen.delete(type);
      else chosen.add(type);
      chip.setAttribute("aria-pressed", String(chosen.has(type)));
      chip.classList.toggle("active", chosen.has(type));
      if (query.value.trim()) run();
    });
    return chip;
  });
  const status = h("p", { class: "muted small", testid: "memory-status", role: "status" }, "Search in any language: a word, an error code, a question.");
  const results = h("div", { class: "memory-results", testid: "memory-results" });
  let asked = 0;

  const expandInto = async (row, segment) => {
    const open = row.querySelector(".memory-context");
    if (open) {
      open.remove();
      return;
    }
    const box = h("div", { class: "memory-context", testid: "memory-context" }, h("p", { class: "muted small" }, "Loading its context…"));
    row.append(box);
    try {
      const expanded = await ctx.api("POST", expandPath, { body: { ...scope, ref: segment.ref, before: 2, after: 2 } });
      const marks = queryMarks(query.value);
      const line = (s, focus) =>
        h("div", { class: `memory-context-line${focus ? " is-focus" : ""}`, dataset: { ref: s.ref } }, h("span", { class: "memory-type small" }, TYPE_LABELS[s.type] || ""), " ", ...highlighted(readable(s.text).slice(0, 1200), marks));
      setChildren(
        box,
        ...(expanded.before || []).map((s) => line(s, false)),
        line(expanded.focus, true),
        ...(expanded.after || []).map((s) => line(s, false)),
        onGoTo
          ? h("button", { class: "btn btn-small", type: "button", testid: "memory-goto", onclick: () => onGoTo(expanded.focus) }, `Go to step #${expanded.focus.anchor.stepSequence}`)
          : null,
      );
    } catch (err) {
      setChildren(box, h("p", { class: "form-error" }, `Could not expand it: ${err.message}`));
    }
  };

  const run = async (event) => {
    event?.preventDefault();
    const text = query.value.trim();
    if (!text) {
      status.textContent = "Type something to look for.";
      return;
    }
    const mine = ++asked;
    const filters = {};
    if (chosen.size) filters.types = [...chosen];
    if (since.value) filters.since = new Date(`${since.value}T00:00:00`).toISOString();
    if (until.value) filters.until = new Date(`${until.value}T23:59:59.999`).toISOString();
    status.textContent = "Searching…";
    try {
      const response = await ctx.api("POST", path, { body: { ...scope, query: text, limit: 20, filters } });
      if (mine !== asked) return;
      const hits = response.results || [];
      const marks = queryMarks(text);
      const pending = Number(response.pendingEmbeddings || 0);
      status.textContent = hits.length
        ? `${hits.length} found${pending ? ` (${pending} recent segments are found by their words only, until they are embedded)` : ""}.`
        : "Nothing found.";
      setChildren(
        results,
        ...hits.map((hit) => {
          const segment = hit.segment;
          const row = segmentRow(segment, {
            marks,
            score: hit.score,
            duplicates: hit.duplicates || 0,
            agentName: agentName(segment),
            chatName: chatLabel(ctx, segment.groupId),
          });
          row.append(
            h("div", { class: "memory-actions" }, h("button", { class: "btn btn-small", type: "button", testid: "memory-expand", onclick: () => expandInto(row, segment) }, "Expand")),
          );
          return row;
        }),
      );
    } catch (err) {
      if (mine !== asked) return;
      status.textContent = "";
      setChildren(results, h("p", { class: "form-error", role: "alert", testid: "memory-error" }, `Search failed: ${err.message}`));
    }
  };

  const element = h(
    "div",
    { class: "memory-search", testid },
    h("form", { class: "memory-form", onsubmit: run }, query, h("button", { class: "btn btn-primary", type: "submit", testid: "memory-search" }, "Search")),
    h("div", { class: "memory-filters" }, ...chips),
    h("div", { class: "memory-dates" }, h("label", {}, "From ", since), h("label", {}, "until ", until)),
    status,
    results,
  );
  return { element, run, query };
}

/** The Memory tab of an agent's panel. */
export function memoryView(host) {
  const ctx = host.ctx;
  const stats = h("p", { class: "muted small", testid: "memory-stats" }, "…");
  const view = searchView(ctx, {
    path: `/v1/agents/${host.agentId}/memory:search`,
    expandPath: `/v1/agents/${host.agentId}/memory:expand`,
    placeholder: `Search what ${host.agent.name} remembers`,
    testid: "agent-memory",
    onGoTo: (segment) => host.goToStep(Number(segment.anchor.stepSequence), segment.anchor.sessionId),
  });
  const refresh = async () => {
    try {
      const s = await ctx.api("GET", `/v1/agents/${host.agentId}/memory`);
      if (!stats.isConnected && !host.alive()) return;
      const pending = Number(s.pendingEmbeddings || 0);
      stats.textContent = `${Number(s.runCount || 0)} runs, ${Number(s.segmentCount || 0)} segments remembered${pending ? `; ${pending} waiting to be embedded` : ""}.`;
    } catch (err) {
      stats.textContent = err.status === "UNAVAILABLE" ? "Long-term memory is not available right now." : `Could not load the memory: ${err.message}`;
    }
  };
  refresh();
  const element = h("div", { class: "tab-view memory", testid: "agent-memory-tab" }, stats, view.element);
  return { element, refresh };
}

/** The workspace search: what the signed-in person may find across every agent. */
export function workspaceMemoryView(ctx, { openStep }) {
  const nameOf = (segment) => ctx.state.agents.get(segment.anchor.agentId)?.name || "an agent";
  const view = searchView(ctx, {
    path: "/v1/memory:search",
    expandPath: "/v1/memory:expand",
    scope: { workspace: {} },
    agentName: nameOf,
    placeholder: "Search the workspace's memory",
    testid: "workspace-memory",
    onGoTo: (segment) => openStep(segment.anchor.agentId, Number(segment.anchor.stepSequence), segment.anchor.sessionId),
  });
  return h(
    "div",
    { class: "workspace-memory" },
    h("div", { class: "list-title" }, "Memory"),
    h("p", { class: "muted small memory-intro" }, "What agents remember of the chats you are in."),
    view.element,
  );
}
