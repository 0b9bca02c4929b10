// People's control of an agent (issue 5): lifecycle buttons, the step
// actions (retry, fork, and while paused edit, delete, add a note), and the
// Queue, Sessions and Checkpoints tabs of the agent panel.
//
// Every view gets a `host` from agent.js: { ctx, agentId, agent (the agent
// now), alive() (the panel is still this agent's), setAgent(agent),
// reloadSteps(after) (re-reads the main session's steps after a sequence
// number), adoptMainSession(agent) (the agent's main session may have changed:
// true when the panel switched to it), openAgent(agentId), fail(what, error)
// (shows an API error in the panel head) }.

import { duration, h, longTime, setChildren, shortTime, snippet } from "./dom.js";
import { renderMarkdown } from "./markdown.js";
import { renderStep } from "./steps.js";
import { field, modal, toast } from "./ui.js";

/** Agent states as people read them (also the CSS class suffix). */
export const STATE_LABELS = {
  AGENT_STATE_IDLE: "idle",
  AGENT_STATE_RUNNING: "running",
  AGENT_STATE_ERROR: "error",
  AGENT_STATE_PAUSED: "paused",
  AGENT_STATE_TERMINATED: "terminated",
};

const PAUSED = "AGENT_STATE_PAUSED";

export function isPaused(agent) {
  return agent.state === PAUSED;
}

/** An agent's state version (int64: a string in JSON, left out when 0). */
function stateVersion(agent) {
  try {
    return BigInt(agent?.stateVersion ?? 0);
  } catch {
    return 0n;
  }
}

/**
 * `current` (an agent as shown) updated with `incoming`: a whole Agent from a
 * response, or some of its fields from an event. Its state (state, lastError,
 * pausePending, stateVersion) is taken only if its version is at least the
 * one shown: a response made before a change can arrive after the change's
 * event (ResumeAgent's IDLE after the run's RUNNING).
 */
export function mergeAgent(current, incoming) {
  if (!current || !("state" in incoming)) return { ...current, ...incoming };
  const fresh = stateVersion(incoming) >= stateVersion(current);
  const source = fresh ? incoming : current;
  return {
    ...current,
    ...incoming,
    state: source.state,
    lastError: source.lastError || "",
    pausePending: Boolean(source.pausePending),
    stateVersion: String(stateVersion(source)),
  };
}

function newRequestId() {
  if (crypto.randomUUID) return crypto.randomUUID();
  const b = crypto.getRandomValues(new Uint8Array(16));
  b[6] = (b[6] & 0x0f) | 0x40;
  b[8] = (b[8] & 0x3f) | 0x80;
  const hex = [...b].map((x) => x.toString(16).padStart(2, "0")).join("");
  return `${hex.slice(0, 8)}-${hex.slice(8, 12)}-${hex.slice(12, 16)}-${hex.slice(16, 20)}-${hex.slice(20)}`;
}

function shortId(id) {
  return String(id || "").slice(-6);
}

// -- lifecycle -------------------------------------------------------------------

// The controls each state allows (services/runtime/domain/lifecycle.py); the
// server checks again, and a refusal shows in the panel.
const CONTROLS_BY_STATE = {
  AGENT_STATE_IDLE: ["pause", "terminate"],
  AGENT_STATE_RUNNING: ["pause", "interrupt", "terminate"],
  AGENT_STATE_ERROR: ["pause", "terminate"],
  AGENT_STATE_PAUSED: ["resume", "terminate"],
  AGENT_STATE_TERMINATED: ["start"],
};

const CONTROL_INFO = {
  start: ["Start", "Start the terminated agent again: it becomes idle and handles what waits."],
  pause: ["Pause", "Pause at the next step boundary; messages and tasks wait until Resume."],
  resume: ["Resume", "Go on from the last step, then with what waited."],
  interrupt: ["Interrupt", "Stop the model call or tool now (what was streamed is kept, marked interrupted) and pause."],
  terminate: ["Terminate", "Stop the run in flight; it handles nothing until Start."],
};

