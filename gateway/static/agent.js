// The agent panel (state, runs and steps streaming live, settings, the
// organisation tree) and the agent form.

import { LiveStream, listAll } from "./api.js";
import { STATE_LABELS, checkpointsView, isPaused, lifecycleButtons, mergeAgent, queueView, sessionsView, showAddNote, stepActions } from "./control.js";
import { avatar, h, setChildren } from "./dom.js";
import { memoryView } from "./memory.js";
import { applyDelta, renderRunHeader, renderStep, startedStep } from "./steps.js";
import { field, isNarrow, modal, showError, streamStatus, toast } from "./ui.js";

// The runtime's built-in tools, as it tells them (GET /v1/tools): asked once
// a page, and again after a failure.
let toolsAsked = null;

function builtInTools(ctx) {
  if (!toolsAsked) {
    toolsAsked = ctx.api("GET", "/v1/tools").then((response) => response.tools || []);
    toolsAsked.catch(() => (toolsAsked = null));
  }
  return toolsAsked;
}

const AGENT_EVENTS = [
  "run_started",
  "run_ended",
  "step_started",
  "step_delta",
  "step_completed",
  "state_changed",
  "task_changed",
  "main_session_changed",
  "steps_rewritten",
  "step_aborted",
];
const TABS = [
  ["activity", "Activity"],
  ["queue", "Queue"],
  ["sessions", "Sessions"],
  ["checkpoints", "Checkpoints"],
  ["memory", "Memory"],
  ["settings", "Settings"],
  ["organisation", "Organisation"],
];
const RUNS_PAGE = 10;

let panel = null;

/** The id of the agent whose panel is open, or "". */
export function currentPanelAgent() {
  return panel ? panel.agentId : "";
}

function panelElement() {
  return document.getElementById("agent-panel");
}

/** Closes the agent panel and its stream. */
export function closeAgentPanel() {
  if (!panel) return;
  panel.stream?.close();
  cancelAnimationFrame(panel.frame);
  panel = null;
  const el = panelElement();
  if (el) {
    el.hidden = true;
    setChildren(el);
  }
  document.querySelector(".shell")?.classList.remove("with-panel");
}

/** Opens (or re-opens) the panel of an agent: its activity streams in live. */
export async function openAgentPanel(ctx, agentId, { tab = "activity" } = {}) {
  const previous = panel;
  closeAgentPanel();
  const agent = ctx.state.agents.get(agentId);
  if (!agent) {
    showError(new Error("That agent is not known here (it may have been deleted)."));
    return;
  }
  panel = {
    ctx,
    agentId,
    agent: { ...agent },
    tab: previous && previous.agentId === agentId ? previous.tab : tab,
    runs: new Map(),
    steps: new Map(), // sequence -> completed Step
    live: new Map(), // sequence -> Step being streamed
    lastCompleted: 0,
    runsToken: "",
    currentRun: "",
    sections: new Map(),
    stepEls: new Map(),
    reasoningOpen: new Map(),
    dirty: new Set(),
    frame: 0,
    stream: null,
    loaded: false,
    streamed: 0,
    gen: 0, // bumped when the steps are reloaded: an older load stops
    reloadFrom: Infinity,
    pauseRequested: false,
    drawnMode: "", // what the Activity tab was drawn for (see activityMode)
    actionError: "",
    view: null, // the open Queue, Sessions or Checkpoints tab
    host: null,
  };
  panel.host = makeHost(panel);
  const el = panelElement();
  el.hidden = false;
  document.querySelector(".shell")?.classList.add("with-panel");
  drawPanel();
  const mine = panel;
  try {
    const fresh = (await ctx.api("GET", `/v1/agents/${agentId}`)).agent;
    if (panel !== mine) return;
    panel.agent = mergeAgent(panel.agent, fresh);
    ctx.upsertAgent({ ...panel.agent });
    drawHead();
    await loadActivity(mine);
  } catch (err) {
    showError(err, "Could not load the agent");
  }
  if (panel !== mine) return;
  panel.loaded = true;
  drawBody();
  startStream(mine);
}

/** Called when the app learns of an agent's new state or settings. */
export function updateAgentInPanel(agent) {
  if (!panel || panel.agentId !== agent.id) return;
  // The panel follows the main session from its own stream and calls.
  applyAgent(panel, { ...agent, mainSessionId: panel.agent.mainSessionId });
}

