// Agent steps: one Step shape (the proto3 JSON of agentim.runtime.v1.Step)
// for history and for the step in flight. A live step is built up from
// step_started and step_delta events into the same shape, and the same
// renderStep draws both, so a step looks the same streaming and stored.

import { duration, h, icon, longTime, shortTime } from "./dom.js";
import { renderMarkdown } from "./markdown.js";

const ROLE_NAMES = {
  STEP_ROLE_SYSTEM: "system",
  STEP_ROLE_USER: "user",
  STEP_ROLE_ASSISTANT: "assistant",
  STEP_ROLE_TOOL: "tool",
};

const ROLE_LABELS = { system: "System", user: "Input", assistant: "Assistant", tool: "Tool result" };

const KIND_NAMES = { STEP_KIND_SUMMARY: "summary", STEP_KIND_RECALL: "recall", STEP_KIND_CUT: "cut" };

/** The label of a step's head: its kind when it has one of its own, else its role. */
function stepLabel(step, role) {
  const kind = KIND_NAMES[step.kind];
  if (kind === "summary") return `Summary of earlier runs (through #${step.summaryThrough || "?"})`;
  if (kind === "recall") return "Recalled memories";
  if (kind === "cut") return "Cut short (the stream broke off; asked again)";
  return role === "tool" && step.name ? `${ROLE_LABELS.tool} · ${step.name}` : ROLE_LABELS[role];
}

/** A Step-shaped object for a step that has just started streaming. */
export function startedStep(agentId, started) {
  return {
    id: "",
    agentId,
    sessionId: "",
    runId: started.runId || "",
    sequence: String(started.sequence),
    role: started.role || "STEP_ROLE_ASSISTANT",
    content: "",
    reasoning: "",
    toolCalls: [],
    toolCallId: "",
    name: "",
    metrics: null,
    createTime: "",
    interrupted: false,
  };
}

/** Adds a step_delta fragment (content, reasoning or a tool-call piece) to a live step. */
export function applyDelta(step, delta) {
  if (typeof delta.content === "string") step.content += delta.content;
  else if (typeof delta.reasoning === "string") step.reasoning += delta.reasoning;
  else if (delta.toolCall) {
    const fragment = delta.toolCall;
    const index = Number(fragment.index) || 0;
    while (step.toolCalls.length <= index) step.toolCalls.push({ id: "", name: "", arguments: "" });
    const call = step.toolCalls[index];
    if (fragment.id) call.id = fragment.id;
    if (fragment.name) call.name = fragment.name;
    if (fragment.arguments) call.arguments += fragment.arguments;
  }
  return step;
}

function prettyJson(text) {
  if (!text) return "";
  try {
    return JSON.stringify(JSON.parse(text), null, 2);
  } catch {
    return text; // still streaming, or not JSON
  }
}

function metricsLine(step) {
  const m = step.metrics;
  if (!m) return "";
  const parts = [];
  if (m.model) parts.push(m.model);
  if (Number(m.durationMs)) parts.push(duration(m.durationMs));
  if (Number(m.firstTokenMs)) parts.push(`first token ${duration(m.firstTokenMs)}`);
  if (Number(m.inputTokens) || Number(m.outputTokens)) {
    // "≈": the endpoint reported no usage; the runtime counted (high).
    const about = m.usageEstimated ? "≈" : "";
    parts.push(`${about}${m.inputTokens} in / ${about}${m.outputTokens} out tokens${m.usageEstimated ? " (estimated)" : ""}`);
  }
  if (Number(m.cachedTokens)) parts.push(`${m.cachedTokens} cached`);
  if (Number(m.toolDurationMs)) parts.push(`tool ${duration(m.toolDurationMs)}`);
  return parts.join(" · ");
}

/**
 * Where an input came from (a step's `origin`): who wrote it, and in which
 * group, as a header; the ids only when asked for (they are for people
 * debugging, not for reading).
 */
function renderOrigin(origin) {
  const ids = [
    ["group", origin.groupId],
    ["sender", origin.senderId],
    ["message", origin.messageId],
    ["task", origin.taskId],
  ].filter(([, id]) => id);
  const where = origin.direct ? "direct chat" : origin.groupName ? origin.groupName : "";
  return h(
    "div",
    { class: "step-origin", testid: "step-origin" },
    h("strong", { class: "step-origin-sender", testid: "step-origin-sender" }, origin.senderName || (origin.taskId ? "a task" : "someone")),
    where ? h("span", { class: "step-origin-where", testid: "step-origin-group" }, origin.direct ? " · direct chat" : ` in ${where}`) : null,
    origin.taskId && origin.senderName ? h("span", { class: "muted" }, " · task") : null,
    ids.length
      ? h(
          "details",
          { class: "step-origin-ids", testid: "step-origin-details" },
          h("summary", {}, "details"),
          h("dl", {}, ids.map(([what, id]) => [h("dt", {}, what), h("dd", {}, h("code", {}, id))])),
        )
      : null,
  );
}

/**
 * Draws one step, stored or streaming.
 *
 * Options: live (the step is still streaming), reasoningOpen (show the
 * thinking expanded; by default only while streaming), onToggleReasoning,
 * actions (elements drawn under the step: the panel's step controls).
 */
