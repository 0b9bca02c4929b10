// Agent IM web UI: a WeChat-style messenger over the gateway's HTTP API.
//
// A person signs in (the session is an HttpOnly cookie); the view is theirs,
// or that of an agent of theirs; everything shown is what that member sees. State lives in
// `state`; each view is re-drawn from it by a render function.

import { api, ApiError, listAll, LiveStream, onUnauthorized, setActingMember, setCsrfToken } from "./api.js";
import { avatar, clear, h, icon, longTime, parseTime, setChildren, shortTime, snippet } from "./dom.js";
import { renderMarkdown, safeHref } from "./markdown.js";
import { field, isNarrow, modal, showError, streamStatus, toast } from "./ui.js";
import { closeAgentPanel, currentPanelAgent, openAgentAtStep, openAgentPanel, showCreateAgent, updateAgentInPanel } from "./agent.js";
import { workspaceMemoryView } from "./memory.js";
import { showAuditLog } from "./audit.js";
import { STATE_LABELS, mergeAgent } from "./control.js";

const IDENTITY_KEY = "agentim.identity";
const KNOWN_KEY = "agentim.known";
const PAGE = 40;
const IM_EVENTS = ["message_created", "message_edited", "group_changed", "read_updated"];

const HUMAN = "MEMBER_KIND_HUMAN";
const AGENT = "MEMBER_KIND_AGENT";
const DIRECT = "GROUP_KIND_DIRECT";

const state = {
  // The signed-in person (GET /v1/auth/session), whoever the view is of.
  person: null,
  me: null,
  workspace: null,
  members: new Map(),
  agents: new Map(),
  chats: new Map(),
  tab: "chats",
  chat: null, // the open conversation (see openChat)
  // What a phone shows, one column at a time: the list (chats, contacts,
  // agents, memory) or the open chat. A wide screen shows both.
  pane: "list",
  imStream: null,
  agentStream: null,
};

const root = () => document.getElementById("root");

// -- helpers -----------------------------------------------------------------

function uuid4() {
  if (crypto.randomUUID) return crypto.randomUUID();
  const b = crypto.getRandomValues(new Uint8Array(16));
  b[6] = (b[6] & 0x0f) | 0x40;
  b[8] = (b[8] & 0x3f) | 0x80;
  const hex = [...b].map((x) => x.toString(16).padStart(2, "0")).join("");
  return `${hex.slice(0, 8)}-${hex.slice(8, 12)}-${hex.slice(12, 16)}-${hex.slice(16, 20)}-${hex.slice(20)}`;
}

function memberName(id) {
  const member = state.members.get(id);
  return member ? member.displayName : "unknown member";
}

function agentOfMember(memberId) {
  for (const agent of state.agents.values()) if (agent.memberId === memberId) return agent;
  return null;
}

function isAgentMe() {
  return state.me && state.me.kind === AGENT;
}

function peerOf(group) {
  if (group.kind !== DIRECT) return null;
  return (group.memberIds || []).find((id) => id !== state.me.id) || state.me.id;
}

function chatTitle(group) {
  if (group.kind === DIRECT) return memberName(peerOf(group));
  return group.name || "Group";
}

function chatAvatar(group, size = "") {
  if (group.kind === DIRECT) {
    const peer = state.members.get(peerOf(group));
    return avatar(chatTitle(group), { avatarText: peer?.avatar, kind: peer?.kind, size, seed: peer?.id });
  }
  const el = avatar(chatTitle(group), { size, seed: group.id });
  el.classList.add("avatar-group");
  return el;
}

function sortedChats() {
  const time = (chat) => parseTime(chat.lastActivityTime)?.getTime() || 0;
  return [...state.chats.values()].sort((a, b) => time(b) - time(a));
}

function preview(message) {
  if (!message) return "";
  const who = message.senderId === state.me.id ? "You" : memberName(message.senderId);
  const kinds = {
    CONTENT_TYPE_CODE: "[code]",
    CONTENT_TYPE_IMAGE: "[image]",
    CONTENT_TYPE_FILE: "[file]",
    CONTENT_TYPE_TASK: "[task]",
  };
  const prefix = kinds[message.contentType] ? `${kinds[message.contentType]} ` : "";
  const text = `${prefix}${snippet(message.content, 60)}`;
  return message.contentType === "CONTENT_TYPE_SYSTEM" ? text : `${who}: ${text}`;
}

function remember() {
  localStorage.setItem(IDENTITY_KEY, JSON.stringify({ memberId: state.me.id, personId: state.person?.id, workspaceId: state.workspace.id }));
  const known = loadKnown().filter((k) => k.workspaceId !== state.workspace.id);
  known.unshift({ workspaceId: state.workspace.id, workspaceName: state.workspace.name });
  localStorage.setItem(KNOWN_KEY, JSON.stringify(known.slice(0, 20)));
}

function loadKnown() {
  try {
    const known = JSON.parse(localStorage.getItem(KNOWN_KEY) || "[]");
    return Array.isArray(known) ? known : [];
  } catch {
    return [];
  }
}

function loadIdentity() {
  try {
    return JSON.parse(localStorage.getItem(IDENTITY_KEY) || "null");
  } catch {
    return null;
  }
}

// -- signing in with the organisation's OpenID Connect provider -------------------

let signInOptions = null;

/** How people may sign in here (GET /v1/auth/options), asked once. */
function loadSignInOptions() {
  signInOptions ??= api("GET", "/v1/auth/options", { member: "" }).catch(() => ({ oidc: false }));
  return signInOptions;
}

/** Sends the browser to the provider through the gateway (which keeps the flow's secrets). */
function goToProvider(query) {
  const params = new URLSearchParams(Object.entries(query).filter(([, value]) => value));
  const search = params.toString();
  window.location.assign(`/v1/auth/oidc/start${search ? `?${search}` : ""}`);
}

/** A button that goes to the provider, shown only when one is configured. */
function providerButton(label, testid, query) {
  const button = h("button", { class: "btn btn-org", type: "button", hidden: true, testid, onclick: () => goToProvider(query()) }, icon("key", 16), label);
  loadSignInOptions().then((options) => (button.hidden = !options.oidc));
  return button;
}

/**
 * What the gateway's callback said, from the URL's fragment (which no
 * request carries): an error and its status, a linked email, the invite
 * being accepted. The fragment is cleared but for the invite.
 */
function takeSignInResult() {
  const params = new URLSearchParams(window.location.hash.slice(1));
  const result = {
    error: params.get("signin_error") || "",
    status: params.get("signin_status") || "",
    linked: params.get("linked") || "",
    invite: params.get("invite") || "",
  };
  if (result.error || result.linked) {
    const keep = result.invite ? `#invite=${encodeURIComponent(result.invite)}` : "";
    history.replaceState(null, "", window.location.pathname + keep);
  }
  return result;
}

// -- the start screen ----------------------------------------------------------

/**
 * The sign-in page. `askWorkspace`: the login or email is in several
 * workspaces, so the workspace field is shown (it is hidden otherwise).
 */