/** What control.js may use of the panel `mine`. */
function makeHost(mine) {
  return {
    ctx: mine.ctx,
    agentId: mine.agentId,
    get agent() {
      return mine.agent;
    },
    alive: () => panel === mine,
    setAgent(agent) {
      if (panel !== mine) return;
      mine.actionError = "";
      applyAgent(mine, agent);
    },
    reloadSteps: (after) => panel === mine && reloadSteps(mine, after),
    adoptMainSession: (agent) => panel === mine && applyAgent(mine, agent),
    openAgent: (agentId) => openAgentPanel(mine.ctx, agentId),
    goToStep: (sequence, sessionId) => goToStep(mine, sequence, sessionId),
    fail(what, error) {
      if (panel !== mine) return;
      mine.actionError = `${what}: ${error && error.message ? error.message : error}`;
      drawHead();
      // Refused for the agent's state: what the panel shows may be behind; show it as it is.
      if (error && error.status === "FAILED_PRECONDITION") refreshAgent(mine);
    },
  };
}

/**
 * Takes in the agent's new state or settings; returns true when its main
 * session changed (the panel then loads the new one).
 */
function applyAgent(p, agent) {
  const before = p.agent;
  p.agent = mergeAgent(before, agent);
  // The service says when a pause is pending (whoever asked for it); it ends with the run's state change.
  if (p.agent.state !== "AGENT_STATE_RUNNING") p.pauseRequested = false;
  else if (p.agent.pausePending) p.pauseRequested = true;
  // A copy: the app keeps its own, and the panel compares before and after.
  p.ctx.upsertAgent({ ...p.agent });
  drawHead();
  const session = p.agent.mainSessionId;
  if (session && before.mainSessionId && session !== before.mainSessionId) {
    switchSession(p);
    return true;
  }
  // Edit and delete are offered only while paused (and a bar says so).
  if (p.drawnMode !== activityMode(p.agent)) redrawActivity();
  return false;
}

// -- loading and streaming -------------------------------------------------------

async function loadActivity(mine, gen = mine.gen) {
  const { ctx, agentId } = mine;
  const runsPage = await ctx.api("GET", `/v1/agents/${agentId}/runs`, { query: { page_size: RUNS_PAGE } });
  if (mine.gen !== gen) return;
  const runs = runsPage.runs || [];
  for (const run of runs) mine.runs.set(run.id, run);
  mine.runsToken = runsPage.nextPageToken || "";
  let after = 0;
  if (mine.runsToken && runs.length) after = await firstSequenceOf(mine, runs[runs.length - 1].id);
  await loadStepsAfter(mine, after, { gen });
}

async function firstSequenceOf(mine, runId) {
  const page = await mine.ctx.api("GET", `/v1/agents/${mine.agentId}/steps`, {
    query: { run_id: runId, page_size: 1, session_id: mine.agent.mainSessionId },
  });
  const first = (page.steps || [])[0];
  return first ? Math.max(0, Number(first.sequence) - 1) : 0;
}

async function loadStepsAfter(mine, after, { until = Infinity, gen = mine.gen } = {}) {
  let cursor = after;
  for (let page = 0; page < 25; page += 1) {
    const response = await mine.ctx.api("GET", `/v1/agents/${mine.agentId}/steps`, {
      query: { after_sequence: cursor, page_size: 200, session_id: mine.agent.mainSessionId },
    });
    // Superseded by a newer reload (steps rewritten, another main session).
    if (mine.gen !== gen) return;
    const steps = response.steps || [];
    for (const step of steps) {
      const seq = Number(step.sequence);
      if (seq >= until) return;
      mine.steps.set(seq, step);
      mine.live.delete(seq);
      mine.lastCompleted = Math.max(mine.lastCompleted, seq);
      cursor = seq;
    }
    if (!response.hasMore || !steps.length) return;
  }
}

/** Shows a step of the main session in the Activity tab, loading earlier runs until it is there. */
async function goToStep(mine, sequence, sessionId) {
  if (panel !== mine) return;
  if (sessionId && mine.agent.mainSessionId && sessionId !== mine.agent.mainSessionId) {
    toast("That step is in another session of this agent (see Sessions).");
    return;
  }
  while (!mine.steps.has(sequence) && mine.runsToken && panel === mine) {
    const before = mine.runsToken;
    await loadEarlierRuns();
    if (mine.runsToken === before) break;
  }
  if (panel !== mine) return;
  mine.tab = "activity";
  drawPanel();
  const el = mine.stepEls.get(sequence);
  if (!el) {
    toast(`Step #${sequence} is no longer in the history (edited away or restored past).`);
    return;
  }
  el.scrollIntoView({ block: "center" });
  el.classList.add("is-target");
  setTimeout(() => el.classList.remove("is-target"), 2500);
}