export function renderStep(step, { live = false, reasoningOpen, onToggleReasoning, actions = null } = {}) {
  const role = ROLE_NAMES[step.role] || "assistant";
  const head = h(
    "div",
    { class: "step-head" },
    h("span", { class: "step-role" }, stepLabel(step, role)),
    h("span", { class: "step-seq", title: step.id ? `step ${step.id}` : "" }, `#${step.sequence}`),
    live ? h("span", { class: "step-live", testid: "step-live" }, "streaming…") : null,
    step.interrupted ? h("span", { class: "step-interrupted", testid: "step-interrupted", title: "Cut short by Interrupt: what was streamed until then" }, "interrupted") : null,
    role === "tool" && step.toolCallId ? h("code", { class: "step-call-id" }, step.toolCallId) : null,
    h("span", { class: "step-meta", title: longTime(step.createTime) }, live ? "" : [metricsLine(step), step.createTime ? shortTime(step.createTime) : ""].filter(Boolean).join(" · ")),
  );
  const kind = KIND_NAMES[step.kind] || "message";
  const el = h("div", {
    class: `step step-${role}${kind !== "message" ? ` step-kind-${kind}` : ""}${live ? " is-live" : ""}${step.interrupted ? " is-interrupted" : ""}`,
    testid: "step",
    dataset: { role, kind, sequence: String(step.sequence), live: String(live), interrupted: String(Boolean(step.interrupted)) },
  }, head);

  if (step.reasoning) {
    const details = h(
      "details",
      { class: "step-reasoning", testid: "step-reasoning" },
      h("summary", {}, live && !step.content && !step.toolCalls.length ? "Thinking…" : "Thinking"),
      renderMarkdown(step.reasoning, { className: "md reasoning-text" }),
    );
    details.open = reasoningOpen ?? live;
    // Only the reader's own clicks are remembered (a re-render sets `open` too).
    if (onToggleReasoning) details.firstChild.addEventListener("click", () => onToggleReasoning(!details.open));
    el.append(details);
  }
  // An input with its origin shows who wrote it above the clean text; older ones, their text as it was.
  if (role === "user" && step.origin) el.append(renderOrigin(step.origin));
  if (role === "tool") {
    const failed = /^error:/i.test(step.content || "");
    el.append(h("pre", { class: `step-tool-result${failed ? " is-error" : ""}`, testid: "step-content" }, step.content || ""));
  } else if (step.content || (live && !step.reasoning && !step.toolCalls.length)) {
    el.append(h("div", { class: "step-content", testid: "step-content" }, renderMarkdown(step.content || "…")));
  }
  for (const call of step.toolCalls || []) {
    el.append(
      h(
        "div",
        { class: "tool-call", testid: "step-tool-call", dataset: { tool: call.name || "" } },
        h("div", { class: "tool-call-head" }, icon("tool", 13), h("strong", {}, call.name || "…"), call.id ? h("code", { class: "step-call-id" }, call.id) : null),
        h("pre", { class: "tool-call-args" }, prettyJson(call.arguments)),
      ),
    );
  }
  if (actions && actions.length) el.append(h("div", { class: "step-actions", testid: "step-actions" }, actions));
  return el;
}

const RUN_STATUS = {
  RUN_STATUS_RUNNING: "running",
  RUN_STATUS_COMPLETED: "completed",
  RUN_STATUS_FAILED: "failed",
  RUN_STATUS_ITERATION_LIMIT: "iteration limit",
  RUN_STATUS_BUDGET_EXHAUSTED: "budget exhausted",
  RUN_STATUS_INTERRUPTED: "interrupted",
};

/** The header of a run: status, iterations, start and length, error (or, with `note`, of a person's note). */
export function renderRunHeader(run, usage = null) {
  if (run.note) {
    return h(
      "div",
      { class: "run-head run-note", testid: "run", dataset: { runId: run.id || "", status: "NOTE" } },
      h("span", { class: "run-status" }, "note"),
      h("span", { class: "run-meta" }, "added by a person"),
    );
  }
  const status = RUN_STATUS[run.status] || "run";
  const start = run.startTime ? new Date(run.startTime) : null;
  const end = run.endTime ? new Date(run.endTime) : null;
  const parts = [];
  if (start) parts.push(shortTime(run.startTime));
  if (Number(run.iterations)) parts.push(`${run.iterations} LLM call${Number(run.iterations) === 1 ? "" : "s"}`);
  if (start && end) parts.push(duration(end - start));
  if (usage && usage.input + usage.output > 0) {
    const about = usage.estimated ? "≈ " : "";
    parts.push(`${about}${(usage.input + usage.output).toLocaleString()} tokens${usage.estimated ? " (estimated)" : ""}`);
  }
  return h(
    "div",
    { class: `run-head run-${status.replace(/ /g, "-")}`, testid: "run", dataset: { runId: run.id || "", status: run.status || "" } },
    h("span", { class: "run-status" }, status),
    h("span", { class: "run-meta", title: start ? start.toLocaleString() : "" }, parts.join(" · ")),
    run.error ? h("div", { class: "run-error" }, run.error) : null,
  );
}