/** The lifecycle buttons the agent's state allows. */
export function lifecycleButtons(host, { onPauseRequested }) {
  const names = CONTROLS_BY_STATE[host.agent.state] || ["pause", "terminate"];
  return names.map((name) => {
    const [label, title] = CONTROL_INFO[name];
    const danger = name === "terminate" || name === "interrupt";
    return h(
      "button",
      {
        class: `btn btn-small${danger ? " btn-danger" : ""}${name === "resume" || name === "start" ? " btn-primary" : ""}`,
        type: "button",
        testid: `agent-${name}`,
        title,
        onclick: (event) => (name === "terminate" ? showTerminate(host) : control(host, name, event.currentTarget, onPauseRequested)),
      },
      label,
    );
  });
}

async function control(host, name, button, onPauseRequested) {
  button.disabled = true;
  try {
    const response = await host.ctx.api("POST", `/v1/agents/${host.agentId}:${name}`, { body: {} });
    if (!host.alive()) return;
    // Pause takes effect at the next step boundary: until then the agent still runs.
    if (name === "pause" && response.agent.state !== PAUSED) onPauseRequested();
    host.setAgent(response.agent);
  } catch (err) {
    host.fail(`Could not ${name} ${host.agent.name}`, err);
  } finally {
    button.disabled = false;
  }
}

function showTerminate(host) {
  const agent = host.agent;
  const keep = h("input", { type: "radio", name: "queue-policy", value: "QUEUE_POLICY_KEEP", checked: true, testid: "terminate-keep" });
  const clear = h("input", { type: "radio", name: "queue-policy", value: "QUEUE_POLICY_CLEAR", testid: "terminate-clear" });
  modal(
    `Terminate ${agent.name}`,
    h(
      "div",
      {},
      h("p", {}, "The run in flight is cancelled and the agent handles nothing (no messages, no tasks) until you Start it again."),
      h("div", { class: "field-label" }, "Its queued tasks"),
      h("label", { class: "choice" }, keep, h("span", {}, "Keep them for when it is started again")),
      h("label", { class: "choice" }, clear, h("span", {}, "Cancel them")),
    ),
    {
      submitLabel: "Terminate",
      testid: "terminate-dialog",
      onSubmit: async () => {
        const queuePolicy = clear.checked ? "QUEUE_POLICY_CLEAR" : "QUEUE_POLICY_KEEP";
        const response = await host.ctx.api("POST", `/v1/agents/${host.agentId}:terminate`, { body: { queuePolicy } });
        if (host.alive()) host.setAgent(response.agent);
        toast(`${agent.name} is terminated${clear.checked ? "; its queue was cleared" : ""}.`);
      },
    },
  );
}

// -- step actions ----------------------------------------------------------------

const ROLE_NAMES = { STEP_ROLE_SYSTEM: "system", STEP_ROLE_USER: "user", STEP_ROLE_ASSISTANT: "assistant", STEP_ROLE_TOOL: "tool" };

/** The buttons under a completed step of the main session. */
export function stepActions(host, step) {
  const seq = Number(step.sequence);
  const button = (label, testid, onclick, title, extra = "") => h("button", { class: `link-btn${extra}`, type: "button", testid, title, onclick: () => onclick(host, step) }, label);
  const actions = [];
  if (seq >= 2) actions.push(button("Retry from here", "step-retry", confirmRetry, `Archive step #${seq} and later, and continue from step #${seq - 1}`));
  actions.push(button("Fork from here", "step-fork", showFork, `Copy steps up to #${seq} into a new session or a new agent, and continue there`));
  if (isPaused(host.agent)) {
    actions.push(button("Edit", "step-edit", showEditStep, "Change what this step says (the original is archived)"));
    actions.push(button("Delete", "step-delete", confirmDeleteStep, "Remove this step from the context (archived, not lost)", " link-danger"));
  }
  return actions;
}

function confirmRetry(host, step) {
  const seq = Number(step.sequence);
  modal(
    `Retry from step #${seq}`,
    h(
      "div",
      {},
      h("p", {}, `Steps #${seq} and later are archived (kept for audit, no longer in the agent's context) and the agent continues from step #${seq - 1}: after an input or a tool result it calls the model again; after tool calls it runs them first.`),
      host.agent.state === PAUSED ? h("p", { class: "muted small" }, "The agent is paused: retrying resumes it.") : null,
    ),
    {
      submitLabel: "Retry",
      testid: "retry-dialog",
      onSubmit: async () => {
        const response = await host.ctx.api("POST", `/v1/agents/${host.agentId}/steps/${seq}:retry`, { body: {} });
        if (!host.alive()) return;
        host.setAgent(response.agent);
        host.reloadSteps(seq - 1);
        toast(`Retrying from step #${seq}.`);
      },
    },
  );
}