/** Opens an agent's panel at one of its steps (from the workspace search). */
export async function openAgentAtStep(ctx, agentId, sequence, sessionId) {
  await openAgentPanel(ctx, agentId, { tab: "activity" });
  if (panel && panel.agentId === agentId) {
    panel.tab = "activity";
    await goToStep(panel, sequence, sessionId);
  }
}

async function loadEarlierRuns() {
  const mine = panel;
  if (!mine || !mine.runsToken) return;
  try {
    const page = await mine.ctx.api("GET", `/v1/agents/${mine.agentId}/runs`, { query: { page_size: RUNS_PAGE, page_token: mine.runsToken } });
    const runs = page.runs || [];
    for (const run of runs) mine.runs.set(run.id, run);
    mine.runsToken = page.nextPageToken || "";
    const known = [...mine.steps.keys()];
    const earliest = known.length ? Math.min(...known) : Infinity;
    const after = runs.length && mine.runsToken ? await firstSequenceOf(mine, runs[runs.length - 1].id) : 0;
    await loadStepsAfter(mine, after, { until: earliest });
    if (panel === mine) drawBody();
  } catch (err) {
    showError(err, "Could not load earlier runs");
  }
}

function startStream(mine) {
  mine.stream = new LiveStream(`/v1/agents/${mine.agentId}/events`, {
    kinds: AGENT_EVENTS,
    resumeParam: "after_sequence",
    // Resume after the last *completed* step: the step in flight is sent again from its start.
    resume: () => String(mine.lastCompleted),
    ...mine.ctx.streamTrouble(`agent ${mine.agent.name}`),
    onEvent: (_kind, data) => panel === mine && onEvent(data.event || {}),
    onStatus: (status, reconnected) => {
      streamStatus(`agent ${mine.agent.name}`, status === "reconnecting" ? "down" : status);
      if (status === "open" && reconnected && panel === mine) catchUp(mine);
    },
  });
}

async function catchUp(mine) {
  try {
    // Steps may have been rewritten, or the main session changed, while the stream was down.
    const fresh = (await mine.ctx.api("GET", `/v1/agents/${mine.agentId}`)).agent;
    if (panel !== mine || applyAgent(mine, fresh)) return;
    const page = await mine.ctx.api("GET", `/v1/agents/${mine.agentId}/runs`, { query: { page_size: RUNS_PAGE } });
    for (const run of page.runs || []) mine.runs.set(run.id, run);
    const known = [...mine.steps.keys()];
    // The open tab (the queue's tasks) may have missed events too.
    mine.view?.refresh?.();
    await reloadSteps(mine, known.length ? Math.min(...known) - 1 : 0);
  } catch (err) {
    showError(err, "Could not catch up with the agent");
  }
}

function onEvent(event) {
  const p = panel;
  if (event.runStarted || event.runEnded) {
    const run = event.runStarted || event.runEnded;
    p.runs.set(run.id, run);
    p.currentRun = event.runStarted ? run.id : p.currentRun === run.id ? "" : p.currentRun;
    if (event.runEnded) {
      refreshAgent(p);
      // A step still streaming when its run ended was never stored (the model failed mid-call): not shown as if still coming.
      for (const [seq, step] of [...p.live.entries()]) {
        if (step.runId !== run.id) continue;
        p.live.delete(seq);
        p.stepEls.get(seq)?.remove();
        p.stepEls.delete(seq);
      }
    }
    const section = p.sections.get(run.id);
    if (section) redrawRunHead(p, run.id);
    else if (p.tab === "activity" && p.loaded) ensureSection(run.id);
  } else if (event.stepStarted) {
    // How many steps this panel saw streaming (for the curious, and the browser test).
    p.streamed += 1;
    const list = document.getElementById("agent-activity");
    if (list) list.dataset.streamedSteps = String(p.streamed);
    const step = startedStep(p.agentId, event.stepStarted);
    if (!step.runId) step.runId = p.currentRun;
    p.live.set(Number(step.sequence), step);
    schedule(Number(step.sequence));
  } else if (event.stepDelta) {
    const seq = Number(event.stepDelta.sequence);
    if (p.steps.has(seq)) return; // already complete: a repeat after a reconnect
    let step = p.live.get(seq);
    if (!step) {
      step = startedStep(p.agentId, { runId: p.currentRun, sequence: seq, role: "STEP_ROLE_ASSISTANT" });
      p.live.set(seq, step);
    }
    applyDelta(step, event.stepDelta);
    schedule(seq);
  } else if (event.stepAborted) {
    // Cut short (its runner stopped or moved): what streamed of it is void; it starts again.
    const seq = Number(event.stepAborted.sequence);
    if (p.steps.has(seq)) return;
    p.live.delete(seq);
    p.stepEls.get(seq)?.remove();
    p.stepEls.delete(seq);
  } else if (event.stepCompleted) {
    const step = event.stepCompleted;
    const seq = Number(step.sequence);
    p.live.delete(seq);
    p.steps.set(seq, step);
    p.lastCompleted = Math.max(p.lastCompleted, seq);
    schedule(seq);
  } else if (event.stateChanged) {
    const changed = event.stateChanged;
    applyAgent(p, { state: changed.state, lastError: changed.error || "", pausePending: Boolean(changed.pausePending), stateVersion: changed.stateVersion });
  } else if (event.taskChanged) {
    p.view?.onTask?.(event.taskChanged);
  } else if (event.mainSessionChanged) {
    if (!applyAgent(p, { mainSessionId: event.mainSessionChanged.id })) p.view?.refresh?.();
  } else if (event.stepsRewritten) {
    const { sessionId, afterSequence } = event.stepsRewritten;
    if (sessionId && p.agent.mainSessionId && sessionId !== p.agent.mainSessionId) return;
    const after = Number(afterSequence) || 0;
    // A step still streaming past that point belonged to the history just replaced.
    for (const seq of [...p.live.keys()]) if (seq > after) p.live.delete(seq);
    reloadSteps(p, after);
  }
}