function showStart(errorMessage = "", { askWorkspace = false } = {}) {
  stopStreams();
  closeAgentPanel();
  state.me = null;
  state.person = null;
  state.chat = null;
  setCsrfToken("");
  document.title = "Agent IM";
  const error = h("div", { class: "form-error", role: "alert", testid: "start-error", hidden: !errorMessage }, errorMessage);
  const fail = (err) => {
    error.textContent = err.message || String(err);
    error.hidden = false;
  };
  const password = (testid) => h("input", { type: "password", required: true, minlength: 8, autocomplete: "current-password", testid });
  const login = (testid) => h("input", { required: true, autocomplete: "username", maxlength: 64, testid });
  const or = () => h("div", { class: "or", hidden: true }, h("span", {}, "or"));

  const invite = new URLSearchParams(window.location.hash.slice(1)).get("invite");
  let section;
  if (invite) {
    const name = h("input", { required: true, maxlength: 100, testid: "invite-name" });
    const user = login("invite-login");
    const secret = password("invite-password");
    secret.autocomplete = "new-password";
    const separator = or();
    const orgJoin = providerButton("Join with your organisation", "invite-oidc", () => ({ invite, name: name.value.trim() }));
    loadSignInOptions().then((options) => (separator.hidden = !options.oidc));
    section = h(
      "form",
      {
        class: "start-section",
        testid: "invite-form",
        onsubmit: async (event) => {
          event.preventDefault();
          try {
            await api("POST", "/v1/auth/accept-invite", {
              member: "",
              body: { invite, displayName: name.value.trim(), login: user.value.trim(), password: secret.value, requestId: uuid4() },
            });
            history.replaceState(null, "", window.location.pathname);
            await startSession();
          } catch (err) {
            fail(err);
          }
        },
      },
      h("h2", {}, "Join the workspace"),
      h("p", { class: "muted" }, "You were invited. Choose your name, a login and a password."),
      field("Your name", name),
      field("Login", user),
      field("Password", secret),
      h("button", { class: "btn btn-primary", type: "submit", testid: "invite-submit" }, "Join"),
      separator,
      orgJoin,
    );
  } else {
    const known = loadKnown();
    // Asked for only when the login (or email) is in several workspaces; the last one used here is offered.
    const workspace = h("input", { placeholder: "workspace id", value: known[0]?.workspaceId || "", testid: "signin-workspace" });
    const hint = known.length ? `Used in this browser: ${known.map((k) => `${k.workspaceName} (${k.workspaceId})`).join(", ")}` : "";
    const workspaceField = field("Workspace", workspace, hint);
    workspaceField.dataset.testid = "signin-workspace-field";
    const askForWorkspace = () => {
      workspaceField.hidden = false;
      workspace.required = true;
    };
    workspaceField.hidden = true;
    if (askWorkspace) askForWorkspace();
    const chosenWorkspace = () => (workspaceField.hidden ? "" : workspace.value.trim());
    const user = login("signin-login");
    const secret = password("signin-password");
    const separator = or();
    loadSignInOptions().then((options) => (separator.hidden = !options.oidc));
    const oidc = providerButton("Sign in with your organisation", "signin-oidc", () => ({ workspace: chosenWorkspace() }));
    const signIn = h(
      "form",
      {
        class: "start-section",
        testid: "signin-form",
        onsubmit: async (event) => {
          event.preventDefault();
          try {
            const chosen = chosenWorkspace();
            await api("POST", "/v1/auth/sign-in", {
              member: "",
              body: { ...(chosen ? { workspaceId: chosen } : {}), login: user.value.trim(), password: secret.value },
            });
            await startSession();
          } catch (err) {
            fail(err);
            // The login is in several workspaces: which one, the person says.
            if (err instanceof ApiError && err.status === "FAILED_PRECONDITION") {
              askForWorkspace();
              workspace.focus();
            }
          }
        },
      },
      h("h2", {}, "Sign in"),
      workspaceField,
      field("Login", user),
      field("Password", secret),
      h("button", { class: "btn btn-primary", type: "submit", testid: "signin-submit" }, "Sign in"),
      separator,
      oidc,
    );

    const wsName = h("input", { required: true, placeholder: "e.g. Acme", testid: "create-workspace-name", maxlength: 100 });
    const creator = h("input", { required: true, placeholder: "e.g. Ada", testid: "create-workspace-creator", maxlength: 100 });
    const creatorLogin = login("create-workspace-login");
    const creatorPassword = password("create-workspace-password");
    creatorPassword.autocomplete = "new-password";
    const create = h(
      "form",
      {
        class: "start-section",
        onsubmit: async (event) => {
          event.preventDefault();
          if (!wsName.value.trim() || !creator.value.trim()) return fail(new Error("Give the workspace and yourself a name."));
          try {
            await api("POST", "/v1/workspaces", {
              member: "",
              body: {
                name: wsName.value.trim(),
                creatorDisplayName: creator.value.trim(),
                creatorKind: HUMAN,
                creatorLogin: creatorLogin.value.trim(),
                creatorPassword: creatorPassword.value,
                requestId: uuid4(),
              },
            });
            await startSession();
          } catch (err) {
            fail(err);
          }
        },
      },
      h("h2", {}, "Create a workspace"),
      h("p", { class: "muted" }, "You become its owner and can then invite people and create agents."),
      field("Workspace name", wsName),
      field("Your name", creator),
      field("Login", creatorLogin),
      field("Password", creatorPassword, "At least 10 characters."),
      h("button", { class: "btn btn-primary", type: "submit", testid: "create-workspace-submit" }, "Create and sign in"),
    );
    // A browser that signed in before, or whose sign-in was just refused, wants to sign in.
    const signInFirst = known.length || errorMessage;
    section = [signInFirst ? signIn : create, signInFirst ? create : signIn];
  }

  setChildren(
    root(),
    h(
      "div",
      { class: "start", testid: "start" },
      h(
        "div",
        { class: "start-card" },
        h("div", { class: "brand" }, h("span", { class: "brand-mark" }, icon("chat", 30)), h("h1", {}, "Agent IM")),
        h("p", { class: "tagline" }, "A messenger where people and AI agents are equal members."),
        error,
        section,
      ),
    ),
  );
}

/** Reads the session (who is signed in, its CSRF token) and enters the person's own view. */
async function startSession() {
  const session = await api("GET", "/v1/auth/session", { member: "" });
  setCsrfToken(session.csrfToken);
  state.person = session.member;
  const last = loadIdentity();
  // Back to the view used last (the person's, or an agent's) when it was this person's.
  const view = last && last.personId === session.member.id && last.memberId ? last.memberId : session.member.id;
  try {
    await enterAs(view);
  } catch (err) {
    if (view === session.member.id) throw err;
    await enterAs(session.member.id);
  }
}

const ROLE_LABELS = { MEMBER_ROLE_OWNER: "owner", MEMBER_ROLE_ADMIN: "admin", MEMBER_ROLE_MEMBER: "member" };

function isAdmin() {
  return ["MEMBER_ROLE_OWNER", "MEMBER_ROLE_ADMIN"].includes(state.person?.role);
}

// -- entering as a member ------------------------------------------------------

async function enterAs(memberId) {
  // It travels in a header: printable ASCII only (the browser would not send
  // most else, and the gateway refuses the rest as if a token were missing).
  if (!/^[\x21-\x7e]+$/.test(memberId)) throw new Error(`“${memberId}” is not a member id (ids look like 01a2b3c4-…).`);
  const previous = state.me ? state.me.id : "";
  setActingMember(memberId);
  let me;
  let workspace;
  try {
    me = (await api("GET", `/v1/members/${memberId}`)).member;
    workspace = (await api("GET", `/v1/workspaces/${me.workspaceId}`)).workspace;
  } catch (err) {
    setActingMember(previous); // still acting as before
    throw err;
  }
  stopStreams();
  state.me = me;
  state.workspace = workspace;
  state.chat = null;
  workspaceMemory = null; // another person finds other things
  remember();
  try {
    await Promise.all([loadMembers(), loadAgents(), loadChats()]);
  } catch (err) {
    showStart(`Could not load ${me.displayName}'s chats: ${err.message}`);
    return;
  }
  renderShell();
  startImStream();
  startAgentStream();
  const panelAgent = currentPanelAgent();
  if (panelAgent && state.agents.has(panelAgent)) openAgentPanel(appContext, panelAgent);
}

async function switchPerspective(memberId) {
  if (!memberId || memberId === state.me?.id) return;
  try {
    await enterAs(memberId);
    const who = state.me;
    toast(`Now seeing the IM as ${who.displayName}${who.kind === AGENT ? " (agent)" : ""}.`);
  } catch (err) {
    showError(err, "Could not switch");
    renderPerspective();
  }
}

async function loadMembers() {
  const members = await listAll(`/v1/workspaces/${state.workspace.id}/members`, "members");
  state.members = new Map(members.map((m) => [m.id, m]));
}

async function loadAgents() {
  try {
    const agents = await listAll("/v1/agents", "agents");
    // A state the live events brought meanwhile may be newer than the list's.
    state.agents = new Map(agents.map((a) => [a.id, mergeAgent(state.agents.get(a.id), a)]));
  } catch (err) {
    state.agents = new Map();
    showError(err, "Agents are unavailable");
  }
}

async function loadChats() {
  const chats = await listAll("/v1/chats", "chats", { pageSize: 200, maxPages: 5 });
  state.chats = new Map(chats.map((c) => [c.group.id, c]));
}

async function refreshChats() {
  try {
    await loadChats();
    renderSidebar();
  } catch (err) {
    showError(err, "Could not load chats");
  }
}

async function refreshMembers() {
  try {
    await loadMembers();
    renderPerspective();
    renderSidebar();
  } catch (err) {
    showError(err, "Could not load members");
  }
}

async function refreshAgents() {
  await loadAgents();
  renderSidebar();
}

async function signOut() {
  try {
    await api("POST", "/v1/auth/sign-out", { member: "" });
  } catch (err) {
    showError(err, "Could not sign out");
    return;
  }
  localStorage.removeItem(IDENTITY_KEY);
  showStart();
}

// -- live events ---------------------------------------------------------------

function stopStreams() {
  state.imStream?.close();
  state.imStream = null;
  state.agentStream?.close();
  state.agentStream = null;
}

/** What a stream does when the gateway reports an error or refuses it: say why, once. */
function streamTrouble(name) {
  let shown = "";
  return {
    onServerError: (error) => {
      if (error.message !== shown) showError(error, `Live updates (${name})`);
      shown = error.message;
    },
    onRefused: () => {
      if (!state.me) return;
      // An ordinary call tells why (and asks for a token on 401).
      api("GET", `/v1/members/${state.me.id}`).catch((error) => {
        if (error.message !== shown) showError(error, `Live updates (${name})`);
        shown = error.message;
      });
    },
  };
}

function startImStream() {
  state.imStream = new LiveStream("/v1/events", {
    kinds: IM_EVENTS,
    resumeParam: "after_cursor",
    ...streamTrouble("messages"),
    onEvent: (_kind, data) => onImEvent(data),
    onStatus: (status, reconnected) => {
      streamStatus("messages", status === "reconnecting" ? "down" : status);
      if (status === "open" && reconnected) catchUp();
    },
  });
}