function showFork(host, step) {
  const seq = Number(step.sequence);
  const agent = host.agent;
  const intoSession = h("input", { type: "radio", name: "fork-into", value: "session", checked: true, testid: "fork-session" });
  const intoAgent = h("input", { type: "radio", name: "fork-into", value: "agent", testid: "fork-agent" });
  const name = h("input", { maxlength: 100, placeholder: `${agent.name} (fork)`, disabled: true, testid: "fork-name" });
  const sync = () => {
    name.disabled = !intoAgent.checked;
  };
  intoSession.addEventListener("change", sync);
  intoAgent.addEventListener("change", sync);
  modal(
    `Fork from step #${seq}`,
    h(
      "div",
      {},
      h("p", {}, `Steps #1 to #${seq} are copied and the copy goes on from step #${seq}; this thread stays as it is.`),
      h("label", { class: "choice" }, intoSession, h("span", {}, "Into a new session of ", h("strong", {}, agent.name), " (it becomes the main thread: new messages and tasks go there)")),
      h("label", { class: "choice" }, intoAgent, h("span", {}, "Into a new agent: a clone with the same settings and its own chats")),
      field("Name of the new agent", name, "Only for a new agent; empty gives the default."),
    ),
    {
      submitLabel: "Fork",
      testid: "fork-dialog",
      onSubmit: async () => {
        const body = intoAgent.checked ? { newAgent: true, name: name.value.trim() } : { newAgent: false };
        const response = await host.ctx.api("POST", `/v1/agents/${host.agentId}/steps/${seq}:fork`, { body });
        if (intoAgent.checked) {
          host.ctx.upsertAgent(response.agent);
          toast(`Forked into the new agent ${response.agent.name}.`);
          host.openAgent(response.agent.id);
        } else {
          toast(`Forked from step #${seq}: the new session is now the main thread.`);
          if (host.alive()) host.adoptMainSession(response.agent);
        }
      },
    },
  );
}

function showEditStep(host, step) {
  const seq = Number(step.sequence);
  const content = h("textarea", { rows: 8, testid: "edit-step-content" });
  content.value = step.content || "";
  modal(
    `Edit step #${seq}`,
    h(
      "div",
      {},
      h("p", { class: "muted small" }, `A ${ROLE_NAMES[step.role] || "assistant"} step. The agent reads the new text from now on; the original is archived.`),
      field("Content", content),
    ),
    {
      submitLabel: "Save",
      testid: "edit-step-dialog",
      wide: true,
      onSubmit: async () => {
        await host.ctx.api("PATCH", `/v1/agents/${host.agentId}/steps/${seq}`, { body: { content: content.value } });
        if (host.alive()) host.reloadSteps(seq - 1);
        toast(`Step #${seq} edited.`);
      },
    },
  );
}

function confirmDeleteStep(host, step) {
  const seq = Number(step.sequence);
  const calls = (step.toolCalls || []).length;
  modal(
    `Delete step #${seq}`,
    h(
      "div",
      {},
      h("p", {}, `Step #${seq} leaves the agent's context (it is archived, not lost); later steps keep their numbers.`),
      calls ? h("p", { class: "muted small" }, "Its tool calls go with it, and so do their results.") : null,
    ),
    {
      submitLabel: "Delete",
      testid: "delete-step-dialog",
      onSubmit: async () => {
        await host.ctx.api("DELETE", `/v1/agents/${host.agentId}/steps/${seq}`);
        if (host.alive()) host.reloadSteps(seq - 1);
        toast(`Step #${seq} deleted.`);
      },
    },
  );
}

/** The "Add a note" dialog (a system or user step at the end of the context). */
export function showAddNote(host) {
  const role = h(
    "select",
    { testid: "note-role" },
    h("option", { value: "STEP_ROLE_SYSTEM" }, "System: an instruction"),
    h("option", { value: "STEP_ROLE_USER" }, "User: as if said by the user"),
  );
  const content = h("textarea", { rows: 5, placeholder: "e.g. Answer in one sentence.", testid: "note-content" });
  modal(
    `Add a note to ${host.agent.name}`,
    h("div", {}, h("p", { class: "muted small" }, "The note becomes the last step of the agent's context; the agent reads it when resumed."), field("Kind", role), field("Note", content)),
    {
      submitLabel: "Add note",
      testid: "note-dialog",
      onSubmit: async () => {
        if (!content.value.trim()) throw new Error("Write the note first.");
        const response = await host.ctx.api("POST", `/v1/agents/${host.agentId}/notes`, { body: { role: role.value, content: content.value } });
        if (host.alive()) host.reloadSteps(Number(response.step.sequence) - 1);
        toast("Note added.");
      },
    },
  );
}