/**
 * Re-reads the main session's steps after `after` (edited, deleted, added,
 * retried or restored) and redraws. Overlapping reloads merge: the latest
 * reads from the lowest point any of them asked for.
 */
async function reloadSteps(p, after) {
  if (!p.loaded) return; // the load under way reads everything
  p.reloadFrom = Math.min(p.reloadFrom, after);
  const from = p.reloadFrom;
  p.gen += 1;
  const gen = p.gen;
  for (const seq of [...p.steps.keys()]) if (seq > from) p.steps.delete(seq);
  p.lastCompleted = Math.max(0, ...p.steps.keys());
  try {
    await loadStepsAfter(p, from, { gen });
  } catch (err) {
    showError(err, "Could not reload the agent's steps");
  }
  if (panel !== p || p.gen !== gen) return;
  p.reloadFrom = Infinity;
  redrawActivity({ keepScroll: true });
}

/** The main session changed (a fork, Make main, a restore): show the new one. */
async function switchSession(p) {
  p.gen += 1;
  const gen = p.gen;
  p.reloadFrom = Infinity;
  p.steps = new Map();
  p.live = new Map();
  p.lastCompleted = 0;
  p.loaded = false;
  drawBody();
  try {
    await loadActivity(p, gen);
  } catch (err) {
    showError(err, "Could not load the agent's main session");
  }
  if (panel !== p || p.gen !== gen) return;
  p.loaded = true;
  drawBody();
}

/** Re-reads the agent (tokens used, state) after a run. */
async function refreshAgent(p) {
  try {
    const fresh = (await p.ctx.api("GET", `/v1/agents/${p.agentId}`)).agent;
    if (panel !== p) return;
    applyAgent(p, fresh);
  } catch {
    // The next run ends with another try; the stream is what matters.
  }
}

/** Re-draws changed steps once per frame, however many deltas arrive. */
function schedule(seq) {
  const p = panel;
  p.dirty.add(seq);
  if (p.frame) return;
  p.frame = requestAnimationFrame(() => {
    p.frame = 0;
    if (panel !== p || p.tab !== "activity" || !p.loaded) return;
    const list = document.getElementById("agent-activity");
    const follow = list && list.scrollHeight - list.scrollTop - list.clientHeight < 150;
    for (const s of [...p.dirty].sort((a, b) => a - b)) drawStep(s);
    p.dirty.clear();
    if (list && follow) list.scrollTop = list.scrollHeight;
  });
}

// -- drawing -----------------------------------------------------------------

function drawPanel() {
  const el = panelElement();
  const tab = (name, label) =>
    h(
      "button",
      {
        type: "button",
        class: `panel-tab${panel.tab === name ? " active" : ""}`,
        testid: `agent-tab-${name}`,
        onclick: () => {
          panel.tab = name;
          drawPanel();
        },
      },
      label,
    );
  setChildren(
    el,
    h("header", { class: "panel-head", id: "agent-panel-head" }),
    h("div", { class: "panel-tabs", role: "tablist" }, TABS.map(([name, label]) => tab(name, label))),
    h("div", { class: "panel-body", id: "agent-panel-body" }),
  );
  drawHead();
  drawBody();
}