function startAgentStream() {
  // Agent states for the organisation tree and chat headers.
  state.agentStream = new LiveStream("/v1/agent-events", {
    kinds: ["state_changed"],
    ...streamTrouble("agents"),
    onEvent: (_kind, data) => {
      const event = data.event || {};
      const agent = state.agents.get(event.agentId);
      if (!agent) return;
      if (event.stateChanged) {
        const changed = event.stateChanged;
        const updated = mergeAgent(agent, { state: changed.state, lastError: changed.error || "", pausePending: Boolean(changed.pausePending), stateVersion: changed.stateVersion });
        state.agents.set(agent.id, updated);
        renderAgentState(updated);
      }
    },
    onStatus: (status) => streamStatus("agents", status === "reconnecting" ? "down" : status),
  });
}

/** After a reconnect: the chat list and the open chat may have missed events. */
async function catchUp() {
  await refreshChats();
  const chat = state.chat;
  if (!chat || !chat.messages.length) return;
  try {
    const last = chat.messages[chat.messages.length - 1].id;
    const page = await api("GET", `/v1/groups/${chat.group.id}/messages`, { query: { after_message_id: last, page_size: 200 } });
    for (const m of page.messages || []) addMessage(m);
  } catch (err) {
    showError(err);
  }
}

function onImEvent(data) {
  if (data.messageCreated) onMessage(data.messageCreated.message);
  else if (data.messageEdited) onEdited(data.messageEdited.message);
  else if (data.groupChanged) onGroupChanged(data.groupChanged);
  else if (data.readUpdated) onReadUpdated(data.readUpdated.readState);
}

function onMessage(message) {
  if (!state.members.has(message.senderId)) refreshMembers();
  const chat = state.chats.get(message.groupId);
  if (!chat) {
    refreshChats();
    return;
  }
  const newer = !chat.lastMessage || chat.lastMessage.id <= message.id;
  if (newer) {
    chat.lastMessage = message;
    chat.lastActivityTime = message.sendTime;
  }
  const mine = message.senderId === state.me.id;
  if (state.chat && state.chat.group.id === message.groupId) {
    addMessage(message);
    if (!mine) {
      if (canMarkRead()) markRead(chat, message.id);
      else if (isAgentMe()) chat.unreadCount = String(Number(chat.unreadCount || 0) + 1);
    }
  } else if (!mine && newer) {
    chat.unreadCount = String(Number(chat.unreadCount || 0) + 1);
  }
  renderSidebar();
}

function onEdited(message) {
  const chat = state.chats.get(message.groupId);
  if (chat?.lastMessage?.id === message.id) chat.lastMessage = message;
  if (state.chat && state.chat.group.id === message.groupId) {
    const index = state.chat.messages.findIndex((m) => m.id === message.id);
    if (index >= 0) {
      state.chat.messages[index] = message;
      renderMessages({ keep: true });
    }
  }
  renderSidebar();
}

function onGroupChanged(change) {
  const group = change.group;
  const removedMe = (change.removedMemberIds || []).includes(state.me.id) || !(group.memberIds || []).includes(state.me.id);
  if (removedMe) {
    state.chats.delete(group.id);
    if (state.chat && state.chat.group.id === group.id) {
      toast(`You are no longer a member of ${chatTitle(group)}.`);
      state.chat = null;
      renderConversation();
    }
    renderSidebar();
    return;
  }
  if ((group.memberIds || []).some((id) => !state.members.has(id))) refreshMembers();
  const chat = state.chats.get(group.id);
  if (chat) chat.group = group;
  else state.chats.set(group.id, { group, lastMessage: null, unreadCount: "0", lastActivityTime: group.createTime });
  if (state.chat && state.chat.group.id === group.id) {
    state.chat.group = group;
    renderChatHead();
  }
  renderSidebar();
}

function onReadUpdated(readState) {
  if (readState.memberId !== state.me.id) return;
  const chat = state.chats.get(readState.groupId);
  if (!chat) return;
  chat.unreadCount = String(readState.unreadCount || "0");
  renderSidebar();
}

function canMarkRead() {
  // An agent's unread messages are its inbox: the runtime reads them. Looking
  // through an agent's eyes must not take them away, so only people mark read.
  // Nor does a chat a phone keeps behind the list count as read.
  return !isAgentMe() && document.visibilityState === "visible" && (state.pane === "chat" || !isNarrow());
}

async function markRead(chat, messageId) {
  if (!messageId || isAgentMe()) return;
  chat.unreadCount = "0";
  renderSidebar();
  try {
    await api("POST", `/v1/groups/${chat.group.id}:markRead`, { body: { upToMessageId: messageId } });
  } catch (err) {
    showError(err, "Could not mark the chat read");
  }
}

document.addEventListener("visibilitychange", () => {
  const chat = state.chat && state.chats.get(state.chat.group.id);
  if (chat && Number(chat.unreadCount) > 0 && canMarkRead() && state.chat.messages.length) {
    markRead(chat, state.chat.messages[state.chat.messages.length - 1].id);
  }
});

// -- the shell -----------------------------------------------------------------

function renderShell() {
  const shell = h(
    "div",
    { class: "shell", testid: "shell" },
    h("nav", { class: "rail", id: "rail" }),
    h("section", { class: "sidebar" }, h("div", { class: "side-head", id: "side-head" }), h("div", { class: "side-body", id: "side-body" })),
    h("section", { class: "conversation", id: "conversation" }),
    h("aside", { class: "agent-panel", id: "agent-panel", testid: "agent-panel", hidden: true }),
  );
  setChildren(root(), shell);
  showPane(state.chat ? state.pane : "list");
  renderRail();
  renderPerspective();
  renderSidebar();
  renderConversation();
}

/** Shows the list or the chat on a phone (a wide screen shows both; see style.css). */
function showPane(pane) {
  state.pane = pane === "chat" && state.chat ? "chat" : "list";
  const shell = document.querySelector(".shell");
  if (shell) shell.dataset.pane = state.pane;
}

/** Back to the list from a chat (the phone's back button): the chat closes, as on a phone messenger. */
function closeChat() {
  state.chat = null;
  showPane("list");
  renderConversation();
  renderSidebar();
}

function renderRail() {
  const rail = document.getElementById("rail");
  if (!rail) return;
  const tab = (name, iconName, label) =>
    h(
      "button",
      {
        class: `rail-tab${state.tab === name ? " active" : ""}`,
        type: "button",
        title: label,
        testid: `tab-${name}`,
        onclick: () => {
          state.tab = name;
          showPane("list");
          renderRail();
          renderSidebar();
        },
      },
      h("span", { class: "rail-icon", "aria-hidden": "true" }, icon(iconName)),
      h("span", { class: "rail-label" }, label),
      name === "chats" ? h("span", { class: "rail-badge", id: "rail-unread", hidden: true }) : null,
    );
  setChildren(
    rail,
    h(
      "button",
      { class: "rail-me", type: "button", title: "Your profile", testid: "profile-button", onclick: showProfile },
      avatar(state.me.displayName, { avatarText: state.me.avatar, kind: state.me.kind, seed: state.me.id }),
    ),
    tab("chats", "chat", "Chats"),
    tab("contacts", "contacts", "Contacts"),
    tab("agents", "agent", "Agents"),
    tab("memory", "search", "Memory"),
    h("div", { class: "rail-spacer" }),
    h("button", { class: "rail-tab", type: "button", title: "Your account: tokens, invites, roles", testid: "account-button", onclick: () => showAccount() }, h("span", { class: "rail-icon" }, icon("key")), h("span", { class: "rail-label" }, "Account")),
    h("button", { class: "rail-tab", type: "button", title: "Leave this workspace view", testid: "sign-out", onclick: signOut }, h("span", { class: "rail-icon" }, icon("exit")), h("span", { class: "rail-label" }, "Sign out")),
  );
  renderUnreadTotal();
}

function renderUnreadTotal() {
  const total = [...state.chats.values()].reduce((n, c) => n + Number(c.unreadCount || 0), 0);
  document.title = total ? `(${total}) Agent IM` : "Agent IM";
  const badge = document.getElementById("rail-unread");
  if (badge) {
    badge.hidden = !total;
    badge.textContent = total > 99 ? "99+" : String(total);
  }
}

function renderPerspective() {
  const head = document.getElementById("side-head");
  if (!head) return;
  const option = (m) => h("option", { value: m.id, selected: m.id === state.me.id }, m.displayName);
  const select = h(
    "select",
    { class: "perspective", testid: "perspective-select", title: "See the IM as yourself or as an agent of yours", onchange: () => switchPerspective(select.value) },
    h("optgroup", { label: "You" }, state.person ? option(state.person) : null),
    h("optgroup", { label: isAdmin() ? "Agents" : "Your agents" }, viewableAgents().map(option)),
  );
  // Redrawn while open (a member joined, an agent was made), the menu stays open.
  const wasOpen = head.querySelector('[data-testid="new-menu"]')?.hidden === false;
  const menu = h(
    "div",
    { class: "menu", hidden: !wasOpen, testid: "new-menu" },
    h("button", { type: "button", testid: "new-direct", onclick: () => (closeMenu(), showNewDirect()) }, icon("chat", 16), "New direct chat"),
    h("button", { type: "button", testid: "new-group", onclick: () => (closeMenu(), showNewGroup()) }, icon("group", 16), "New group chat"),
    h("button", { type: "button", testid: "new-agent", onclick: () => (closeMenu(), showCreateAgent(appContext)) }, icon("agent", 16), "Create an agent"),
    // People join by an invite link (they choose their own login and password).
    isAdmin() ? h("button", { type: "button", testid: "new-member", onclick: () => (closeMenu(), showAccount()) }, icon("person", 16), "Invite a person") : null,
  );
  const closeMenu = () => {
    menu.hidden = true;
  };
  const plus = h(
    "button",
    {
      class: "icon-btn plus",
      type: "button",
      title: "New chat, agent or person",
      testid: "new-menu-button",
      onclick: (event) => {
        event.stopPropagation();
        menu.hidden = !menu.hidden;
      },
    },
    "+",
  );
  setChildren(
    head,
    h(
      "div",
      { class: "acting" },
      h("span", { class: "acting-label" }, "Acting as"),
      h("span", { class: "workspace-name", testid: "workspace-name", title: `workspace ${state.workspace.id}` }, state.workspace.name),
    ),
    h("div", { class: "acting-row" }, avatar(state.me.displayName, { avatarText: state.me.avatar, kind: state.me.kind, seed: state.me.id, size: "small" }), select, plus, menu),
    h("span", { class: "sr-only", testid: "me-name" }, state.me.displayName),
    state.person
      ? h("div", { class: "muted small", testid: "signed-in-as" }, `Signed in as ${state.person.displayName} (${ROLE_LABELS[state.person.role] || "member"})`)
      : null,
    isAgentMe()
      ? h("div", { class: "agent-view-note", testid: "agent-view-note" }, "Seen through an agent's eyes: opening a chat does not mark it read, so the agent still gets its messages.")
      : null,
  );
}