// -- the queue -------------------------------------------------------------------

const TASK_STATUS = {
  TASK_STATUS_QUEUED: "queued",
  TASK_STATUS_RUNNING: "running",
  TASK_STATUS_SUCCEEDED: "succeeded",
  TASK_STATUS_FAILED: "failed",
  TASK_STATUS_CANCELLED: "cancelled",
  TASK_STATUS_DEAD: "dead",
};
const CANCELLABLE = new Set(["TASK_STATUS_QUEUED", "TASK_STATUS_RUNNING", "TASK_STATUS_FAILED"]);
// What the queue counts as waiting: queued, or failed and due for a retry (as GetQueueStats does).
const WAITING = new Set(["TASK_STATUS_QUEUED", "TASK_STATUS_FAILED"]);
const TASK_PAGES = 5;
const TASK_PAGE_SIZE = 100;

function byNewest(a, b) {
  return String(b.createTime).localeCompare(String(a.createTime)) || String(b.id).localeCompare(String(a.id));
}

/**
 * The Queue tab: submit a task, the agent's tasks live (task_changed
 * events), cancel, and the queue's figures. Returns { element, onTask, refresh }.
 *
 * The counters are counted from the task list itself, so they cannot
 * disagree with it. Every change of a task is an event, in order; a response
 * (a reload, a submit, a cancel) is a snapshot that may be older than an
 * event that arrived while it was on its way, so it is taken for a task only
 * when no event about that task came since the request left.
 */