function drawHead() {
  const head = document.getElementById("agent-panel-head");
  if (!head || !panel) return;
  const { agent, ctx } = panel;
  const label = STATE_LABELS[agent.state] || "unknown";
  const budget = Number(agent.tokenBudget) ? ` of ${Number(agent.tokenBudget).toLocaleString()}` : "";
  setChildren(
    head,
    h(
      "div",
      { class: "panel-title" },
      avatar(agent.name, { kind: "MEMBER_KIND_AGENT", seed: agent.memberId }),
      h(
        "div",
        { class: "panel-title-main" },
        h("div", { class: "panel-name", testid: "agent-panel-name" }, agent.name),
        h("div", { class: "muted small" }, agent.role || "agent"),
      ),
      h("span", { class: `state-badge state-${label}`, testid: "agent-state", dataset: { state: label } }, label),
      h("button", { class: "icon-btn", type: "button", "aria-label": "Close the agent panel", testid: "agent-panel-close", onclick: closeAgentPanel }, "×"),
    ),
    agent.state === "AGENT_STATE_ERROR" && agent.lastError ? h("div", { class: "panel-error", role: "alert" }, agent.lastError, " — a new message or Wake retries.") : null,
    h("div", { class: "muted small panel-tokens" }, `${Number(agent.tokensUsed || 0).toLocaleString()}${budget} tokens used`),
    h(
      "div",
      { class: "panel-actions" },
      h("button", { class: "btn btn-small", type: "button", testid: "agent-chat", onclick: () => openChatWith(ctx, agent) }, "Chat"),
      h("button", { class: "btn btn-small", type: "button", testid: "agent-wake", title: "Read its unread messages now", onclick: wake }, "Wake"),
      ctx.canView(agent.memberId)
        ? h("button", { class: "btn btn-small", type: "button", testid: "agent-view-as", title: "See the IM as this agent", onclick: () => ctx.switchPerspective(agent.memberId) }, "View as")
        : null,
    ),
    h(
      "div",
      { class: "panel-actions panel-controls", testid: "agent-controls" },
      lifecycleButtons(panel.host, {
        onPauseRequested: () => {
          panel.pauseRequested = true;
        },
      }),
    ),
    panel.pauseRequested ? h("div", { class: "panel-note", role: "status", testid: "agent-pausing" }, "Pausing at the next step boundary…") : null,
    panel.actionError
      ? h(
          "div",
          { class: "panel-error action-error", role: "alert", testid: "agent-action-error" },
          h("span", {}, panel.actionError),
          h(
            "button",
            {
              class: "icon-btn",
              type: "button",
              "aria-label": "Dismiss",
              onclick: () => {
                panel.actionError = "";
                drawHead();
              },
            },
            "×",
          ),
        )
      : null,
  );
}

/** The agent's direct chat; a phone shows one thing at a time, so the sheet gives way to it. */
function openChatWith(ctx, agent) {
  if (isNarrow()) closeAgentPanel();
  ctx.openDirect(agent.memberId);
}

async function wake() {
  const p = panel;
  try {
    const response = await p.ctx.api("POST", `/v1/agents/${p.agentId}:wake`, { body: {} });
    if (panel !== p) return;
    applyAgent(p, response.agent);
    toast(`${response.agent.name} is reading its messages.`);
  } catch (err) {
    showError(err, "Could not wake the agent");
  }
}

function drawBody() {
  const body = document.getElementById("agent-panel-body");
  if (!body || !panel) return;
  const views = { queue: queueView, sessions: sessionsView, checkpoints: checkpointsView, memory: memoryView };
  panel.view = null;
  if (panel.tab === "settings") setChildren(body, settingsView());
  else if (panel.tab === "organisation") setChildren(body, organisationView());
  else if (views[panel.tab]) {
    panel.view = views[panel.tab](panel.host);
    setChildren(body, panel.view.element);
  } else drawActivity(body);
}

/** Redraws the Activity tab (if open), keeping the reader's place when asked. */
function redrawActivity({ keepScroll = false } = {}) {
  const body = document.getElementById("agent-panel-body");
  if (!body || !panel || panel.tab !== "activity" || !panel.loaded) return;
  const old = document.getElementById("agent-activity");
  const top = old ? old.scrollTop : 0;
  const atEnd = old ? old.scrollHeight - old.scrollTop - old.clientHeight < 150 : true;
  drawActivity(body);
  const list = document.getElementById("agent-activity");
  if (list && keepScroll && !atEnd) list.scrollTop = top;
}

/** What the Activity tab depends on in the agent's state: paused, terminated or neither. */
function activityMode(agent) {
  if (isPaused(agent)) return "paused";
  return agent.state === "AGENT_STATE_TERMINATED" ? "terminated" : "working";
}