/**
 * The agent members whose view the person may take: the agents they own (the
 * IM's `ownerId` of the member, or the runtime's of the agent), and for the
 * workspace's owner and admins every agent (the IM allows no one else).
 */
function viewableAgents() {
  const agents = [...state.members.values()].filter((m) => m.kind === AGENT);
  if (isAdmin()) return agents;
  const me = state.person?.id;
  const owned = new Set([...state.agents.values()].filter((a) => a.ownerId && a.ownerId === me).map((a) => a.memberId));
  return agents.filter((m) => (m.ownerId && m.ownerId === me) || owned.has(m.id));
}

/** The person may see the IM as this member: themselves or an agent of theirs (the gateway refuses anyone else). */
function canView(memberId) {
  return memberId === state.person?.id || viewableAgents().some((m) => m.id === memberId);
}

// -- the account: personal tokens, invites, roles ---------------------------------

function showAccount() {
  const body = h("div", { class: "account", testid: "account-dialog" });
  const shownOnce = (label, value, testid) =>
    h("div", { class: "secret-once" }, h("p", { class: "muted small" }, `${label} It is shown only this once.`), h("input", { readonly: true, value, testid, onfocus: (e) => e.target.select() }));

  const tokenList = h("ul", { class: "token-list", testid: "token-list" });
  const revoke = async (token) => {
    try {
      await api("POST", `/v1/auth/personal-tokens/${token.id}:revoke`, { member: "" });
      await loadTokens();
    } catch (err) {
      showError(err, "Token not revoked");
    }
  };
  const loadTokens = async () => {
    const tokens = (await api("GET", "/v1/auth/personal-tokens", { member: "" })).personalTokens || [];
    if (!tokens.length) return setChildren(tokenList, h("li", { class: "muted small empty" }, "No tokens yet. A program sends one as Authorization: Bearer <token>."));
    setChildren(
      tokenList,
      tokens.map((t) =>
        h(
          "li",
          { testid: "token", dataset: { tokenName: t.name, revoked: String(Boolean(t.revokeTime)) } },
          h("span", { class: "token-name" }, t.name),
          h("span", { class: "muted small" }, `${t.scope === "PERSONAL_TOKEN_SCOPE_WRITE" ? "read and write" : "read"}${t.revokeTime ? " · revoked" : ""}`),
          t.revokeTime ? null : h("button", { class: "btn btn-small", type: "button", testid: "token-revoke", onclick: () => revoke(t) }, "Revoke"),
        ),
      ),
    );
  };
  const tokenName = h("input", { required: true, maxlength: 200, placeholder: "e.g. my script", testid: "token-name" });
  const tokenScope = h("select", { testid: "token-scope" }, h("option", { value: "PERSONAL_TOKEN_SCOPE_READ" }, "read"), h("option", { value: "PERSONAL_TOKEN_SCOPE_WRITE" }, "read and write"));
  const tokenSecret = h("div", {});
  const tokenForm = h(
    "form",
    {
      class: "inline-form",
      onsubmit: async (event) => {
        event.preventDefault();
        try {
          const made = await api("POST", "/v1/auth/personal-tokens", { member: "", body: { name: tokenName.value.trim(), scope: tokenScope.value, requestId: uuid4() } });
          setChildren(tokenSecret, shownOnce("Send it as Authorization: Bearer <token>.", made.secret, "token-secret"));
          tokenName.value = "";
          await loadTokens();
        } catch (err) {
          showError(err, "No token made");
        }
      },
    },
    tokenName,
    tokenScope,
    h("button", { class: "btn", type: "submit", testid: "token-create" }, "Create"),
  );
  body.append(h("h3", {}, "Personal access tokens"), tokenForm, tokenSecret, tokenList);

  if (isAdmin()) {
    const inviteRole = h("select", { testid: "invite-role" }, h("option", { value: "MEMBER_ROLE_MEMBER" }, "member"), h("option", { value: "MEMBER_ROLE_ADMIN" }, "admin"));
    // Optional (with an OpenID provider): only this person may then join, through the provider.
    const inviteEmail = h("input", { type: "email", maxlength: 254, placeholder: "email (optional)", hidden: true, testid: "invite-email", title: "Only this person can join, with your organisation's sign-in" });
    loadSignInOptions().then((options) => (inviteEmail.hidden = !options.oidc));
    const inviteLink = h("div", {});
    const inviteForm = h(
      "form",
      {
        class: "inline-form",
        onsubmit: async (event) => {
          event.preventDefault();
          try {
            const email = inviteEmail.value.trim();
            const made = await api("POST", "/v1/auth/invites", { member: "", body: { role: inviteRole.value, requestId: uuid4(), ...(email ? { email } : {}) } });
            const link = `${window.location.origin}/#invite=${encodeURIComponent(made.secret)}`;
            const whom = made.invite.email ? ` (for ${made.invite.email} only)` : "";
            setChildren(inviteLink, shownOnce(`Send this link to the person you invite${whom}; it works once.`, link, "invite-link"));
          } catch (err) {
            showError(err, "No invite made");
          }
        },
      },
      inviteEmail,
      inviteRole,
      h("button", { class: "btn", type: "submit", testid: "invite-create" }, "Invite a person"),
    );
    const people = [...state.members.values()].filter((m) => m.kind !== AGENT && m.id !== state.person?.id);
    const roles = h(
      "ul",
      { class: "role-list", testid: "role-list" },
      people.map((m) => {
        const select = h(
          "select",
          {
            testid: "role-select",
            dataset: { memberName: m.displayName },
            onchange: async () => {
              try {
                const changed = await api("POST", `/v1/members/${m.id}:setRole`, { member: "", body: { role: select.value } });
                state.members.set(m.id, changed.member);
                toast(`${m.displayName} is now ${ROLE_LABELS[changed.member.role]}.`);
              } catch (err) {
                showError(err, "Role not changed");
              }
            },
          },
          ["MEMBER_ROLE_MEMBER", "MEMBER_ROLE_ADMIN", "MEMBER_ROLE_OWNER"].map((r) => h("option", { value: r, selected: m.role === r }, ROLE_LABELS[r])),
        );
        return h("li", {}, h("span", {}, m.displayName), select);
      }),
    );
    body.append(h("h3", {}, "Invite people"), inviteForm, inviteLink, h("h3", {}, "Roles"), people.length ? roles : h("p", { class: "muted" }, "Nobody else yet."));
    body.append(
      h("h3", {}, "Audit log"),
      h("p", { class: "muted small" }, "Who signed in, changed roles or tokens, and did what to agents; refusals too."),
      h("button", { class: "btn", type: "button", testid: "audit-open", onclick: () => showAuditLog(appContext) }, "Open the audit log"),
    );
  }
  const linking = h(
    "div",
    { hidden: true, testid: "oidc-link-section" },
    h("h3", {}, "Your organisation's sign-in"),
    h("p", { class: "muted small" }, "Link your organisation's account to sign in with it (your password keeps working)."),
    providerButton("Link your organisation's account", "oidc-link", () => ({ link: "1" })),
  );
  loadSignInOptions().then((options) => (linking.hidden = !options.oidc));
  body.append(linking);
  body.append(h("div", { class: "account-actions" }, h("button", { class: "btn", type: "button", testid: "sign-out-account", onclick: signOut }, "Sign out")));
  modal("Your account", body, { testid: "account" });
  loadTokens().catch((err) => showError(err, "Could not list tokens"));
}

function renderSidebar() {
  const body = document.getElementById("side-body");
  if (!body) return;
  if (state.tab === "chats") renderChatList(body);
  else if (state.tab === "contacts") renderContacts(body);
  else if (state.tab === "memory") renderWorkspaceMemory(body);
  else renderAgentsTree(body);
  renderUnreadTotal();
}

function renderWorkspaceMemory(body) {
  // Kept while the person switches tabs and back: a search is not lost to a redraw.
  if (!workspaceMemory) {
    workspaceMemory = workspaceMemoryView(appContext, {
      openStep: (agentId, sequence, sessionId) => openAgentAtStep(appContext, agentId, sequence, sessionId),
    });
  }
  setChildren(body, workspaceMemory);
}