export function queueView(host) {
  const tasks = new Map();
  const eventAt = new Map(); // task id -> the event count when its last event came
  let events = 0;
  let averageWaitMs = 0;
  let requestId = newRequestId(); // kept until a submit succeeds: a retried click is the same task
  let timer = 0;
  const input = h("textarea", { rows: 3, placeholder: "What should the agent do?", testid: "task-input" });
  const priority = h("input", { type: "number", step: "1", value: "0", testid: "task-priority" });
  const error = h("div", { class: "form-error", role: "alert", testid: "queue-error", hidden: true });
  const stats = h("div", { class: "queue-stats", testid: "queue-stats" }, "…");
  const list = h("div", { class: "task-list", testid: "task-list" }, h("p", { class: "muted" }, "Loading…"));
  const submitButton = h("button", { class: "btn btn-primary", type: "submit", testid: "task-submit" }, "Submit task");
  const showError = (what, err) => {
    error.textContent = `${what}: ${err.message}`;
    error.hidden = false;
  };

  /** Takes in tasks from a response to a request sent when `sentAt` events had come. */
  const adopt = (sentAt, ...snapshot) => {
    for (const task of snapshot) if ((eventAt.get(task.id) ?? 0) <= sentAt) tasks.set(task.id, task);
  };
  const drawStats = () => {
    const all = [...tasks.values()];
    const queued = all.filter((t) => WAITING.has(t.status)).length;
    const running = all.filter((t) => t.status === "TASK_STATUS_RUNNING").length;
    setChildren(
      stats,
      h("span", { testid: "queue-queued", dataset: { value: String(queued) } }, `${queued} queued`),
      " · ",
      h("span", { testid: "queue-running", dataset: { value: String(running) } }, `${running} running`),
      " · ",
      h("span", { testid: "queue-wait" }, `average wait ${duration(averageWaitMs)}`),
    );
  };
  const draw = () => {
    const sorted = [...tasks.values()].sort(byNewest);
    setChildren(list, sorted.length ? sorted.map((task) => taskCard(task)) : h("p", { class: "muted", testid: "no-tasks" }, "No tasks yet."));
    drawStats();
  };
  const taskCard = (task) => {
    const status = TASK_STATUS[task.status] || "unknown";
    const details = [];
    if (task.status === "TASK_STATUS_QUEUED") details.push(h("span", { testid: "task-position" }, Number(task.position) === 0 ? "next in line" : `position ${Number(task.position) + 1} in line`));
    if (Number(task.priority)) details.push(`priority ${task.priority}`);
    if (Number(task.attempts) > 1 || task.status === "TASK_STATUS_FAILED" || task.status === "TASK_STATUS_DEAD") details.push(`${task.attempts} attempt${Number(task.attempts) === 1 ? "" : "s"}`);
    if (task.status === "TASK_STATUS_FAILED" && task.retryTime) details.push(h("span", { testid: "task-retry", title: longTime(task.retryTime) }, `retry at ${new Date(task.retryTime).toLocaleTimeString()}`));
    details.push(h("span", { title: longTime(task.createTime) }, `submitted ${shortTime(task.createTime)}`));
    const cancel = CANCELLABLE.has(task.status)
      ? h("button", { class: "link-btn link-danger", type: "button", testid: "task-cancel", onclick: (event) => cancelTask(task, event.currentTarget) }, "Cancel")
      : null;
    return h(
      "div",
      { class: `task task-${status}`, testid: "task", dataset: { taskId: task.id, status: task.status } },
      h("div", { class: "task-head" }, h("span", { class: `task-status status-${status}`, testid: "task-status" }, status), h("span", { class: "task-input", title: task.input }, snippet(task.input, 120)), cancel),
      h("div", { class: "task-meta muted small" }, details.flatMap((d, i) => (i ? [" · ", d] : [d]))),
      task.status === "TASK_STATUS_SUCCEEDED" && task.result ? h("div", { class: "task-result", testid: "task-result" }, renderMarkdown(task.result)) : null,
      task.lastError && task.status !== "TASK_STATUS_SUCCEEDED" ? h("div", { class: "task-error", testid: "task-error" }, `Last error: ${task.lastError}`) : null,
    );
  };

  const refresh = async () => {
    const sentAt = events;
    try {
      // Every task the counters count (waiting ones may be older than the newest page).
      const pages = [];
      let pageToken = "";
      for (let n = 0; n < TASK_PAGES && (n === 0 || pageToken); n += 1) {
        const page = await host.ctx.api("GET", `/v1/agents/${host.agentId}/tasks`, { query: { page_size: TASK_PAGE_SIZE, page_token: pageToken } });
        pages.push(...(page.tasks || []));
        pageToken = page.nextPageToken || "";
      }
      const queue = await host.ctx.api("GET", `/v1/agents/${host.agentId}/queue`);
      if (!host.alive() || !element.isConnected) return;
      averageWaitMs = queue.averageWaitMs || 0;
      adopt(sentAt, ...pages);
      draw();
    } catch (err) {
      showError("Could not load the queue", err);
    }
  };
  // Many events come together (a task finishing starts the next): one reload for all.
  const refreshSoon = () => {
    clearTimeout(timer);
    timer = setTimeout(refresh, 250);
  };

  const cancelTask = async (task, button) => {
    button.disabled = true;
    error.hidden = true;
    try {
      const sentAt = events;
      const response = await host.ctx.api("POST", `/v1/tasks/${task.id}:cancel`, { body: {} });
      adopt(sentAt, response.task);
      draw();
      refreshSoon();
    } catch (err) {
      button.disabled = false;
      showError("Could not cancel the task", err);
    }
  };

  const submit = async (event) => {
    event.preventDefault();
    error.hidden = true;
    if (!input.value.trim()) {
      showError("Not submitted", new Error("Say what the task is."));
      return;
    }
    submitButton.disabled = true;
    try {
      const body = { input: input.value, requestId, priority: Math.trunc(Number(priority.value) || 0) };
      const sentAt = events;
      const response = await host.ctx.api("POST", `/v1/agents/${host.agentId}/tasks`, { body });
      requestId = newRequestId();
      input.value = "";
      adopt(sentAt, response.task);
      draw();
      refreshSoon();
      const task = response.task;
      toast(task.status === "TASK_STATUS_QUEUED" ? `Task queued (${Number(task.position) === 0 ? "next in line" : `position ${Number(task.position) + 1}`}).` : "Task started.");
    } catch (err) {
      showError("Not submitted", err);
    } finally {
      submitButton.disabled = false;
    }
  };

  const element = h(
    "div",
    { class: "tab-view queue", testid: "agent-queue" },
    h(
      "form",
      { class: "queue-form", onsubmit: submit },
      field("Task", input, "Given to the agent as its input. It starts at once when the agent is idle, else it waits its turn."),
      h("div", { class: "queue-form-row" }, field("Priority", priority, "Higher runs first among the waiting."), submitButton),
    ),
    error,
    h("div", { class: "list-title" }, "Queue"),
    stats,
    h("div", { class: "list-title" }, "Tasks (newest first)"),
    list,
  );
  refresh();
  return {
    element,
    refresh,
    onTask(task) {
      events += 1;
      eventAt.set(task.id, events);
      tasks.set(task.id, task);
      if (element.isConnected) {
        draw();
        // Positions in line move for the others.
        refreshSoon();
      }
    },
  };
}