/** What the agent's state means for its steps, above them. */
function stateBar(p) {
  if (isPaused(p.agent)) {
    return h(
      "div",
      { class: "state-bar state-bar-paused", role: "status", testid: "paused-bar" },
      h("span", {}, h("strong", {}, "Paused."), " Messages and tasks wait until you Resume. Meanwhile you can edit or delete its steps, or add a note."),
      h("button", { class: "btn btn-small", type: "button", testid: "add-note", onclick: () => showAddNote(p.host) }, "Add a note"),
    );
  }
  if (p.agent.state === "AGENT_STATE_TERMINATED") {
    return h("div", { class: "state-bar state-bar-terminated", role: "status", testid: "terminated-bar" }, h("strong", {}, "Terminated."), " It handles nothing until you Start it.");
  }
  return null;
}

function drawActivity(body) {
  const p = panel;
  p.sections = new Map();
  p.stepEls = new Map();
  const list = h("div", {
    class: "activity",
    id: "agent-activity",
    testid: "agent-activity",
    dataset: { streamedSteps: String(p.streamed), mainSession: p.agent.mainSessionId || "", paused: String(isPaused(p.agent)) },
  });
  p.drawnMode = activityMode(p.agent);
  setChildren(body, stateBar(p), list);
  if (!p.loaded) {
    list.append(h("p", { class: "muted" }, "Loading…"));
    return;
  }
  if (p.runsToken) list.append(h("button", { class: "btn btn-small load-runs", type: "button", onclick: loadEarlierRuns }, "Show earlier runs"));
  const sequences = [...new Set([...p.steps.keys(), ...p.live.keys()])].sort((a, b) => a - b);
  // Runs in the order they started; runs with no step loaded yet still show.
  const order = [];
  for (const seq of sequences) {
    const runId = (p.steps.get(seq) || p.live.get(seq)).runId || "";
    if (!order.includes(runId)) order.push(runId);
  }
  const runsByTime = [...p.runs.values()].sort((a, b) => String(a.startTime).localeCompare(String(b.startTime)));
  for (const run of runsByTime) if (!order.includes(run.id) && run.status === "RUN_STATUS_RUNNING") order.push(run.id);
  for (const runId of order) ensureSection(runId);
  for (const seq of sequences) drawStep(seq);
  if (!sequences.length && !order.length) {
    list.append(h("p", { class: "muted empty-activity" }, "No runs yet. Send this agent a message (Chat) and watch it think here."));
  }
  list.scrollTop = list.scrollHeight;
}

/** A run not loaded: a note (a step a person added, in a run of its own), or one under way. */
function unknownRun(p, runId) {
  const steps = [...p.steps.values()].filter((step) => step.runId === runId);
  const live = [...p.live.values()].some((step) => step.runId === runId);
  if (!live && steps.length && steps.every((step) => step.role === "STEP_ROLE_SYSTEM" || step.role === "STEP_ROLE_USER")) {
    return { id: runId, status: "", note: true };
  }
  return { id: runId, status: runId ? "RUN_STATUS_RUNNING" : "" };
}

function ensureSection(runId) {
  const p = panel;
  let section = p.sections.get(runId);
  if (section) return section;
  const list = document.getElementById("agent-activity");
  const run = p.runs.get(runId) || unknownRun(p, runId);
  const head = renderRunHeader(run, runUsage(p, runId));
  const steps = h("div", { class: "run-steps" });
  const el = h("section", { class: "run", dataset: { runId } }, head, steps);
  list?.querySelector(".empty-activity")?.remove();
  list?.append(el);
  section = { el, head, steps };
  p.sections.set(runId, section);
  return section;
}

function drawStep(seq) {
  const p = panel;
  const live = p.live.get(seq);
  const step = live || p.steps.get(seq);
  if (!step) return;
  const el = renderStep(step, {
    live: Boolean(live),
    reasoningOpen: p.reasoningOpen.get(seq),
    onToggleReasoning: (open) => p.reasoningOpen.set(seq, open),
    actions: live ? null : stepActions(p.host, step),
  });
  const existing = p.stepEls.get(seq);
  if (existing) {
    existing.replaceWith(el);
  } else {
    const section = ensureSection(step.runId || "");
    // Keep sequence order inside a run even if a step arrives late.
    const after = [...section.steps.children].find((child) => Number(child.dataset.sequence) > seq);
    section.steps.insertBefore(el, after || null);
  }
  p.stepEls.set(seq, el);
  if (!live) redrawRunHead(p, step.runId || "");
}

/** The tokens of a run's stored steps (input and output), and whether any count is estimated. */
function runUsage(p, runId) {
  const usage = { input: 0, output: 0, estimated: false };
  for (const step of p.steps.values()) {
    if ((step.runId || "") !== runId || !step.metrics) continue;
    usage.input += Number(step.metrics.inputTokens || 0);
    usage.output += Number(step.metrics.outputTokens || 0);
    usage.estimated ||= Boolean(step.metrics.usageEstimated);
  }
  return usage;
}

