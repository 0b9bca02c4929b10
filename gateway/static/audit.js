// The audit log, for a workspace's owner and admins: the IM's records
// (sign-ins, tokens, invites, roles, members) and the runtime's (agents),
// merged newest first, a page at a time ("Load more").

import { api } from "./api.js";
import { h, longTime, setChildren, shortTime } from "./dom.js";
import { modal, showError } from "./ui.js";

const PAGE = 30;
const SOURCES = [
  ["im", "/v1/audit-events"],
  ["runtime", "/v1/agent-audit-events"],
];

/** "SetMemberRole" -> "Set member role". */
export function actionLabel(action) {
  const words = (action || "").replace(/([a-z])([A-Z])/g, "$1 $2").toLowerCase();
  return words.charAt(0).toUpperCase() + words.slice(1);
}

/**
 * Records of several sources merged by time: each source is read a page at
 * a time, and a record is shown only once every source that may still have
 * a newer one has been read that far.
 */
export class MergedLog {
  constructor(fetchPage, sources) {
    this.fetchPage = fetchPage;
    this.sources = sources.map((name) => ({ name, buffer: [], token: "", done: false }));
  }

  get exhausted() {
    return this.sources.every((s) => s.done && !s.buffer.length);
  }

  async next(count) {
    const out = [];
    while (out.length < count) {
      for (const source of this.sources) {
        if (!source.buffer.length && !source.done) {
          const page = await this.fetchPage(source.name, source.token);
          source.buffer.push(...page.events);
          source.token = page.nextPageToken || "";
          source.done = !source.token;
        }
      }
      const heads = this.sources.filter((s) => s.buffer.length);
      if (!heads.length) break;
      const newest = heads.reduce((a, b) => (key(b.buffer[0]) > key(a.buffer[0]) ? b : a));
      out.push(newest.buffer.shift());
    }
    return out;
  }
}

function key(event) {
  return `${event.time || ""} ${event.id || ""}`;
}

export function showAuditLog(ctx) {
  const list = h("ul", { class: "audit-list", testid: "audit-list" });
  const outcome = h(
    "select",
    { testid: "audit-outcome", "aria-label": "Outcome", onchange: () => restart() },
    h("option", { value: "" }, "Every outcome"),
    h("option", { value: "AUDIT_OUTCOME_FILTER_OK" }, "Succeeded"),
    h("option", { value: "AUDIT_OUTCOME_FILTER_REFUSED" }, "Refused or failed"),
  );
  const more = h("button", { class: "btn", type: "button", testid: "audit-more", onclick: () => load() }, "Load more");
  const status = h("p", { class: "muted small", testid: "audit-status" });
  let log = null;

  const fetchPage = async (source, token) => {
    const path = Object.fromEntries(SOURCES)[source];
    const query = { page_size: PAGE, page_token: token };
    if (outcome.value) query["query.outcome"] = outcome.value;
    const page = await api("GET", path, { member: "", query });
    return { events: (page.auditEvents || []).map((e) => ({ ...e, service: e.service || source })), nextPageToken: page.nextPageToken };
  };

  const load = async () => {
    more.disabled = true;
    try {
      const events = await log.next(PAGE);
      list.append(...events.map((e) => row(ctx, e)));
      if (!list.children.length) status.textContent = "Nothing recorded yet.";
      else status.textContent = log.exhausted ? "That is everything." : "";
      more.hidden = log.exhausted;
    } catch (err) {
      showError(err, "Could not read the audit log");
    } finally {
      more.disabled = false;
    }
  };

  const restart = () => {
    log = new MergedLog(fetchPage, SOURCES.map(([name]) => name));
    setChildren(list);
    status.textContent = "";
    load();
  };

  const body = h(
    "div",
    { class: "audit", testid: "audit-log" },
    h("p", { class: "muted small" }, "Privileged actions in this workspace: sign-ins, tokens, invites, roles, and everything done to agents. Refusals are counted together."),
    h("div", { class: "audit-filters" }, outcome),
    list,
    status,
    more,
  );
  modal("Audit log", body, { testid: "audit", wide: true });
  restart();
}

function row(ctx, event) {
  const outcome = event.outcome || {};
  const ok = outcome.code === "OK";
  const count = Number(event.count || 1);
  const details = Object.entries(event.details || {})
    .map(([k, v]) => `${k.replace(/_id$/, "").replace(/_/g, " ")}: ${k.endsWith("_id") ? idName(ctx, v) : v}`)
    .join(" · ");
  return h(
    "li",
    { class: `audit-item${ok ? "" : " refused"}`, testid: "audit-item", dataset: { action: event.action, outcome: outcome.code || "", service: event.service || "", time: event.time || "" } },
    h(
      "div",
      { class: "audit-line" },
      h("span", { class: "audit-time", title: longTime(event.time) }, shortTime(event.time)),
      h("span", { class: "audit-action" }, actionLabel(event.action)),
      h("span", { class: `audit-outcome${ok ? "" : " bad"}`, testid: "audit-outcome-code" }, ok ? "ok" : outcome.code.toLowerCase().replace(/_/g, " ")),
      count > 1 ? h("span", { class: "audit-count", title: `last ${longTime(event.lastTime)}` }, `×${count}`) : null,
      h("span", { class: "audit-source" }, event.service === "runtime" ? "agents" : "IM"),
    ),
    h("div", { class: "audit-who" }, `${actorName(ctx, event.actor || {})} → ${targetName(ctx, event.target || {})}`),
    !ok && outcome.reason ? h("div", { class: "audit-reason" }, outcome.reason) : null,
    details ? h("div", { class: "audit-details muted small" }, details) : null,
  );
}

/** A member's or an agent's name for an id, if this page knows it. */
function idName(ctx, id) {
  const member = ctx.state.members.get(id);
  if (member) return member.displayName;
  const agent = ctx.state.agents.get(id);
  return agent ? agent.name : id;
}

function memberName(ctx, id) {
  const member = ctx.state.members.get(id);
  return member ? member.displayName : `member ${id.slice(0, 8)}…`;
}

function actorName(ctx, actor) {
  if (actor.memberId) return memberName(ctx, actor.memberId);
  if (actor.service) return `the ${actor.service} service`;
  return "someone not signed in";
}

function targetName(ctx, target) {
  const id = target.id || "";
  if (!id) return target.kind || "—";
  if (target.kind === "member") return memberName(ctx, id);
  if (target.kind === "agent") {
    const agent = ctx.state.agents.get(id);
    return agent ? `agent ${agent.name}` : `agent ${id.slice(0, 8)}…`;
  }
  if (target.kind === "login") return `login ${id}`;
  return `${target.kind.replace(/_/g, " ")} ${id.slice(0, 8)}…`;
}