function renderChatList(body) {
  const chats = sortedChats();
  if (!chats.length) {
    setChildren(body, h("div", { class: "empty-list", testid: "chat-list" }, h("p", {}, "No chats yet."), h("p", { class: "muted" }, "Use + to start a direct chat, a group, or to create an agent.")));
    return;
  }
  setChildren(
    body,
    h(
      "ul",
      { class: "chat-list", testid: "chat-list" },
      chats.map((chat) => {
        const group = chat.group;
        const unread = Number(chat.unreadCount || 0);
        const active = state.chat && state.chat.group.id === group.id;
        return h(
          "li",
          {
            class: `chat-item${active ? " active" : ""}`,
            testid: "chat-item",
            dataset: { chatId: group.id, chatName: chatTitle(group), unread: String(unread) },
            tabindex: "0",
            onclick: () => openChat(group.id),
            onkeydown: (event) => event.key === "Enter" && openChat(group.id),
          },
          h("div", { class: "chat-avatar" }, chatAvatar(group), unread ? h("span", { class: "badge", testid: "chat-unread" }, unread > 99 ? "99+" : String(unread)) : null),
          h(
            "div",
            { class: "chat-main" },
            h("div", { class: "chat-line" }, h("span", { class: "chat-name", testid: "chat-name" }, chatTitle(group)), h("span", { class: "chat-time", testid: "chat-time", title: longTime(chat.lastActivityTime) }, shortTime(chat.lastActivityTime))),
            h("div", { class: "chat-last", testid: "chat-last" }, chat.lastMessage ? preview(chat.lastMessage) : group.kind === DIRECT ? "Say hello" : `${(group.memberIds || []).length} members`),
          ),
        );
      }),
    ),
  );
}

function renderContacts(body) {
  const members = [...state.members.values()];
  const row = (m) => {
    const agent = m.kind === AGENT ? agentOfMember(m.id) : null;
    return h(
      "li",
      { class: "contact", testid: "contact", dataset: { memberName: m.displayName } },
      avatar(m.displayName, { avatarText: m.avatar, kind: m.kind, seed: m.id }),
      h("div", { class: "contact-main" }, h("div", { class: "contact-name" }, m.displayName, m.id === state.me.id ? h("span", { class: "kind-tag" }, "you") : null), h("div", { class: "muted small" }, agent ? agent.role || "agent" : m.kind === AGENT ? "agent" : "person")),
      h(
        "div",
        { class: "contact-actions" },
        m.id !== state.me.id ? h("button", { class: "btn btn-small", type: "button", onclick: () => openDirect(m.id) }, "Message") : null,
        agent ? h("button", { class: "btn btn-small", type: "button", onclick: () => openAgentPanel(appContext, agent.id) }, "Agent") : null,
        m.id !== state.me.id && canView(m.id) ? h("button", { class: "btn btn-small", type: "button", title: "See the IM as this member", onclick: () => switchPerspective(m.id) }, "View as") : null,
      ),
    );
  };
  setChildren(
    body,
    h("div", { class: "list-title" }, "People"),
    h("ul", { class: "contact-list" }, members.filter((m) => m.kind !== AGENT).map(row)),
    h("div", { class: "list-title" }, "Agents"),
    h("ul", { class: "contact-list" }, members.filter((m) => m.kind === AGENT).map(row)),
    h("div", { class: "list-actions" }, isAdmin() ? h("button", { class: "btn", type: "button", onclick: showAccount }, "Invite a person") : null, h("button", { class: "btn", type: "button", onclick: () => showCreateAgent(appContext) }, "Create an agent")),
  );
}

export function stateDot(agent) {
  const label = STATE_LABELS[agent.state] || "unknown";
  return h("span", { class: `state-dot state-${label}`, title: agent.lastError ? `${label}: ${agent.lastError}` : label, dataset: { agentState: label } });
}

/** The organisation tree of the workspace's agents (parent → children). */
export function agentTree(agents, { currentId = "", onPick }) {
  const children = new Map();
  const ids = new Set(agents.map((a) => a.id));
  for (const agent of agents) {
    const parent = agent.parentId && ids.has(agent.parentId) ? agent.parentId : "";
    if (!children.has(parent)) children.set(parent, []);
    children.get(parent).push(agent);
  }
  const branch = (parentId, depth) => {
    const list = children.get(parentId) || [];
    if (!list.length || depth > 20) return null;
    return h(
      "ul",
      { class: "tree" },
      list.map((agent) =>
        h(
          "li",
          {},
          h(
            "button",
            { class: `tree-node${agent.id === currentId ? " current" : ""}`, type: "button", testid: "tree-node", dataset: { agentName: agent.name }, onclick: () => onPick(agent.id) },
            stateDot(agent),
            h("span", { class: "tree-name" }, agent.name),
            agent.role ? h("span", { class: "muted small" }, ` · ${agent.role}`) : null,
          ),
          branch(agent.id, depth + 1),
        ),
      ),
    );
  };
  return branch("", 0) || h("p", { class: "muted" }, "No agents yet.");
}

function renderAgentsTree(body) {
  setChildren(
    body,
    h("div", { class: "list-title" }, "Organisation"),
    h("div", { class: "tree-box", testid: "agents-tree" }, agentTree([...state.agents.values()], { currentId: currentPanelAgent(), onPick: (id) => openAgentPanel(appContext, id) })),
    h("div", { class: "list-actions" }, h("button", { class: "btn btn-primary", type: "button", onclick: () => showCreateAgent(appContext) }, "Create an agent")),
  );
}

function renderAgentState(agent) {
  if (state.tab === "agents") renderSidebar();
  if (state.chat) renderChatHead();
  updateAgentInPanel(agent);
}

// -- dialogs -------------------------------------------------------------------

function memberPicker(members, { testid, multiple = true, selected = new Set() }) {
  const box = h("div", { class: "picker" });
  for (const m of members) {
    const input = h("input", { type: multiple ? "checkbox" : "radio", name: "pick", value: m.id, checked: selected.has(m.id) });
    box.append(
      h("label", { class: "pick", testid, dataset: { memberName: m.displayName } }, input, avatar(m.displayName, { avatarText: m.avatar, kind: m.kind, seed: m.id, size: "small" }), h("span", {}, m.displayName), h("span", { class: "kind-tag" }, m.kind === AGENT ? "agent" : "person")),
    );
  }
  if (!members.length) box.append(h("p", { class: "muted" }, "Nobody else is in this workspace yet."));
  box.values = () => [...box.querySelectorAll("input:checked")].map((i) => i.value);
  return box;
}

function others() {
  return [...state.members.values()].filter((m) => m.id !== state.me.id);
}

/** The members, fresh: someone may have joined (by an invite) since they were loaded. */
async function freshMembers() {
  await refreshMembers();
  return others();
}

async function showNewDirect() {
  const people = await freshMembers();
  const list = h(
    "div",
    { class: "picker" },
    people.map((m) =>
      h(
        "button",
        { class: "member-pick", type: "button", testid: "direct-peer", dataset: { memberName: m.displayName }, onclick: () => (dialog.close(), openDirect(m.id)) },
        avatar(m.displayName, { avatarText: m.avatar, kind: m.kind, seed: m.id, size: "small" }),
        h("span", {}, m.displayName),
        h("span", { class: "kind-tag" }, m.kind === AGENT ? "agent" : "person"),
      ),
    ),
  );
  if (!people.length) list.append(h("p", { class: "muted" }, "Nobody else is in this workspace yet: invite a person or create an agent first."));
  const dialog = modal("New direct chat", list, { testid: "direct-dialog" });
}

async function showNewGroup() {
  const people = await freshMembers();
  const name = h("input", { placeholder: "e.g. Launch team", testid: "group-name", maxlength: 100 });
  const picker = memberPicker(people, { testid: "group-member-option" });
  modal("New group chat", h("div", {}, field("Group name", name), h("div", { class: "field-label" }, "Members"), picker), {
    submitLabel: "Create group",
    testid: "group-dialog",
    onSubmit: async () => {
      if (!name.value.trim()) throw new Error("Give the group a name.");
      const response = await api("POST", "/v1/groups", { body: { name: name.value.trim(), memberIds: picker.values(), requestId: uuid4() } });
      upsertGroup(response.group);
      await openChat(response.group.id);
    },
  });
}

function showProfile() {
  const name = h("input", { value: state.me.displayName, maxlength: 100 });
  const emoji = h("input", { value: state.me.avatar, maxlength: 8 });
  modal(
    "Your profile",
    h("div", {}, h("p", { class: "muted small" }, `Member id: ${state.me.id}`), h("p", { class: "muted small" }, `Workspace: ${state.workspace.name} (${state.workspace.id})`), field("Name", name), field("Avatar", emoji, "An emoji; empty shows the initial.")),
    {
      onSubmit: async () => {
        const response = await api("PATCH", `/v1/members/${state.me.id}`, {
          body: { member: { id: state.me.id, displayName: name.value.trim(), avatar: emoji.value.trim() }, updateMask: "displayName,avatar" },
        });
        state.me = response.member;
        state.members.set(state.me.id, state.me);
        renderShell();
      },
    },
  );
}