function redrawRunHead(p, runId) {
  const section = p.sections.get(runId);
  const run = p.runs.get(runId);
  if (!section || !run) return;
  section.head.replaceWith((section.head = renderRunHeader(run, runUsage(p, runId))));
}

// -- settings ------------------------------------------------------------------

/** The agent form's fields; `read()` gives the Agent fields as proto3 JSON. */
function agentFields(ctx, values = {}, { parentChoice = true, excludeId = "" } = {}) {
  const name = h("input", { value: values.name || "", maxlength: 100, placeholder: "e.g. helper", testid: "agent-name" });
  const role = h("input", { value: values.role || "", maxlength: 100, placeholder: "e.g. assistant, writer, reviewer", testid: "agent-role" });
  const prompt = h("textarea", { rows: 5, placeholder: "Who the agent is and how it should work.", testid: "agent-prompt" });
  prompt.value = values.systemPrompt || "";
  const model = values.model || {};
  const modelName = h("input", { value: model.model || "", placeholder: "the runtime's default", testid: "agent-model" });
  const baseUrl = h("input", { value: model.baseUrl || "", placeholder: "the runtime's default endpoint", testid: "agent-base-url" });
  const temperature = h("input", { type: "number", step: "0.1", min: "0", max: "2", value: model.temperature ?? "", placeholder: "default", testid: "agent-temperature" });
  const maxTokens = h("input", { type: "number", step: "1", min: "1", value: model.maxTokens ?? "", placeholder: "default", testid: "agent-max-tokens" });
  const budget = h("input", { type: "number", step: "1", min: "0", value: Number(values.tokenBudget) ? values.tokenBudget : "", placeholder: "the runtime's default", testid: "agent-budget" });
  const tools = h("div", { class: "tool-list", testid: "agent-tools" }, h("span", { class: "muted small" }, "Loading the tools…"));
  let toolsShown = false;
  builtInTools(ctx)
    .then((offered) => {
      // None chosen means every one.
      const chosen = new Set(values.tools && values.tools.length ? values.tools : offered.map((t) => t.name));
      setChildren(
        tools,
        offered.map((tool) =>
          h(
            "label",
            { class: "tool-option" },
            h("input", { type: "checkbox", value: tool.name, checked: chosen.has(tool.name), testid: `agent-tool-${tool.name}` }),
            h("code", {}, tool.name),
            tool.description ? h("span", { class: "muted small" }, ` — ${tool.description}`) : null,
          ),
        ),
      );
      toolsShown = true;
    })
    .catch((err) => setChildren(tools, h("span", { class: "form-error", testid: "agent-tools-error" }, `Could not load the tools: ${err.message}. The agent keeps the tools it has.`)));
  const agents = [...ctx.state.agents.values()].filter((a) => a.id !== excludeId);
  const parent = h(
    "select",
    { testid: "agent-parent" },
    h("option", { value: "" }, "none (top level)"),
    agents.map((a) => h("option", { value: a.id, selected: a.id === values.parentId }, `${a.name}${a.role ? ` (${a.role})` : ""}`)),
  );
  const element = h(
    "div",
    { class: "agent-form" },
    h("div", { class: "field-row" }, field("Name", name), field("Role", role)),
    field("System prompt", prompt),
    h("div", { class: "field-row" }, field("Model", modelName), field("Endpoint (base URL)", baseUrl)),
    h("div", { class: "field-row" }, field("Temperature", temperature), field("Max tokens", maxTokens), field("Token budget", budget)),
    h("div", { class: "field-label" }, "Tools ", h("span", { class: "muted small" }, "(none ticked = every built-in tool)")),
    tools,
    parentChoice ? field("Reports to", parent, "Its parent in the organisation tree.") : null,
  );
  const read = () => {
    if (!name.value.trim()) throw new Error("Give the agent a name.");
    const modelSettings = { model: modelName.value.trim(), baseUrl: baseUrl.value.trim() };
    if (temperature.value !== "") modelSettings.temperature = Number(temperature.value);
    if (maxTokens.value !== "") modelSettings.maxTokens = Number(maxTokens.value);
    return {
      name: name.value.trim(),
      role: role.value.trim(),
      systemPrompt: prompt.value,
      model: modelSettings,
      // Until the list is shown, what the agent has (none: every tool) stays.
      tools: toolsShown ? [...tools.querySelectorAll("input:checked")].map((i) => i.value) : values.tools || [],
      tokenBudget: budget.value === "" ? "0" : String(Math.max(0, Math.floor(Number(budget.value)))),
      parentId: parent.value,
    };
  };
  return { element, read };
}