// -- sessions --------------------------------------------------------------------

/** The Sessions tab: the agent's threads of steps, which is main, set main. Returns { element, refresh }. */
export function sessionsView(host) {
  const list = h("div", { class: "session-list", testid: "session-list" }, h("p", { class: "muted" }, "Loading…"));
  const error = h("div", { class: "form-error", role: "alert", testid: "sessions-error", hidden: true });
  const refresh = async () => {
    try {
      const response = await host.ctx.api("GET", `/v1/agents/${host.agentId}/sessions`);
      if (!host.alive() || !list.isConnected) return;
      const sessions = response.sessions || [];
      const number = new Map(sessions.map((s, i) => [s.id, i + 1]));
      setChildren(
        list,
        sessions.map((session) => {
          const n = number.get(session.id);
          const origin = session.forkedFromSessionId
            ? `forked from ${number.has(session.forkedFromSessionId) ? `session ${number.get(session.forkedFromSessionId)}` : "another agent's session"} at step #${session.forkedAtSequence}`
            : "the original thread";
          return h(
            "div",
            { class: `session${session.main ? " is-main" : ""}`, testid: "session", dataset: { sessionId: session.id, main: String(Boolean(session.main)), forkedFrom: session.forkedFromSessionId || "" } },
            h(
              "div",
              { class: "session-head" },
              h("strong", {}, `Session ${n}`),
              h("code", { class: "muted small", title: session.id }, shortId(session.id)),
              session.main ? h("span", { class: "main-badge", testid: "session-main" }, "main") : null,
            ),
            h("div", { class: "muted small" }, `${origin} · ${Number(session.stepCount || 0)} step${Number(session.stepCount) === 1 ? "" : "s"} · created ${shortTime(session.createTime)}`),
            h(
              "div",
              { class: "session-actions" },
              h("button", { class: "link-btn", type: "button", testid: "session-steps", onclick: () => showSessionSteps(host, session, n) }, "Show steps"),
              session.main
                ? null
                : h("button", { class: "btn btn-small", type: "button", testid: "session-set-main", onclick: (event) => setMain(session, event.currentTarget) }, "Make main"),
            ),
          );
        }),
        sessions.length ? null : h("p", { class: "muted" }, "No sessions."),
      );
    } catch (err) {
      error.textContent = `Could not load the sessions: ${err.message}`;
      error.hidden = false;
    }
  };
  const setMain = async (session, button) => {
    button.disabled = true;
    error.hidden = true;
    try {
      const response = await host.ctx.api("POST", `/v1/agents/${host.agentId}:setMainSession`, { body: { sessionId: session.id } });
      if (!host.alive()) return;
      host.adoptMainSession(response.agent);
      toast("Main thread changed: new messages and tasks go to it.");
      refresh();
    } catch (err) {
      button.disabled = false;
      error.textContent = `Could not make it main: ${err.message}`;
      error.hidden = false;
    }
  };
  const element = h(
    "div",
    { class: "tab-view sessions", testid: "agent-sessions" },
    h("p", { class: "muted small" }, "A session is a thread of the agent's steps. New messages and tasks go to the main one; Fork from a step makes a new one. The Activity tab shows the main session."),
    error,
    list,
  );
  refresh();
  return { element, refresh };
}