function showChatInfo() {
  const chat = state.chat;
  if (!chat) return;
  const group = chat.group;
  const content = h("div", { class: "chat-info" });
  const draw = () => {
    const g = state.chat ? state.chat.group : group;
    const memberIds = g.memberIds || [];
    const rows = memberIds.map((id) => {
      const m = state.members.get(id) || { id, displayName: "unknown member", kind: "" };
      const agent = m.kind === AGENT ? agentOfMember(id) : null;
      return h(
        "li",
        { class: "contact", testid: "group-member", dataset: { memberName: m.displayName } },
        avatar(m.displayName, { avatarText: m.avatar, kind: m.kind, seed: id, size: "small" }),
        h("span", { class: "contact-name" }, m.displayName, id === g.creatorId ? h("span", { class: "kind-tag" }, "creator") : null),
        h(
          "div",
          { class: "contact-actions" },
          agent ? h("button", { class: "btn btn-small", type: "button", onclick: () => openAgentPanel(appContext, agent.id) }, "Agent") : null,
          g.kind !== DIRECT
            ? h("button", { class: "btn btn-small btn-danger", type: "button", testid: "remove-member", onclick: () => changeMembers(g, "remove", [id]) }, id === state.me.id ? "Leave" : "Remove")
            : null,
        ),
      );
    });
    const notIn = others().filter((m) => !memberIds.includes(m.id));
    const picker = memberPicker(notIn, { testid: "add-member-option" });
    const rename = h("input", { value: g.name, maxlength: 100, testid: "rename-group" });
    setChildren(
      content,
      g.kind !== DIRECT
        ? h(
            "div",
            { class: "inline-form" },
            rename,
            h(
              "button",
              {
                class: "btn",
                type: "button",
                onclick: async () => {
                  try {
                    const response = await api("PATCH", `/v1/groups/${g.id}`, { body: { group: { id: g.id, name: rename.value.trim() }, updateMask: "name" } });
                    upsertGroup(response.group);
                    toast("Renamed.");
                  } catch (err) {
                    showError(err, "Could not rename");
                  }
                },
              },
              "Rename",
            ),
          )
        : h("p", { class: "muted" }, "A direct chat always has the same two members."),
      h("div", { class: "list-title" }, `${memberIds.length} members`),
      h("ul", { class: "contact-list" }, rows),
      g.kind !== DIRECT && notIn.length
        ? h("div", {}, h("div", { class: "list-title" }, "Add members"), picker, h("button", { class: "btn btn-primary", type: "button", testid: "add-members-submit", onclick: () => changeMembers(g, "add", picker.values()) }, "Add selected"))
        : null,
    );
  };
  const changeMembers = async (g, action, ids) => {
    if (!ids.length) return;
    try {
      const response = await api("POST", `/v1/groups/${g.id}/members:${action}`, { body: { memberIds: ids } });
      if (!(response.group.memberIds || []).includes(state.me.id)) {
        dialog.close();
        state.chats.delete(g.id);
        state.chat = null;
        renderConversation();
        renderSidebar();
        return;
      }
      upsertGroup(response.group);
      draw();
    } catch (err) {
      showError(err, action === "add" ? "Could not add" : "Could not remove");
    }
  };
  draw();
  const dialog = modal(group.kind === DIRECT ? "Chat info" : `Group: ${chatTitle(group)}`, content, { testid: "chat-info" });
}

function upsertGroup(group) {
  const chat = state.chats.get(group.id);
  if (chat) chat.group = group;
  else state.chats.set(group.id, { group, lastMessage: null, unreadCount: "0", lastActivityTime: group.createTime });
  if (state.chat && state.chat.group.id === group.id) {
    state.chat.group = group;
    renderChatHead();
  }
  renderSidebar();
}

async function openDirect(memberId) {
  try {
    const response = await api("POST", "/v1/groups:direct", { body: { peerMemberId: memberId } });
    upsertGroup(response.group);
    state.tab = "chats";
    renderRail();
    renderSidebar();
    await openChat(response.group.id);
  } catch (err) {
    showError(err, "Could not open the chat");
  }
}

// -- the conversation ----------------------------------------------------------

async function openChat(groupId) {
  const known = state.chats.get(groupId);
  let group = known?.group;
  try {
    if (!group) group = (await api("GET", `/v1/groups/${groupId}`)).group;
  } catch (err) {
    showError(err, "Could not open the chat");
    return;
  }
  state.chat = { group, messages: [], hasOlder: true, loadingOlder: false, replyTo: null, editing: null, quotes: new Map(), mentionIds: new Set() };
  showPane("chat");
  renderConversation();
  renderSidebar();
  const chat = state.chat;
  try {
    const page = await api("GET", `/v1/groups/${groupId}/messages`, { query: { page_size: PAGE } });
    if (state.chat !== chat) return;
    chat.messages = page.messages || [];
    chat.hasOlder = chat.messages.length >= PAGE || Boolean(page.nextPageToken);
    renderMessages({ toBottom: true });
    fillView();
    const entry = state.chats.get(groupId);
    const last = chat.messages[chat.messages.length - 1];
    if (entry && last && canMarkRead() && (Number(entry.unreadCount) > 0 || last.senderId !== state.me.id)) markRead(entry, last.id);
  } catch (err) {
    showError(err, "Could not load messages");
  }
  document.getElementById("composer-input")?.focus();
}

/** Loads older pages until the list can scroll (so scrolling up can load more). */
async function fillView() {
  const list = document.getElementById("message-list");
  for (let i = 0; i < 5 && list && state.chat?.hasOlder && list.scrollHeight <= list.clientHeight + 10; i += 1) {
    await loadOlder();
  }
}

async function loadOlder() {
  const chat = state.chat;
  if (!chat || !chat.hasOlder || chat.loadingOlder) return;
  chat.loadingOlder = true;
  renderOlderStatus();
  try {
    const first = chat.messages[0];
    const query = { page_size: PAGE };
    if (first) query.before_message_id = first.id;
    const page = await api("GET", `/v1/groups/${chat.group.id}/messages`, { query });
    if (state.chat !== chat) return;
    const older = (page.messages || []).filter((m) => !chat.messages.some((x) => x.id === m.id));
    chat.messages = [...older, ...chat.messages];
    chat.hasOlder = older.length > 0 && (older.length >= PAGE || Boolean(page.nextPageToken));
    renderMessages({ keep: true, prepended: true });
  } catch (err) {
    showError(err, "Could not load earlier messages");
  } finally {
    chat.loadingOlder = false;
    renderOlderStatus();
  }
}

function addMessage(message) {
  const chat = state.chat;
  if (!chat || chat.group.id !== message.groupId) return;
  if (chat.messages.some((m) => m.id === message.id)) return;
  chat.messages.push(message);
  chat.messages.sort((a, b) => (a.id < b.id ? -1 : a.id > b.id ? 1 : 0));
  renderMessages({ follow: true });
}

function renderConversation() {
  const box = document.getElementById("conversation");
  if (!box) return;
  const chat = state.chat;
  if (!chat) {
    showPane("list");
    setChildren(
      box,
      h("div", { class: "conversation-empty", testid: "no-chat" }, h("div", { class: "big-mark" }, icon("chat", 72)), h("p", {}, `Hello, ${state.me.displayName}.`), h("p", { class: "muted" }, "Pick a chat on the left, or press + to start one or to create an agent.")),
    );
    return;
  }
  const list = h("div", { class: "message-list", id: "message-list", testid: "message-list", onscroll: () => list.scrollTop < 80 && loadOlder() });
  setChildren(box, h("header", { class: "chat-head", id: "chat-head" }), list, composer());
  keepPlace(list);
  renderChatHead();
}

// The reader's place in the open chat: at its end, or at a message (and how
// far below the top of the list that message is), for a list of this size.
let place = { atEnd: true, id: "", offset: 0, width: 0, height: 0 };
let placeFrame = 0;
// A list that changes size (the agent panel opens beside it, the window is
// resized, the keyboard of a phone opens) reflows its messages: the reader is
// put back where they were rather than left wherever scrollTop now points.
const placeKeeper = new ResizeObserver(() => {
  const list = document.getElementById("message-list");
  if (!list) return;
  if (place.atEnd) list.scrollTop = list.scrollHeight;
  else {
    const anchor = place.id && list.querySelector(`[data-message-id="${CSS.escape(place.id)}"]`);
    if (anchor) list.scrollTop += anchor.getBoundingClientRect().top - list.getBoundingClientRect().top - place.offset;
  }
  place.width = list.clientWidth;
  place.height = list.clientHeight;
});

function notePlace(list) {
  placeFrame = 0;
  if (!list.isConnected) return;
  // A scroll the browser made as the list changed size (scroll anchoring) is
  // not the reader's: the keeper above puts the reader back.
  if (list.clientWidth !== place.width || list.clientHeight !== place.height) return;
  const atEnd = list.scrollHeight - list.scrollTop - list.clientHeight < 30;
  const top = list.getBoundingClientRect().top;
  const anchor = atEnd ? null : [...list.querySelectorAll("[data-message-id]")].find((el) => el.getBoundingClientRect().bottom > top);
  place = { ...place, atEnd, id: anchor ? anchor.dataset.messageId : "", offset: anchor ? anchor.getBoundingClientRect().top - top : 0 };
}