/** The "Create an agent" dialog. */
export function showCreateAgent(ctx, { parentId = "" } = {}) {
  const form = agentFields(ctx, { parentId });
  modal("Create an agent", h("div", {}, h("p", { class: "muted small" }, "The agent joins the workspace as a member: chat with it directly or add it to groups. It answers direct messages and @mentions."), form.element), {
    submitLabel: "Create agent",
    testid: "agent-dialog",
    wide: true,
    onSubmit: async () => {
      const values = form.read();
      const response = await ctx.api("POST", "/v1/agents", { body: { ...values, workspaceId: ctx.state.workspace.id, requestId: crypto.randomUUID ? crypto.randomUUID() : "" } });
      const agent = response.agent;
      ctx.upsertAgent(agent);
      toast(`${agent.name} is ready: chat with it from its panel.`);
      openAgentPanel(ctx, agent.id);
    },
  });
}

function settingsView() {
  const { ctx, agent } = panel;
  const form = agentFields(ctx, agent, { parentChoice: false });
  const error = h("div", { class: "form-error", role: "alert", hidden: true });
  const save = async (event) => {
    event.preventDefault();
    error.hidden = true;
    try {
      const values = form.read();
      delete values.parentId;
      const response = await ctx.api("PATCH", `/v1/agents/${agent.id}`, {
        body: { agent: { id: agent.id, ...values }, updateMask: "name,role,systemPrompt,model,tools,tokenBudget" },
      });
      applyAgent(panel, response.agent);
      toast("Settings saved.");
    } catch (err) {
      error.textContent = err.message;
      error.hidden = false;
    }
  };
  const remove = () => {
    modal("Delete agent", h("p", {}, `Delete ${agent.name}? Its runner stops; its steps and messages are kept.`), {
      submitLabel: "Delete",
      testid: "delete-agent",
      onSubmit: async () => {
        await ctx.api("DELETE", `/v1/agents/${agent.id}`);
        ctx.removeAgent(agent.id);
        closeAgentPanel();
        toast(`${agent.name} was deleted.`);
      },
    });
  };
  return h(
    "form",
    { class: "settings", testid: "agent-settings", onsubmit: save },
    h("p", { class: "muted small" }, `Agent id ${agent.id} · member id ${agent.memberId}`),
    form.element,
    error,
    h("div", { class: "settings-actions" }, h("button", { class: "btn btn-primary", type: "submit", testid: "agent-settings-save" }, "Save settings"), h("button", { class: "btn btn-danger", type: "button", onclick: remove }, "Delete agent")),
  );
}

// -- organisation ---------------------------------------------------------------

function organisationView() {
  const { ctx, agent } = panel;
  const open = (id) => openAgentPanel(ctx, id, { tab: "organisation" });
  const parent = agent.parentId ? ctx.state.agents.get(agent.parentId) : null;
  const children = h("div", { class: "org-children", testid: "agent-children" }, h("p", { class: "muted" }, "Loading…"));
  const mine = panel;
  listAll("/v1/agents", "agents", { query: { parent_id: agent.id } })
    .then((list) => {
      if (panel !== mine) return;
      setChildren(
        children,
        list.length
          ? list.map((child) => h("button", { class: "tree-node", type: "button", testid: "agent-child", onclick: () => open(child.id) }, ctx.stateDot(child), child.name, child.role ? h("span", { class: "muted small" }, ` · ${child.role}`) : null))
          : h("p", { class: "muted" }, "No sub-agents."),
      );
    })
    .catch((err) => setChildren(children, h("p", { class: "form-error" }, err.message)));
  return h(
    "div",
    { class: "organisation", testid: "agent-organisation" },
    h("div", { class: "list-title" }, "Reports to"),
    parent
      ? h("button", { class: "tree-node", type: "button", testid: "agent-parent-link", onclick: () => open(parent.id) }, ctx.stateDot(parent), parent.name)
      : h("p", { class: "muted" }, agent.parentId ? "an agent that no longer exists" : "nobody: a top-level agent"),
    h("div", { class: "list-title" }, "Sub-agents"),
    children,
    h("button", { class: "btn btn-small", type: "button", onclick: () => showCreateAgent(ctx, { parentId: agent.id }) }, "Create a sub-agent"),
    h("div", { class: "list-title" }, "Whole organisation"),
    h("div", { class: "tree-box" }, ctx.agentTree([...ctx.state.agents.values()], { currentId: agent.id, onPick: open })),
  );
}