async function showSessionSteps(host, session, n) {
  const body = h("div", { class: "session-steps", testid: "session-steps-list" }, h("p", { class: "muted" }, "Loading…"));
  modal(`Session ${n}`, body, { testid: "session-steps-dialog", wide: true });
  try {
    const steps = [];
    let after = 0;
    for (let page = 0; page < 25; page += 1) {
      const response = await host.ctx.api("GET", `/v1/agents/${host.agentId}/steps`, { query: { session_id: session.id, after_sequence: after, page_size: 200 } });
      steps.push(...(response.steps || []));
      if (!response.hasMore || !(response.steps || []).length) break;
      after = Number(steps[steps.length - 1].sequence);
    }
    setChildren(body, steps.length ? steps.map((step) => renderStep(step)) : h("p", { class: "muted" }, "No steps."));
  } catch (err) {
    setChildren(body, h("p", { class: "form-error" }, err.message));
  }
}

// -- checkpoints -----------------------------------------------------------------

/** The Checkpoints tab: create one with a name, list them, restore one. */
export function checkpointsView(host) {
  const name = h("input", { maxlength: 100, placeholder: "e.g. before the refactor", testid: "checkpoint-name" });
  const error = h("div", { class: "form-error", role: "alert", testid: "checkpoint-error", hidden: true });
  const list = h("div", { class: "checkpoint-list", testid: "checkpoint-list" }, h("p", { class: "muted" }, "Loading…"));
  const refresh = async () => {
    try {
      const response = await host.ctx.api("GET", `/v1/agents/${host.agentId}/checkpoints`, { query: { page_size: 50 } });
      if (!host.alive() || !list.isConnected) return;
      const checkpoints = response.checkpoints || [];
      setChildren(
        list,
        checkpoints.length
          ? checkpoints.map((cp) =>
              h(
                "div",
                { class: "checkpoint", testid: "checkpoint", dataset: { checkpointId: cp.id, name: cp.name } },
                h("div", { class: "session-head" }, h("strong", {}, cp.name), h("span", { class: "muted small", title: longTime(cp.createTime) }, shortTime(cp.createTime))),
                h("div", { class: "muted small" }, `up to step #${cp.sequence} of session ${shortId(cp.sessionId)}${cp.sessionId === host.agent.mainSessionId ? " (main)" : ""}`),
                h("div", { class: "session-actions" }, h("button", { class: "btn btn-small", type: "button", testid: "checkpoint-restore", onclick: () => confirmRestore(cp) }, "Restore")),
              ),
            )
          : h("p", { class: "muted" }, "No checkpoints yet."),
      );
    } catch (err) {
      error.textContent = `Could not load the checkpoints: ${err.message}`;
      error.hidden = false;
    }
  };
  const create = async (event) => {
    event.preventDefault();
    error.hidden = true;
    try {
      if (!name.value.trim()) throw new Error("Give the checkpoint a name.");
      await host.ctx.api("POST", `/v1/agents/${host.agentId}/checkpoints`, { body: { name: name.value.trim() } });
      name.value = "";
      toast("Checkpoint created.");
      refresh();
    } catch (err) {
      error.textContent = `Not created: ${err.message}`;
      error.hidden = false;
    }
  };
  const confirmRestore = (cp) => {
    modal(
      `Restore “${cp.name}”`,
      h(
        "div",
        {},
        h("p", {}, `The agent's settings go back to those of the checkpoint and its context to step #${cp.sequence} of that session, which becomes main. What came after is archived (kept, not destroyed).`),
        h("p", { class: "muted small" }, "Only while the agent is idle or paused. It does not run by itself: the next message, task or Resume continues."),
      ),
      {
        submitLabel: "Restore",
        testid: "restore-dialog",
        onSubmit: async () => {
          const response = await host.ctx.api("POST", `/v1/agents/${host.agentId}/checkpoints/${cp.id}:restore`, { body: {} });
          if (!host.alive()) return;
          // Another session made main reloads everything; the same one, what came after the checkpoint.
          if (!host.adoptMainSession(response.agent)) host.reloadSteps(Number(cp.sequence));
          toast(`Restored “${cp.name}”.`);
          refresh();
        },
      },
    );
  };
  const element = h(
    "div",
    { class: "tab-view checkpoints", testid: "agent-checkpoints" },
    h("p", { class: "muted small" }, "A checkpoint keeps the agent's main session up to now and its settings. Restoring one goes back there."),
    h("form", { class: "inline-form", onsubmit: create }, name, h("button", { class: "btn btn-primary", type: "submit", testid: "checkpoint-create" }, "Create")),
    error,
    list,
  );
  refresh();
  return { element, refresh };
}