function keepPlace(list) {
  place = { atEnd: true, id: "", offset: 0, width: 0, height: 0 };
  placeKeeper.disconnect();
  placeKeeper.observe(list);
  list.addEventListener("scroll", () => (placeFrame ||= requestAnimationFrame(() => notePlace(list))), { passive: true });
}

function renderChatHead() {
  const head = document.getElementById("chat-head");
  const chat = state.chat;
  if (!head || !chat) return;
  const group = chat.group;
  const peer = group.kind === DIRECT ? state.members.get(peerOf(group)) : null;
  const agent = peer && peer.kind === AGENT ? agentOfMember(peer.id) : null;
  let subtitle = group.kind === DIRECT ? (peer?.kind === AGENT ? "agent" : "direct chat") : `${(group.memberIds || []).length} members`;
  if (agent) subtitle = `${agent.role || "agent"} · ${STATE_LABELS[agent.state] || "unknown"}`;
  setChildren(
    head,
    h("button", { class: "icon-btn chat-back", type: "button", title: "Back to the chats", "aria-label": "Back to the chats", testid: "chat-back", onclick: closeChat }, "‹"),
    chatAvatar(group, "small"),
    h("div", { class: "chat-head-main" }, h("div", { class: "chat-title", testid: "chat-title" }, chatTitle(group)), h("div", { class: "chat-sub muted small", testid: "chat-subtitle", dataset: { agentState: agent ? STATE_LABELS[agent.state] || "unknown" : "" } }, agent ? stateDot(agent) : null, subtitle)),
    agent ? h("button", { class: "btn btn-small", type: "button", testid: "open-agent-panel", onclick: () => openAgentPanel(appContext, agent.id) }, icon("agent", 16), "Agent panel") : null,
    h("button", { class: "icon-btn", type: "button", title: "Chat info and members", testid: "chat-info-button", onclick: showChatInfo }, "⋯"),
  );
}

function renderOlderStatus() {
  const el = document.getElementById("older-status");
  const chat = state.chat;
  if (!el || !chat) return;
  el.textContent = chat.loadingOlder ? "Loading earlier messages…" : chat.hasOlder ? "Scroll up for earlier messages" : chat.messages.length ? "Beginning of the conversation" : "No messages yet — say hello.";
}

function renderMessages({ toBottom = false, follow = false, keep = false, prepended = false } = {}) {
  const list = document.getElementById("message-list");
  const chat = state.chat;
  if (!list || !chat) return;
  const nearBottom = list.scrollHeight - list.scrollTop - list.clientHeight < 120;
  const fromBottom = list.scrollHeight - list.scrollTop;
  const items = [h("div", { class: "older-status muted small", id: "older-status" })];
  let previous = null;
  for (const message of chat.messages) {
    const time = parseTime(message.sendTime);
    const previousTime = previous ? parseTime(previous.sendTime) : null;
    if (!previousTime || (time && time - previousTime > 5 * 60 * 1000)) items.push(h("div", { class: "time-sep" }, longTime(message.sendTime)));
    items.push(renderMessage(message, previous));
    previous = message;
  }
  setChildren(list, items);
  renderOlderStatus();
  if (toBottom || (follow && nearBottom) || (follow && chat.messages.at(-1)?.senderId === state.me.id)) list.scrollTop = list.scrollHeight;
  else if (prepended || keep) list.scrollTop = list.scrollHeight - fromBottom;
}

function quoteOf(message) {
  const chat = state.chat;
  const id = message.replyToMessageId;
  const original = chat.messages.find((m) => m.id === id) || chat.quotes.get(id);
  const box = h("div", { class: "quote", testid: "message-quote", title: "Go to the original message" });
  const fill = (m) => setChildren(box, h("strong", {}, `${memberName(m.senderId)}: `), snippet(m.content, 120));
  if (original) fill(original);
  else {
    box.textContent = "…";
    api("GET", `/v1/messages/${id}`)
      .then((response) => {
        chat.quotes.set(id, response.message);
        fill(response.message);
      })
      .catch(() => {
        box.textContent = "(message unavailable)";
      });
  }
  box.addEventListener("click", () => {
    const target = document.querySelector(`[data-message-id="${CSS.escape(id)}"]`);
    if (target) {
      target.scrollIntoView({ block: "center", behavior: "smooth" });
      target.classList.add("flash");
      setTimeout(() => target.classList.remove("flash"), 1200);
    }
  });
  return box;
}

function messageBody(message) {
  const mentionNames = (message.mentions || []).map((id) => state.members.get(id)?.displayName).filter(Boolean);
  switch (message.contentType) {
    case "CONTENT_TYPE_CODE":
      return h("pre", { class: "code-message", testid: "message-content" }, h("code", {}, message.content));
    case "CONTENT_TYPE_TASK":
      return h("div", { class: "task-card", testid: "message-content" }, h("div", { class: "task-label" }, "Task"), renderMarkdown(message.content, { mentions: mentionNames }));
    case "CONTENT_TYPE_IMAGE":
    case "CONTENT_TYPE_FILE": {
      const href = safeHref(message.content);
      const label = message.contentType === "CONTENT_TYPE_IMAGE" ? "Image" : "File";
      const target = href ? h("a", { class: "md-link", target: "_blank", rel: "noopener noreferrer nofollow" }, message.content) : h("span", {}, message.content);
      if (href) target.href = href;
      return h("div", { class: "file-card", testid: "message-content" }, h("div", { class: "task-label" }, label), target);
    }
    default:
      return h("div", { class: "message-text", testid: "message-content" }, renderMarkdown(message.content, { mentions: mentionNames }));
  }
}

async function retryAgent(agentId, button) {
  button.disabled = true;
  try {
    await api("POST", `/v1/agents/${agentId}:wake`, { body: {} });
    toast("Retrying");
  } catch (err) {
    showError(err, "Could not retry");
    button.disabled = false;
  }
}

function renderMessage(message, previous) {
  const sender = state.members.get(message.senderId);
  const name = sender ? sender.displayName : "unknown member";
  if (message.contentType === "CONTENT_TYPE_SYSTEM") {
    // An agent that could not answer says why; Retry wakes it (it retries the failed run).
    const failure = message.metadata?.agent_failure;
    return h(
      "div",
      { class: `msg-system${failure ? " agent-failure" : ""}`, testid: "message", dataset: { messageId: message.id, senderName: name, type: "system" } },
      h("span", { testid: "message-content" }, failure ? `${name}: ${message.content}` : message.content),
      failure
        ? h(
            "div",
            { class: "notice-actions" },
            // Only a failure a wake can retry offers it (a terminated agent must be started first).
            failure.retry === "WakeAgent"
              ? h("button", { type: "button", class: "btn btn-small", testid: "notice-retry", onclick: (event) => retryAgent(failure.agent_id, event.currentTarget) }, "Retry")
              : null,
            state.agents.has(failure.agent_id)
              ? h("button", { type: "button", class: "link-btn", testid: "notice-details", onclick: () => openAgentPanel(appContext, failure.agent_id) }, "Details")
              : null,
          )
        : null,
    );
  }
  const mine = message.senderId === state.me.id;
  const group = state.chat.group;
  const sameSender = previous && previous.senderId === message.senderId && previous.contentType !== "CONTENT_TYPE_SYSTEM";
  const actions = h(
    "div",
    { class: "msg-actions" },
    h("button", { type: "button", class: "link-btn", testid: "reply-button", onclick: () => startReply(message) }, "Reply"),
    mine && message.contentType !== "CONTENT_TYPE_SYSTEM" ? h("button", { type: "button", class: "link-btn", testid: "edit-button", onclick: () => startEdit(message) }, "Edit") : null,
  );
  const typeClass = (message.contentType || "CONTENT_TYPE_TEXT").replace("CONTENT_TYPE_", "type-").toLowerCase();
  return h(
    "div",
    { class: `msg${mine ? " mine" : ""}${sameSender ? " same-sender" : ""}`, testid: "message", dataset: { messageId: message.id, senderName: name, type: typeClass } },
    avatar(name, { avatarText: sender?.avatar, kind: sender?.kind, seed: message.senderId }),
    h(
      "div",
      { class: "msg-body" },
      group.kind !== DIRECT && !mine ? h("div", { class: "msg-sender" }, name) : null,
      h(
        "div",
        { class: `bubble ${typeClass}`, title: longTime(message.sendTime) },
        message.replyToMessageId ? quoteOf(message) : null,
        messageBody(message),
        message.editTime ? h("span", { class: "edited muted small", title: `edited ${longTime(message.editTime)}` }, "(edited)") : null,
      ),
      actions,
    ),
  );
}

// -- the composer --------------------------------------------------------------

function composer() {
  const input = h("textarea", { id: "composer-input", testid: "composer-input", rows: 3, placeholder: "Write a message — Enter sends, Shift+Enter adds a line, @ mentions someone", maxlength: 65536 });
  const type = h(
    "select",
    { id: "composer-type", testid: "composer-type", title: "Message type" },
    h("option", { value: "CONTENT_TYPE_TEXT" }, "Text"),
    h("option", { value: "CONTENT_TYPE_CODE" }, "Code"),
    h("option", { value: "CONTENT_TYPE_TASK" }, "Task"),
    h("option", { value: "CONTENT_TYPE_SYSTEM" }, "Notice"),
  );
  const popup = h("ul", { class: "mention-popup", id: "mention-popup", testid: "mention-popup", role: "listbox", hidden: true });
  const bar = h("div", { class: "reply-preview", id: "reply-preview", testid: "reply-preview", hidden: true });
  const send = h("button", { class: "btn btn-primary", type: "button", testid: "composer-send", onclick: () => sendMessage() }, "Send");
  // insertedAt: the caret just after a mention the picker inserted (with its space), else -1.
  const mention = { query: null, start: 0, index: 0, options: [], insertedAt: -1 };

  const closePopup = () => {
    mention.query = null;
    popup.hidden = true;
  };
  const insertMention = (member) => {
    const before = input.value.slice(0, mention.start);
    const after = input.value.slice(input.selectionStart);
    // One space after the name: the text that follows may begin with its own.
    const text = /^\s/.test(after) ? `@${member.displayName}` : `@${member.displayName} `;
    input.value = before + text + after;
    const caret = before.length + text.length + (text.endsWith(" ") ? 0 : 1);
    input.setSelectionRange(caret, caret);
    mention.insertedAt = caret;
    state.chat.mentionIds.add(member.id);
    closePopup();
    input.focus();
  };
  const drawPopup = () => {
    setChildren(
      popup,
      mention.options.map((m, i) =>
        h(
          "li",
          { class: `mention-option${i === mention.index ? " active" : ""}`, role: "option", testid: "mention-option", dataset: { memberName: m.displayName }, onmousedown: (event) => (event.preventDefault(), insertMention(m)) },
          avatar(m.displayName, { avatarText: m.avatar, kind: m.kind, seed: m.id, size: "tiny" }),
          h("span", {}, m.displayName),
          (state.chat.group.memberIds || []).includes(m.id) ? null : h("span", { class: "muted small" }, " not in this chat"),
        ),
      ),
    );
    popup.hidden = !mention.options.length;
  };
  const updatePopup = () => {
    const caret = input.selectionStart;
    const before = input.value.slice(0, caret);
    const match = /(^|\s)@([^\s@]{0,40})$/.exec(before);
    if (!match || !state.chat) return closePopup();
    const query = match[2].toLowerCase();
    const inGroup = new Set(state.chat.group.memberIds || []);
    mention.start = caret - match[2].length - 1;
    mention.query = query;
    mention.options = others()
      .filter((m) => m.displayName.toLowerCase().includes(query))
      .sort((a, b) => Number(inGroup.has(b.id)) - Number(inGroup.has(a.id)) || Number(!b.displayName.toLowerCase().startsWith(query)) - Number(!a.displayName.toLowerCase().startsWith(query)) || a.displayName.localeCompare(b.displayName))
      .slice(0, 8);
    mention.index = 0;
    drawPopup();
  };
  input.addEventListener("input", () => {
    mention.insertedAt = -1;
    updatePopup();
  });
  input.addEventListener("click", updatePopup);
  // Closed a moment after the input loses focus, unless it has it again by
  // then: a blur just before typing "@" must not close the list it opens.
  input.addEventListener("blur", () => setTimeout(() => document.activeElement !== input && closePopup(), 150));
  input.addEventListener("keydown", (event) => {
    if (!popup.hidden && mention.options.length) {
      if (event.key === "ArrowDown" || event.key === "ArrowUp") {
        event.preventDefault();
        const n = mention.options.length;
        mention.index = (mention.index + (event.key === "ArrowDown" ? 1 : n - 1)) % n;
        drawPopup();
        return;
      }
      if (event.key === "Enter" || event.key === "Tab") {
        event.preventDefault();
        insertMention(mention.options[mention.index]);
        return;
      }
      if (event.key === "Escape") {
        event.preventDefault();
        closePopup();
        return;
      }
    }
    // The space people type after picking a name is the one the picker already put there.
    if (event.key === " " && !event.isComposing && input.selectionStart === mention.insertedAt && input.selectionEnd === mention.insertedAt && input.value[mention.insertedAt - 1] === " ") {
      event.preventDefault();
      mention.insertedAt = -1;
      return;
    }
    if (event.key === "Escape" && (state.chat?.replyTo || state.chat?.editing)) {
      cancelReply();
      return;
    }
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      sendMessage();
    }
  });
  const note = isAgentMe() ? h("div", { class: "composer-note muted small" }, `You are writing as the agent ${state.me.displayName}.`) : null;
  return h("div", { class: "composer" }, bar, popup, note, h("div", { class: "composer-row" }, type, input, send));
}

function renderReplyBar() {
  const bar = document.getElementById("reply-preview");
  const chat = state.chat;
  if (!bar || !chat) return;
  const target = chat.editing || chat.replyTo;
  if (!target) {
    bar.hidden = true;
    return;
  }
  setChildren(
    bar,
    h("span", { class: "reply-label" }, chat.editing ? "Editing your message" : `Replying to ${memberName(target.senderId)}: `),
    chat.editing ? null : h("span", { class: "reply-text" }, snippet(target.content, 100)),
    h("button", { class: "icon-btn", type: "button", "aria-label": "Cancel", testid: "reply-cancel", onclick: cancelReply }, "×"),
  );
  bar.hidden = false;
}

function startReply(message) {
  state.chat.replyTo = message;
  state.chat.editing = null;
  renderReplyBar();
  document.getElementById("composer-input")?.focus();
}

function startEdit(message) {
  state.chat.editing = message;
  state.chat.replyTo = null;
  const input = document.getElementById("composer-input");
  input.value = message.content;
  renderReplyBar();
  input.focus();
}

function cancelReply() {
  if (!state.chat) return;
  if (state.chat.editing) document.getElementById("composer-input").value = "";
  state.chat.replyTo = null;
  state.chat.editing = null;
  renderReplyBar();
}

function mentionsIn(text) {
  const chat = state.chat;
  const inGroup = new Set(chat.group.memberIds || []);
  const ids = new Set();
  // Mentions picked from the list, and names of chat members typed by hand.
  const candidates = new Set([...chat.mentionIds, ...inGroup]);
  for (const id of candidates) {
    const member = state.members.get(id);
    if (!member || !inGroup.has(id)) continue; // the IM accepts mentions of chat members only
    const pattern = new RegExp(`(^|\\s)@${member.displayName.replace(/[.*+?^${}()|[\]\\]/g, "\\$&")}(?![\\w])`);
    if (pattern.test(text)) ids.add(id);
  }
  return [...ids];
}

async function sendMessage() {
  const chat = state.chat;
  const input = document.getElementById("composer-input");
  const type = document.getElementById("composer-type");
  if (!chat || !input) return;
  const content = input.value;
  if (!content.trim()) return;
  try {
    if (chat.editing) {
      const response = await api("PATCH", `/v1/messages/${chat.editing.id}`, { body: { content } });
      onEdited(response.message);
    } else {
      const response = await api("POST", `/v1/groups/${chat.group.id}/messages`, {
        body: {
          content,
          contentType: type.value,
          mentions: mentionsIn(content),
          replyToMessageId: chat.replyTo ? chat.replyTo.id : "",
          requestId: uuid4(),
        },
      });
      const entry = state.chats.get(chat.group.id);
      if (entry && (!entry.lastMessage || entry.lastMessage.id < response.message.id)) {
        entry.lastMessage = response.message;
        entry.lastActivityTime = response.message.sendTime;
      }
      addMessage(response.message);
      renderSidebar();
    }
    if (state.chat === chat) {
      input.value = "";
      type.value = "CONTENT_TYPE_TEXT";
      chat.replyTo = null;
      chat.editing = null;
      chat.mentionIds.clear();
      renderReplyBar();
    }
  } catch (err) {
    showError(err, "Not sent");
  }
}

// -- what agent.js may use -------------------------------------------------------

const appContext = {
  state,
  api,
  canView,
  memberName,
  openDirect,
  switchPerspective,
  refreshAgents,
  stateDot,
  agentTree,
  renderSidebar,
  streamTrouble,
  upsertAgent(agent) {
    state.agents.set(agent.id, mergeAgent(state.agents.get(agent.id), agent));
    if (!state.members.has(agent.memberId)) refreshMembers();
    renderSidebar();
    if (state.chat) renderChatHead();
  },
  removeAgent(agentId) {
    state.agents.delete(agentId);
    renderSidebar();
  },
};

// -- start -----------------------------------------------------------------------

// The workspace memory search, kept across redraws of the sidebar.
let workspaceMemory = null;
onUnauthorized(() => {
  // The session ended (signed out elsewhere, expired): back to the sign-in page, once.
  if (state.person) showStart("Your session has ended: sign in again.");
});

document.addEventListener("click", (event) => {
  for (const menu of document.querySelectorAll(".menu")) if (!menu.contains(event.target)) menu.hidden = true;
});

window.addEventListener("unhandledrejection", (event) => {
  if (event.reason instanceof ApiError) {
    showError(event.reason);
    event.preventDefault();
  }
});

async function boot() {
  const result = takeSignInResult();
  try {
    await startSession();
  } catch (err) {
    const message = result.error || (err instanceof ApiError && err.httpStatus === 401 ? "" : `Could not continue: ${err.message}`);
    showStart(message, { askWorkspace: result.status === "FAILED_PRECONDITION" });
    return;
  }
  if (result.linked) toast(`Your organisation's account (${result.linked}) is linked: you can sign in with it from now on.`);
  else if (result.error) showError(new ApiError(400, result.status, result.error), "Not linked");
}

boot();
