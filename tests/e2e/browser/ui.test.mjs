// The web UI in a real browser (headless Chromium driven by playwright-core).
//
// Run by tests/e2e/test_browser.py against a running system:
//   AGENTIM_UI_URL=http://127.0.0.1:8080/ node tests/e2e/browser/ui.test.mjs
// Environment: AGENTIM_UI_URL (required), CHROMIUM (default /usr/bin/chromium),
// AGENTIM_ARTIFACTS (screenshots; default artifacts/browser).
//
// It prints one line per step and exits 0 when every step passed. Calls it
// makes the server refuse on purpose are listed in `expectedRefusals`;
// any other console error fails it.

import { mkdirSync } from "node:fs";
import path from "node:path";
import { chromium } from "playwright-core";

const BASE = process.env.AGENTIM_UI_URL;
const ARTIFACTS = process.env.AGENTIM_ARTIFACTS || "artifacts/browser";
const EXECUTABLE = process.env.CHROMIUM || "/usr/bin/chromium";
const TIMEOUT = 15_000;
const CHROMIUM_ARGS = [
  "--headless",
  "--no-sandbox",
  "--disable-gpu",
  "--disable-quic",
  "--no-first-run",
  "--disable-background-networking",
  "--disable-component-update",
  "--disable-sync",
];
const HOSTILE = [
  "<img src=x onerror=alert(1)>",
  "<script>alert(2)</script>",
  "[click me](javascript:alert(3))",
  '<a href="javascript:alert(4)">link</a>',
  "<javascript:alert(5)>",
  '<svg onload="alert(6)"></svg>',
].join(" ");

if (!BASE) {
  console.error("AGENTIM_UI_URL is not set");
  process.exit(2);
}
mkdirSync(ARTIFACTS, { recursive: true });

const started = Date.now();
const log = (text) => console.log(`[${((Date.now() - started) / 1000).toFixed(1)}s] ${text}`);
const dialogs = [];
const problems = [];
// Calls the test makes the server refuse on purpose: Chromium logs each refused fetch as a console error.
// A page opened without a session asks who is signed in, and hears 401: that is how it knows to show the sign-in page.
const expectedRefusals = [/\/v1\/auth\/session$/];

function watch(page, name) {
  page.setDefaultTimeout(TIMEOUT);
  page.on("dialog", async (dialog) => {
    dialogs.push(`${name}: ${dialog.type()} ${dialog.message()}`);
    await dialog.dismiss().catch(() => {});
  });
  page.on("pageerror", (error) => problems.push(`${name}: page error: ${error.message}`));
  page.on("console", (message) => {
    if (message.type() !== "error") return;
    const text = message.text();
    const url = message.location().url || "";
    if (text.startsWith("Failed to load resource") && expectedRefusals.some((pattern) => pattern.test(url))) return;
    // The OpenID provider's own pages (its web font, its favicon) are not the UI's business.
    if (!page.url().startsWith(new URL(BASE).origin) || (url && !url.startsWith(new URL(BASE).origin) && text.startsWith("Failed to load resource"))) return;
    // A refused inline script or style (CSP) is what hostile content would cause; count it too.
    problems.push(`${name}: console error: ${text}`);
  });
}

const testid = (id) => `[data-testid="${id}"]`;

/** What sticks out sideways: the page wider than the window, or any element past its edges. */
async function overflowProblems(page) {
  return page.evaluate(() => {
    const width = window.innerWidth;
    const found = [];
    const pageWidth = document.documentElement.scrollWidth;
    if (pageWidth > width) found.push(`the page scrolls sideways: ${pageWidth}px wide in a ${width}px window`);
    for (const el of document.querySelectorAll("body *")) {
      const box = el.getBoundingClientRect();
      if (!box.width || !box.height) continue;
      if (box.width > width + 1 || box.left < -1 || box.right > width + 1) {
        const classes = typeof el.className === "string" && el.className.trim() ? `.${el.className.trim().split(/\s+/).join(".")}` : "";
        const id = el.dataset?.testid ? `[${el.dataset.testid}]` : "";
        found.push(`${el.tagName.toLowerCase()}${classes}${id} spans ${Math.round(box.left)}..${Math.round(box.right)}px`);
      }
    }
    return found;
  });
}

async function expectNoOverflow(page, where) {
  const found = await overflowProblems(page);
  if (found.length) throw new Error(`${where}: something overflows sideways:\n${found.slice(0, 12).join("\n")}`);
}

/** A screenshot, after checking that nothing on the screen overflows sideways. */
async function shot(page, name) {
  await expectNoOverflow(page, name);
  await page.screenshot({ path: path.join(ARTIFACTS, `${name}.png`) });
  log(`screenshot ${name}.png`);
}

async function actingAs(page, name) {
  await page.locator(testid("me-name")).filter({ hasText: new RegExp(`^${name}$`) }).waitFor({ state: "attached" });
}

/**
 * Goes through the OpenID provider's own pages (oidc-provider's development
 * ones: a login form taking any password, a consent form) until the browser
 * is back on the web UI; a provider that remembers the person skips them.
 */
async function throughProvider(p, login) {
  const home = new URL(BASE).origin;
  const back = (url) => url.origin === home && !url.pathname.startsWith("/v1/auth/oidc/");
  for (let i = 0; i < 4; i++) {
    await p.waitForURL((url) => back(url) || url.pathname.startsWith("/interaction/"), { timeout: 15000 });
    if (back(new URL(p.url()))) return;
    const loginBox = p.locator('input[name="login"]');
    if (await loginBox.count()) {
      await loginBox.fill(login);
      await p.locator('input[name="password"]').fill("any password");
    }
    const before = p.url();
    await p.locator('form button[type="submit"]').first().click();
    await p.waitForURL((url) => url.href !== before, { timeout: 15000 });
  }
  throw new Error(`the provider did not send the browser back: ${p.url()}`);
}

async function switchTo(page, name) {
  await page.locator(testid("perspective-select")).selectOption({ label: name });
  await actingAs(page, name);
}

async function newFromMenu(page, item) {
  await page.locator(testid("new-menu-button")).click();
  await page.locator(testid(item)).click();
}

async function createAgent(page, name, role, parent = "") {
  await newFromMenu(page, "new-agent");
  const dialog = page.locator(testid("agent-dialog"));
  await dialog.locator(testid("agent-name")).fill(name);
  await dialog.locator(testid("agent-role")).fill(role);
  if (parent) await dialog.locator(testid("agent-parent")).selectOption({ label: parent });
  await dialog.locator(testid("agent-prompt")).fill(`You are ${name}, a helpful ${role}.`);
  for (const tool of ["send_direct_message", "read_history", "list_groups", "ask_human"]) {
    if (!(await dialog.locator(testid(`agent-tool-${tool}`)).isChecked())) throw new Error(`tool ${tool} is not offered ticked`);
  }
  // The tools offered are the runtime's own list, no more, no less.
  const offered = await dialog.locator('[data-testid^="agent-tool-"]').evaluateAll((inputs) => inputs.map((input) => input.value));
  const listed = await page.evaluate(async () => {
    const me = JSON.parse(localStorage.getItem("agentim.identity")).memberId;
    const response = await fetch("/v1/tools", { headers: { "X-View-As": me } });
    return (await response.json()).tools.map((tool) => tool.name);
  });
  if (JSON.stringify(offered) !== JSON.stringify(listed)) throw new Error(`the dialog offers ${offered} where the runtime lists ${listed}`);
  await dialog.locator(testid("agent-dialog-submit")).click();
  await dialog.waitFor({ state: "detached" });
  await page.locator(testid("agent-panel-name")).filter({ hasText: name }).waitFor();
}

async function send(page, text) {
  const input = page.locator(testid("composer-input"));
  await input.fill(text);
  await input.press("Enter");
  await page.waitForFunction(() => document.querySelector('[data-testid="composer-input"]').value === "", null, { polling: 100 });
}

function messageFrom(page, sender, text) {
  return page.locator(`${testid("message-list")} ${testid("message")}[data-sender-name="${sender}"]`).filter({ hasText: text });
}

function chatItem(page, name) {
  return page.locator(`${testid("chat-item")}[data-chat-name="${name}"]`);
}

const PASSWORD = "correct horse battery staple";

async function step(name, body) {
  log(`… ${name}`);
  await body();
  log(`✓ ${name}`);
}

// -- the main journey, on a desktop window and on a phone ----------------------

const DESKTOP = { width: 1440, height: 900 };
const PHONE = { width: 390, height: 844 };
const SENTENCE = "The quick brown fox jumps over the lazy dog while the sleepy cat watches the garden from the warm windowsill";
const UNBROKEN = `Unbroken:${"ABCDEFGHIJ".repeat(24)}`;
const LONG_URL = `https://example.com/${"a-very-long-path-segment/".repeat(10)}?query=${"z".repeat(60)}`;
const LONG_CODE = `const answer = "${"y".repeat(160)}"; // ${"a line of code that goes on ".repeat(5)}`;
const PLAN = ["A plan in many lines:", ...Array.from({ length: 20 }, (_, i) => `- step ${i + 1} of the plan`)].join("\n");

/** Where the main parts of the shell are (a part not shown has no box). */
async function layout(page) {
  return page.evaluate(() => {
    const box = (selector) => {
      const el = document.querySelector(selector);
      const r = el ? el.getBoundingClientRect() : null;
      return r && r.width && r.height ? { left: r.left, right: r.right, top: r.top, bottom: r.bottom, width: r.width, height: r.height } : null;
    };
    return {
      width: window.innerWidth,
      height: window.innerHeight,
      rail: box(".rail"),
      list: box(".sidebar"),
      chat: box("#conversation"),
      panel: box("#agent-panel"),
      back: box('[data-testid="chat-back"]'),
    };
  });
}

/** The message list is scrolled to its end (and long enough to scroll). */
async function chatAtEnd(page) {
  return page.evaluate(() => {
    const list = document.getElementById("message-list");
    return { scrolls: list.scrollHeight > list.clientHeight + 20, fromEnd: Math.round(list.scrollHeight - list.scrollTop - list.clientHeight) };
  });
}

/** A message's bubble: its width, and any word of it broken across two lines. */
async function bubbleWrap(page, text) {
  return page.evaluate((text) => {
    const message = [...document.querySelectorAll('[data-testid="message-list"] [data-testid="message"]')].find((m) => m.textContent.includes(text));
    if (!message) return null;
    const content = message.querySelector('[data-testid="message-content"]');
    const split = [];
    const walker = document.createTreeWalker(content, NodeFilter.SHOW_TEXT);
    for (let node = walker.nextNode(); node; node = walker.nextNode()) {
      for (const word of node.data.matchAll(/\S+/g)) {
        const range = document.createRange();
        range.setStart(node, word.index);
        range.setEnd(node, word.index + word[0].length);
        if (new Set([...range.getClientRects()].map((r) => Math.round(r.top))).size > 1) split.push(word[0]);
      }
    }
    return { width: message.querySelector(".bubble").getBoundingClientRect().width, split };
  }, text);
}

/**
 * The main user journey in a fresh browser profile of the given size:
 * create a workspace and an agent, chat with it (long words, an unbroken
 * string, a URL, code, many lines), open its panel, go back to the chat
 * list. At each screen nothing may stick out sideways; on a phone one column
 * shows at a time, and the panel is a full-screen sheet.
 */
async function mainJourney(label, viewport) {
  const phone = viewport.width < 700;
  const journeyContext = await browser.newContext({ viewport, isMobile: phone, hasTouch: phone });
  try {
    const p = await journeyContext.newPage();
    watch(p, label);
    await step(`${label}: create a workspace`, async () => {
      await p.goto(BASE);
      await p.locator(testid("create-workspace-name")).fill(`${label} workspace`);
      await p.locator(testid("create-workspace-creator")).fill("Pia");
      await p.locator(testid("create-workspace-login")).fill("pia");
      await p.locator(testid("create-workspace-password")).fill(PASSWORD);
      await expectNoOverflow(p, `${label} start screen`);
      await p.locator(testid("create-workspace-submit")).click();
      await actingAs(p, "Pia");
      await p.locator(testid("chat-list")).waitFor();
      const at = await layout(p);
      if (phone && (at.chat || !at.list || at.list.width !== at.width)) throw new Error(`the phone does not show the list alone: ${JSON.stringify(at)}`);
    });
    await step(`${label}: create an agent; its panel opens`, async () => {
      await createAgent(p, "scout", "researcher");
      const at = await layout(p);
      if (phone && (at.panel.left !== 0 || at.panel.top !== 0 || at.panel.width !== at.width || at.panel.height !== at.height)) {
        throw new Error(`the agent panel is not a full-screen sheet on a phone: ${JSON.stringify(at.panel)}`);
      }
      await expectNoOverflow(p, `${label} agent panel of a new agent`);
    });
    await step(`${label}: chat with the agent (long words, an unbroken string, a URL, code, many lines)`, async () => {
      await p.locator(testid("agent-chat")).click();
      await p.locator(testid("chat-title")).filter({ hasText: "scout" }).waitFor();
      if (phone) {
        // The sheet gave way to the chat, which shows alone, with a way back.
        await p.locator(testid("agent-panel")).waitFor({ state: "hidden" });
        await p.locator(testid("chat-back")).waitFor();
        const at = await layout(p);
        if (at.list || at.rail || !at.chat || at.chat.width !== at.width) throw new Error(`the phone does not show the chat alone: ${JSON.stringify(at)}`);
      } else {
        const at = await layout(p);
        if (at.back) throw new Error("a back button shows on a desktop window");
        if (!(at.rail.right <= at.list.left + 1 && at.list.right <= at.chat.left + 1 && at.chat.right <= at.panel.left + 1)) {
          throw new Error(`the desktop is not rail | chat list | chat | agent panel side by side: ${JSON.stringify(at)}`);
        }
        await p.locator(testid("agent-panel-close")).click();
      }
      for (const text of [SENTENCE, UNBROKEN, LONG_URL, PLAN]) {
        await send(p, text);
        await messageFrom(p, "scout", `You said: ${text.slice(0, 20)}`).first().waitFor();
      }
      await p.locator(testid("composer-type")).selectOption("CONTENT_TYPE_CODE");
      await send(p, LONG_CODE);
      await messageFrom(p, "scout", "You said: const answer").waitFor();
      const wrap = await bubbleWrap(p, SENTENCE);
      if (!wrap || wrap.split.length || wrap.width < Math.min(0.6 * viewport.width, 300)) {
        throw new Error(`a bubble does not wrap at words: ${JSON.stringify(wrap)} in a ${viewport.width}px window`);
      }
      const end = await chatAtEnd(p);
      if (!end.scrolls || end.fromEnd > 4) throw new Error(`the chat is not at its end: ${JSON.stringify(end)}`);
      await shot(p, `${label}-chat`);
    });
    await step(`${label}: the agent panel shows its steps; the chat stays at its end`, async () => {
      await p.locator(testid("open-agent-panel")).click();
      const panel = p.locator(testid("agent-panel"));
      await panel.locator(`${testid("step")}[data-role="user"][data-live="false"]`).filter({ hasText: "ABCDEFGHIJABCDEFGHIJ" }).waitFor();
      await panel.locator(`${testid("step")}[data-role="assistant"][data-live="false"]`).filter({ hasText: "You said: const answer" }).waitFor();
      await p.evaluate(() => new Promise((resolve) => requestAnimationFrame(() => requestAnimationFrame(resolve))));
      if (phone) {
        const at = await layout(p);
        if (at.panel.width !== at.width || at.panel.height !== at.height) throw new Error(`the agent panel is not a full-screen sheet: ${JSON.stringify(at.panel)}`);
      }
      const end = await chatAtEnd(p);
      if (end.fromEnd > 4) throw new Error(`opening the agent panel scrolled the chat away from its end: ${JSON.stringify(end)}`);
      await shot(p, `${label}-agent-panel`);
      await panel.locator(testid("agent-panel-close")).click();
      await panel.waitFor({ state: "hidden" });
      const after = await chatAtEnd(p);
      if (after.fromEnd > 4) throw new Error(`closing the agent panel left the chat away from its end: ${JSON.stringify(after)}`);
    });
    await step(`${label}: the chat list`, async () => {
      if (phone) {
        await p.locator(testid("chat-back")).click();
        await chatItem(p, "scout").waitFor();
        const at = await layout(p);
        if (at.chat || !at.list || !at.rail || at.list.width !== at.width || at.rail.top < at.list.bottom - 1) {
          throw new Error(`the phone's list is not the chat list over a tab bar: ${JSON.stringify(at)}`);
        }
      }
      await chatItem(p, "scout").locator(testid("chat-last")).filter({ hasText: "You said: const answer" }).waitFor();
      await shot(p, `${label}-chat-list`);
      if (phone) {
        // And into the chat again, at its end.
        await chatItem(p, "scout").click();
        await p.locator(testid("chat-back")).waitFor();
        await messageFrom(p, "scout", "You said: const answer").waitFor();
        const end = await chatAtEnd(p);
        if (end.fromEnd > 4) throw new Error(`a chat opened again is not at its end: ${JSON.stringify(end)}`);
      }
    });
  } finally {
    await journeyContext.close();
  }
}

const browser = await chromium.launch({ executablePath: EXECUTABLE, args: CHROMIUM_ARGS, headless: true });
let context;
let bobContext;
let page;
let exitCode = 0;
try {
  await mainJourney("desktop", DESKTOP);
  await mainJourney("phone", PHONE);

  // A new context is a fresh profile: empty localStorage, no cache.
  context = await browser.newContext({ viewport: DESKTOP });
  page = await context.newPage();
  watch(page, "page 1");

  await step("create a workspace with a password: its creator is signed in", async () => {
    await page.goto(BASE);
    await page.locator(testid("create-workspace-name")).fill("Acme");
    await page.locator(testid("create-workspace-creator")).fill("Ada");
    await page.locator(testid("create-workspace-login")).fill("ada");
    await page.locator(testid("create-workspace-password")).fill(PASSWORD);
    await shot(page, "01-start");
    await page.locator(testid("create-workspace-submit")).click();
    await actingAs(page, "Ada");
    await page.locator(testid("signed-in-as")).filter({ hasText: "Signed in as Ada (owner)" }).waitFor();
    await page.locator(testid("no-chat")).waitFor();
    // No script can read the session: the cookie is HttpOnly.
    if ((await page.evaluate(() => document.cookie)).includes("agentim_session")) throw new Error("the session cookie is readable by scripts");
  });

  await step("sign out, then sign in with the password", async () => {
    await page.locator(testid("sign-out")).click();
    await page.locator(testid("signin-form")).waitFor();
    await shot(page, "01b-sign-in");
    // No workspace field: the login and password find the account.
    if (await page.locator(testid("signin-workspace-field")).isVisible()) throw new Error("the sign-in page asks for the workspace");
    await page.locator(testid("signin-login")).fill("ada");
    await page.locator(testid("signin-password")).fill(PASSWORD);
    await page.locator(testid("signin-submit")).click();
    await actingAs(page, "Ada");
  });

  const orgLogin = process.env.AGENTIM_OIDC_LOGIN;
  if (orgLogin) {
    await step("link the organisation's account, sign out, and sign in with the organisation", async () => {
      await page.locator(testid("account-button")).click();
      const link = page.locator(testid("oidc-link"));
      await link.waitFor();
      await shot(page, "01c-account-link");
      await link.click();
      await throughProvider(page, orgLogin);
      await page.locator(testid("toast")).filter({ hasText: `(${orgLogin}) is linked` }).waitFor();
      await actingAs(page, "Ada");
      await page.locator(testid("sign-out")).click();
      const button = page.locator(testid("signin-oidc"));
      await button.waitFor();
      // No workspace field unless a login is in several workspaces.
      if (await page.locator(testid("signin-workspace-field")).isVisible()) throw new Error("the sign-in page asks for the workspace");
      await shot(page, "01d-sign-in-with-organisation");
      await button.click();
      await throughProvider(page, orgLogin);
      await actingAs(page, "Ada");
      await page.locator(testid("signed-in-as")).filter({ hasText: "Signed in as Ada (owner)" }).waitFor();
    });

    await step("an unverified email is refused on the sign-in page (phone)", async () => {
      const phoneContext = await browser.newContext({ viewport: PHONE, isMobile: true, hasTouch: true });
      try {
        const p = await phoneContext.newPage();
        watch(p, "phone sign-in");
        await p.goto(BASE);
        await p.locator(testid("signin-oidc")).click();
        await throughProvider(p, "unverified-pia@acme.example");
        const refused = p.locator(testid("start-error"));
        await refused.filter({ hasText: "has not verified the email address" }).waitFor();
        if ((await p.evaluate(() => window.location.hash)) !== "") throw new Error("the refusal stays in the URL");
        await shot(p, "01e-refused-phone");
      } finally {
        await phoneContext.close();
      }
    });
  }

  await step("a login of two workspaces asks for the workspace, and only then", async () => {
    // Both main journeys made a workspace whose owner is "pia", with one password.
    const freshContext = await browser.newContext({ viewport: DESKTOP });
    try {
      const p = await freshContext.newPage();
      watch(p, "fresh sign-in");
      expectedRefusals.push(/\/v1\/auth\/sign-in$/);
      await p.goto(BASE);
      const field = p.locator(testid("signin-workspace-field"));
      if (await field.isVisible()) throw new Error("the workspace is asked for before it is needed");
      await p.locator(testid("signin-login")).fill("pia");
      await p.locator(testid("signin-password")).fill(PASSWORD);
      await p.locator(testid("signin-submit")).click();
      await p.locator(testid("start-error")).filter({ hasText: "needs its workspace" }).waitFor();
      await field.waitFor();
      await shot(p, "01f-which-workspace");
    } finally {
      await freshContext.close();
    }
  });

  await step("create two agents (one reporting to the other)", async () => {
    await createAgent(page, "helper", "assistant");
    await createAgent(page, "bea", "reviewer", "helper (assistant)");
    await page.locator(testid("agent-state")).filter({ hasText: "idle" }).waitFor();
    // The organisation tree lists both; the panel's organisation tab shows it too.
    await page.locator(testid("tab-agents")).click();
    await page.locator(`${testid("tree-node")}[data-agent-name="helper"]`).waitFor();
    await page.locator(`${testid("tree-node")}[data-agent-name="bea"]`).click();
    await page.locator(testid("agent-tab-organisation")).click();
    const organisation = page.locator(testid("agent-organisation"));
    await organisation.locator(testid("agent-parent-link")).filter({ hasText: "helper" }).click();
    // Now helper's organisation: no parent, bea as its sub-agent.
    await page.locator(testid("agent-panel-name")).filter({ hasText: "helper" }).waitFor();
    await organisation.getByText("nobody: a top-level agent").waitFor();
    await organisation.locator(testid("agent-child")).filter({ hasText: "bea" }).waitFor();
    await shot(page, "02-organisation");
    await page.locator(testid("agent-tab-activity")).click();
  });

  await step("open a direct chat with the agent; its steps stream in the agent panel", async () => {
    await page.locator(`${testid("tree-node")}[data-agent-name="helper"]`).click();
    await page.locator(testid("agent-panel-name")).filter({ hasText: "helper" }).waitFor();
    await page.locator(testid("agent-chat")).click();
    await page.locator(testid("chat-title")).filter({ hasText: "helper" }).waitFor();
    await page.locator(testid("open-agent-panel")).waitFor();
    // Note every step element that is ever drawn while streaming.
    await page.evaluate(() => {
      window.__liveSteps = 0;
      new MutationObserver((records) => {
        for (const record of records) {
          for (const node of record.addedNodes) {
            if (node.nodeType === 1 && node.matches('[data-testid="step"][data-live="true"]')) window.__liveSteps += 1;
          }
        }
      }).observe(document.getElementById("agent-panel"), { childList: true, subtree: true });
    });
    await send(page, "Hello **helper**, please run `make test`");
    await messageFrom(page, "Ada", "Hello").locator("strong").filter({ hasText: "helper" }).waitFor();
    await messageFrom(page, "Ada", "Hello").locator("code").filter({ hasText: "make test" }).waitFor();
    const answer = "(offline model) You said: Hello **helper**, please run `make test`";
    await messageFrom(page, "helper", "(offline model) You said").waitFor();
    const panel = page.locator(testid("agent-panel"));
    const assistant = panel.locator(`${testid("step")}[data-role="assistant"][data-live="false"]`).filter({ hasText: "You said" });
    await assistant.waitFor();
    await assistant.locator(testid("step-reasoning")).waitFor();
    const input = panel.locator(`${testid("step")}[data-role="user"]`).filter({ hasText: "please run" });
    await input.waitFor();
    // An input names its sender above the text as they wrote it; its ids only on demand.
    await input.locator(testid("step-origin-sender")).filter({ hasText: /^Ada$/ }).waitFor();
    await input.locator(testid("step-origin-group")).filter({ hasText: "direct chat" }).waitFor();
    const inputText = await input.locator(testid("step-content")).innerText();
    if (inputText.trim() !== "Hello helper, please run make test") throw new Error(`the input step is not the clean text: ${JSON.stringify(inputText)}`);
    const ids = input.locator(`${testid("step-origin-details")} dl`);
    if (await ids.isVisible()) throw new Error("the input's ids show without being asked for");
    await input.locator(`${testid("step-origin-details")} summary`).click();
    await ids.filter({ hasText: "message" }).waitFor();
    const completed = panel.locator(`${testid("run")}[data-status="RUN_STATUS_COMPLETED"]`).first();
    await completed.waitFor();
    // A run's header counts its tokens (the offline model reports usage, so not estimated).
    await completed.filter({ hasText: /\d tokens/ }).waitFor();
    const shown = await assistant.locator(testid("step-content")).innerText();
    if (!shown.includes("(offline model) You said: Hello helper, please run make test")) {
      throw new Error(`unexpected assistant step content: ${shown} (expected the rendered form of ${answer})`);
    }
    // The answer's step came over the live stream (step_started, deltas, step_completed), not from a reload.
    const streamed = Number(await panel.locator(testid("agent-activity")).getAttribute("data-streamed-steps"));
    if (!(streamed >= 1)) throw new Error(`no step was streamed live into the panel (${streamed})`);
    log(`steps streamed live: ${streamed}; drawn while still streaming: ${await page.evaluate(() => window.__liveSteps)}`);
    await page.locator(testid("agent-state")).filter({ hasText: "idle" }).waitFor();
    await shot(page, "03-agent-answer-and-steps");
  });

  await step("@mention completion, and an agent messaging another agent which answers", async () => {
    const input = page.locator(testid("composer-input"));
    await input.fill("");
    // The list closes a moment (150 ms) after the input loses focus: a blur
    // just before typing must not close the list the "@" then opens.
    await input.evaluate((element) => (element.blur(), element.focus()));
    await input.pressSequentially("tell @be");
    await page.waitForTimeout(300);
    const option = page.locator(`${testid("mention-option")}[data-member-name="bea"]`);
    await option.waitFor({ timeout: 2000 });
    await input.press("Enter");
    const value = await input.inputValue();
    if (value !== "tell @bea ") throw new Error(`mention not inserted: ${JSON.stringify(value)}`);
    // People type a space after a name they picked: it is the one already there.
    await input.pressSequentially(" the build is green");
    const typed = await input.inputValue();
    if (typed !== "tell @bea the build is green") throw new Error(`a double space after the mention: ${JSON.stringify(typed)}`);
    // Picked in the middle of a text, the name gets no second space either.
    await input.fill("ask  about it");
    await input.evaluate((el) => el.setSelectionRange(4, 4));
    await input.pressSequentially("@hel");
    await page.locator(`${testid("mention-option")}[data-member-name="helper"]`).waitFor();
    await input.press("Enter");
    const middle = await input.inputValue();
    if (middle !== "ask @helper about it") throw new Error(`a mention in the middle of a text: ${JSON.stringify(middle)}`);
    await input.fill("tell @bea the build is green");
    await input.press("Enter");
    const panel = page.locator(testid("agent-panel"));
    await panel.locator(`${testid("step-tool-call")}[data-tool="send_direct_message"]`).waitFor();
    await panel.locator(`${testid("step")}[data-role="tool"]`).filter({ hasText: "sent message" }).waitFor();
    await messageFrom(page, "helper", "Done: sent message").waitFor();
    await shot(page, "04-tool-call");
    // Through the first agent's eyes: its direct chat with bea, and bea's answer.
    await switchTo(page, "helper");
    await page.locator(testid("agent-view-note")).waitFor();
    await chatItem(page, "bea").click();
    await page.locator(testid("chat-title")).filter({ hasText: "bea" }).waitFor();
    await messageFrom(page, "helper", "the build is green").first().waitFor();
    await messageFrom(page, "bea", "You said: the build is green").first().waitFor();
    await shot(page, "05-agent-to-agent");
  });

  // Bob signs in in a browser of his own: its own cookies, its own session.
  let bob;
  await step("the owner invites a second person from the account dialog; the link is shown once", async () => {
    await switchTo(page, "Ada");
    await page.locator(testid("account-button")).click();
    const account = page.locator(testid("account-dialog"));
    await account.locator(testid("invite-role")).selectOption("MEMBER_ROLE_MEMBER");
    await account.locator(testid("invite-create")).click();
    const link = await account.locator(testid("invite-link")).inputValue();
    if (!link.startsWith(`${new URL(BASE).origin}/#invite=`)) throw new Error(`not an invite link: ${link}`);
    await shot(page, "06a-account-owner");
    await page.keyboard.press("Escape");
    await account.waitFor({ state: "detached" });
    // Opened again, the dialog no longer has it: only the invited person holds the secret.
    await page.locator(testid("account-button")).click();
    await account.locator(testid("token-list")).waitFor();
    if (await account.locator(testid("invite-link")).count()) throw new Error("the invite link is shown again");
    await page.setViewportSize(PHONE);
    await shot(page, "06b-account-owner-phone");
    await page.keyboard.press("Escape");
    await account.waitFor({ state: "detached" });
    await page.setViewportSize(DESKTOP);

    bobContext = await browser.newContext({ viewport: DESKTOP });
    bob = await bobContext.newPage();
    watch(bob, "Bob");
    await bob.goto(link);
    const form = bob.locator(testid("invite-form"));
    await form.locator(testid("invite-name")).fill("Bob");
    await form.locator(testid("invite-login")).fill("bob");
    await form.locator(testid("invite-password")).fill(PASSWORD);
    await shot(bob, "06c-accept-invite");
    await form.locator(testid("invite-submit")).click();
    await actingAs(bob, "Bob");
    await bob.locator(testid("signed-in-as")).filter({ hasText: "Signed in as Bob (member)" }).waitFor();
    await bob.locator(testid("no-chat")).waitFor();
    if (bob.url().includes("invite=")) throw new Error(`the spent invite stays in the address: ${bob.url()}`);
    // Bob sees the IM as himself or as an agent of his own (he has none yet); never as Ada.
    const views = await bob.locator(`${testid("perspective-select")} option`).allTextContents();
    if (views[0] !== "Bob" || views.includes("Ada")) throw new Error(`Bob may view as ${views}`);
    // A member invites nobody.
    await bob.locator(testid("new-menu-button")).click();
    await bob.locator(testid("new-direct")).waitFor();
    if (await bob.locator(testid("new-member")).count()) throw new Error("a member is offered to invite people");
    await bob.locator(testid("new-menu-button")).click();
  });

  await step("a second human sees an unread badge appear live, and clear when the chat opens", async () => {
    // Ada writes to Bob, who joined after her page loaded its members.
    await newFromMenu(page, "new-direct");
    await page.locator(`${testid("direct-peer")}[data-member-name="Bob"]`).click();
    await page.locator(testid("chat-title")).filter({ hasText: "Bob" }).waitFor();
    await send(page, "Hi Bob, lunch at *noon*?");
    // Most recent activity first in Ada's chat list.
    await page.locator(`${testid("chat-item")}:first-child[data-chat-name="Bob"]`).waitFor();

    const item = chatItem(bob, "Ada");
    await item.locator(testid("chat-unread")).filter({ hasText: /^1$/ }).waitFor();
    await item.locator(testid("chat-last")).filter({ hasText: "Hi Bob, lunch" }).waitFor();
    await shot(bob, "06-unread-badge");
    await item.click();
    await messageFrom(bob, "Ada", "lunch at").locator("em").filter({ hasText: "noon" }).waitFor();
    await item.locator(testid("chat-unread")).waitFor({ state: "detached" });
    await bob.locator(`${testid("chat-item")}[data-chat-name="Ada"][data-unread="0"]`).waitFor();
  });

  await step("a reply is shown with its quote", async () => {
    const original = messageFrom(bob, "Ada", "lunch at");
    await original.hover();
    await original.locator(testid("reply-button")).click();
    await bob.locator(testid("reply-preview")).filter({ hasText: "Replying to Ada" }).waitFor();
    await send(bob, "Sure, see you there");
    for (const p of [bob, page]) {
      await messageFrom(p, "Bob", "Sure, see you there").locator(testid("message-quote")).filter({ hasText: "lunch at" }).waitFor();
    }
  });

  await step("hostile content renders inert", async () => {
    await send(page, HOSTILE);
    await page.locator(testid("composer-type")).selectOption("CONTENT_TYPE_CODE");
    await send(page, "<b>not bold</b>\n<img src=x onerror=alert(7)>");
    await page.locator(testid("composer-type")).selectOption("CONTENT_TYPE_TEXT");
    // A message sent after the hostile ones: once it shows, they have been drawn (and any handler would have run).
    await send(page, "end of test");
    for (const p of [bob, page]) {
      await messageFrom(p, "Ada", "end of test").waitFor();
      const list = p.locator(testid("message-list"));
      await messageFrom(p, "Ada", "<img src=x onerror=alert(1)>").waitFor();
      await messageFrom(p, "Ada", "<b>not bold</b>").waitFor();
      const injected = await p.evaluate(() => {
        const root = document.querySelector('[data-testid="message-list"]');
        return {
          elements: root.querySelectorAll("img, script, svg, iframe, object, b").length,
          badLinks: [...document.querySelectorAll("a")].filter((a) => !/^(https?|mailto):/.test(a.href)).length,
          handlers: [...root.querySelectorAll("*")].filter((el) => [...el.attributes].some((a) => a.name.startsWith("on"))).length,
        };
      });
      if (injected.elements || injected.badLinks || injected.handlers) throw new Error(`hostile content was not inert: ${JSON.stringify(injected)}`);
      if ((await list.locator('a[href^="javascript"]').count()) !== 0) throw new Error("a javascript: link was rendered");
    }
    await messageFrom(bob, "Ada", "[click me](javascript:alert(3))").waitFor();
    await shot(bob, "07-hostile-inert");
    if (dialogs.length) throw new Error(`a dialog fired: ${dialogs.join("; ")}`);
  });

  await step("a member creates a personal access token (shown once), a program uses it, and it is revoked", async () => {
    await bob.locator(testid("account-button")).click();
    const account = bob.locator(testid("account-dialog"));
    // A member has no invites or roles to manage.
    await account.locator(testid("token-list")).waitFor();
    if (await account.locator(testid("invite-create")).count()) throw new Error("a member is offered to invite people");
    await account.locator(testid("token-name")).fill("lunch bot");
    await account.locator(testid("token-scope")).selectOption("PERSONAL_TOKEN_SCOPE_READ");
    await account.locator(testid("token-create")).click();
    const secret = await account.locator(testid("token-secret")).inputValue();
    if (!secret.startsWith("aim_pat_")) throw new Error(`not a personal access token: ${secret.slice(0, 8)}…`);
    const listed = account.locator(`${testid("token")}[data-token-name="lunch bot"]`);
    await listed.filter({ hasText: "read" }).waitFor();
    if ((await listed.innerText()).includes(secret.slice(8))) throw new Error("the token list shows the secret");
    await shot(bob, "07c-personal-token");
    // A program (no browser, no cookie) reads with it; a read token cannot send.
    const asProgram = (method, where, body) =>
      fetch(new URL(where, BASE), {
        method,
        headers: { Authorization: `Bearer ${secret}`, "Content-Type": "application/json" },
        body: body === undefined ? undefined : JSON.stringify(body),
      });
    const chats = await asProgram("GET", "/v1/chats");
    if (chats.status !== 200) throw new Error(`the token cannot read: ${chats.status} ${await chats.text()}`);
    const group = (await chats.json()).chats[0].group.id;
    const sent = await asProgram("POST", `/v1/groups/${group}/messages`, { content: "from a script" });
    if (sent.status !== 403) throw new Error(`a read token sent a message: ${sent.status} ${await sent.text()}`);
    await bob.setViewportSize(PHONE);
    await shot(bob, "07d-personal-token-phone");
    await bob.setViewportSize(DESKTOP);
    await listed.locator(testid("token-revoke")).click();
    await listed.filter({ hasText: "revoked" }).waitFor();
    if (await listed.locator(testid("token-revoke")).count()) throw new Error("a revoked token can be revoked again");
    const refused = await asProgram("GET", "/v1/chats");
    if (refused.status !== 401) throw new Error(`a revoked token still works: ${refused.status}`);
    await bob.keyboard.press("Escape");
    await account.waitFor({ state: "detached" });
    // Opened again, the secret is not shown any more.
    await bob.locator(testid("account-button")).click();
    await listed.waitFor();
    if (await account.locator(testid("token-secret")).count()) throw new Error("the token's secret is shown again");
    await bob.keyboard.press("Escape");
  });

  await step("signing out returns to the sign-in page and ends the session", async () => {
    const [cookie] = (await bobContext.cookies()).filter((c) => c.name === "agentim_session");
    if (!cookie || !cookie.httpOnly || cookie.sameSite !== "Lax") throw new Error(`the session cookie: ${JSON.stringify(cookie && { ...cookie, value: "…" })}`);
    // On a phone, from the chat list's tab bar.
    await bob.setViewportSize(PHONE);
    await bob.locator(testid("chat-back")).click();
    await shot(bob, "07e-chat-list-phone");
    await bob.locator(testid("sign-out")).click();
    const signIn = bob.locator(testid("signin-form"));
    await signIn.waitFor();
    // No workspace to give; the one this browser used is kept for when it is asked for.
    if (await signIn.locator(testid("signin-workspace-field")).isVisible()) throw new Error("the sign-in page asks for the workspace");
    const workspace = await page.evaluate(() => JSON.parse(localStorage.getItem("agentim.identity")).workspaceId);
    if ((await signIn.locator(testid("signin-workspace")).inputValue()) !== workspace) throw new Error("the sign-in page does not keep the workspace used last");
    await shot(bob, "07f-sign-in-phone");
    if ((await bobContext.cookies()).some((c) => c.name === "agentim_session")) throw new Error("the session cookie outlived sign-out");
    // The old cookie, sent again, is refused: the session ended at the server too.
    const replayed = await fetch(new URL("/v1/chats", BASE), { headers: { Cookie: `agentim_session=${cookie.value}` } });
    if (replayed.status !== 401) throw new Error(`a signed-out session still works: ${replayed.status}`);
    await bobContext.close();
  });

  await step("in a group, an agent answers its @mention; its input step names the sender and the group", async () => {
    await page.bringToFront();
    await switchTo(page, "Ada");
    await newFromMenu(page, "new-group");
    const dialog = page.locator(testid("group-dialog"));
    await dialog.locator(testid("group-name")).fill("Launch team");
    await dialog.locator(`${testid("group-member-option")}[data-member-name="helper"] input`).check();
    await dialog.locator(testid("group-dialog-submit")).click();
    await dialog.waitFor({ state: "detached" });
    await page.locator(testid("chat-title")).filter({ hasText: "Launch team" }).waitFor();
    await send(page, "@helper what is the status?");
    await messageFrom(page, "helper", "what is the status").waitFor();
    await page.locator(testid("tab-agents")).click();
    await page.locator(`${testid("tree-node")}[data-agent-name="helper"]`).click();
    await page.locator(testid("agent-panel-name")).filter({ hasText: "helper" }).waitFor();
    const input = page.locator(`${testid("agent-panel")} ${testid("step")}[data-role="user"]`).filter({ hasText: "what is the status" });
    await input.locator(testid("step-origin-sender")).filter({ hasText: /^Ada$/ }).waitFor();
    await input.locator(testid("step-origin-group")).filter({ hasText: "in Launch team" }).waitFor();
    await shot(page, "07b-group-input-origin");
    await page.locator(testid("tab-chats")).click();
  });

  // Agent control (issue 5), on an agent of its own so that nothing else wakes it.
  const panel = page.locator(testid("agent-panel"));
  const stateIs = (label) => page.locator(`${testid("agent-state")}[data-state="${label}"]`).waitFor();
  const stepWith = (role, text) => panel.locator(`${testid("step")}[data-role="${role}"][data-live="false"]`).filter({ hasText: text });

  await step("pause an agent: a message waits; edit a step and add a note; resume and it answers", async () => {
    // A tab in the background gets few animation frames: the panel draws, and Playwright clicks, on frames.
    await page.bringToFront();
    await switchTo(page, "Ada");
    await createAgent(page, "cora", "planner");
    await page.locator(testid("agent-chat")).click();
    await page.locator(testid("chat-title")).filter({ hasText: "cora" }).waitFor();
    await send(page, "What is the plan?");
    await messageFrom(page, "cora", "You said: What is the plan?").waitFor();
    await stateIs("idle");

    await panel.locator(testid("agent-pause")).click();
    await stateIs("paused");
    await panel.locator(testid("paused-bar")).waitFor();
    await send(page, "Are you still there?");
    await messageFrom(page, "Ada", "Are you still there?").waitFor();

    // Edit the first input; an empty text is refused with the server's reason.
    expectedRefusals.push(/\/v1\/agents\/[^/]+\/steps\/1$/);
    await stepWith("user", "What is the plan?").locator(testid("step-edit")).click();
    const edit = page.locator(testid("edit-step-dialog"));
    await edit.locator(testid("edit-step-content")).fill("");
    await edit.locator(testid("edit-step-dialog-submit")).click();
    await edit.locator(testid("form-error")).filter({ hasText: "must not be empty" }).waitFor();
    await edit.locator(testid("edit-step-content")).fill("What is the new plan?");
    await edit.locator(testid("edit-step-dialog-submit")).click();
    await edit.waitFor({ state: "detached" });
    await stepWith("user", "What is the new plan?").waitFor();

    await panel.locator(testid("add-note")).click();
    const note = page.locator(testid("note-dialog"));
    await note.locator(testid("note-role")).selectOption("STEP_ROLE_SYSTEM");
    await note.locator(testid("note-content")).fill("Keep answers short.");
    await note.locator(testid("note-dialog-submit")).click();
    await note.waitFor({ state: "detached" });
    await stepWith("system", "Keep answers short.").waitFor();
    // Still paused: the message sent meanwhile has had no answer.
    if (await messageFrom(page, "cora", "Are you still there").count()) throw new Error("a paused agent answered");
    await shot(page, "08-paused-and-edited");

    await panel.locator(testid("agent-resume")).click();
    // It goes on from its corrected context first (the model echoes the edited input), then answers what waited.
    await stepWith("assistant", "You said: What is the new plan?").waitFor();
    await messageFrom(page, "cora", "You said: Are you still there?").waitFor();
    await stepWith("assistant", "You said: Are you still there?").waitFor();
    await stateIs("idle");
    await shot(page, "09-resumed");
  });

  await step("fork from a step into a new session, which becomes the main thread", async () => {
    const activity = panel.locator(testid("agent-activity"));
    const original = await activity.getAttribute("data-main-session");
    if (!original) throw new Error("the activity does not name its session");
    await stepWith("user", "Are you still there?").locator(testid("step-fork")).click();
    const dialog = page.locator(testid("fork-dialog"));
    await dialog.locator(testid("fork-session")).check();
    await dialog.locator(testid("fork-dialog-submit")).click();
    await dialog.waitFor({ state: "detached" });
    await panel.locator(`${testid("agent-activity")}:not([data-main-session="${original}"])`).waitFor();
    // The copy keeps the steps up to the fork point (#5, the question), and answers it again there.
    await stepWith("user", "Are you still there?").waitFor();
    await panel.locator(`${testid("step")}[data-role="assistant"][data-sequence="6"]`).filter({ hasText: "You said: Are you still there?" }).waitFor();
    await stateIs("idle");
    await panel.locator(testid("agent-tab-sessions")).click();
    await panel.locator(`${testid("session")}[data-main="true"][data-forked-from="${original}"]`).locator(testid("session-main")).waitFor();
    const first = panel.locator(`${testid("session")}[data-session-id="${original}"][data-main="false"]`);
    await shot(page, "10-forked-session");
    // And back: the original thread made main again.
    await first.locator(testid("session-set-main")).click();
    await panel.locator(`${testid("session")}[data-session-id="${original}"][data-main="true"]`).waitFor();
    await panel.locator(testid("agent-tab-activity")).click();
    await panel.locator(`${testid("agent-activity")}[data-main-session="${original}"]`).waitFor();
  });

  await step("a checkpoint is created and listed", async () => {
    await panel.locator(testid("agent-tab-checkpoints")).click();
    await panel.locator(testid("checkpoint-name")).fill("before the tasks");
    await panel.locator(testid("checkpoint-create")).click();
    await panel.locator(`${testid("checkpoint")}[data-name="before the tasks"]`).waitFor();
  });

  /** The queue's counters are those of the task list shown under them. */
  const queueAgrees = async () => {
    const seen = await panel.evaluate((el) => {
      const statuses = [...el.querySelectorAll('[data-testid="task"]')].map((t) => t.dataset.status);
      return {
        queued: Number(el.querySelector('[data-testid="queue-queued"]').dataset.value),
        running: Number(el.querySelector('[data-testid="queue-running"]').dataset.value),
        listedQueued: statuses.filter((s) => s === "TASK_STATUS_QUEUED" || s === "TASK_STATUS_FAILED").length,
        listedRunning: statuses.filter((s) => s === "TASK_STATUS_RUNNING").length,
      };
    });
    if (seen.queued !== seen.listedQueued || seen.running !== seen.listedRunning) throw new Error(`the queue's counters disagree with its tasks: ${JSON.stringify(seen)}`);
  };

  await step("the queue: tasks wait while paused, one is cancelled, the other runs", async () => {
    await panel.locator(testid("agent-pause")).click();
    await stateIs("paused");
    await panel.locator(testid("agent-tab-queue")).click();
    for (const input of ["First task", "Second task"]) {
      await panel.locator(testid("task-input")).fill(input);
      await panel.locator(testid("task-submit")).click();
      await panel.locator(`${testid("task")}[data-status="TASK_STATUS_QUEUED"]`).filter({ hasText: input }).waitFor();
    }
    const second = panel.locator(testid("task")).filter({ hasText: "Second task" });
    await second.locator(testid("task-position")).filter({ hasText: "position 2" }).waitFor();
    await panel.locator(testid("queue-stats")).filter({ hasText: "2 queued" }).waitFor();
    await second.locator(testid("task-cancel")).click();
    await panel.locator(`${testid("task")}[data-status="TASK_STATUS_CANCELLED"]`).filter({ hasText: "Second task" }).waitFor();
    // One waits: the counters say so, and agree with the list.
    await panel.locator(testid("queue-stats")).filter({ hasText: /^1 queued · 0 running · / }).waitFor();
    await queueAgrees();
    await shot(page, "11-queue-paused");
    await panel.locator(testid("agent-resume")).click();
    const first = panel.locator(`${testid("task")}[data-status="TASK_STATUS_SUCCEEDED"]`).filter({ hasText: "First task" });
    await first.locator(testid("task-result")).filter({ hasText: "You said" }).waitFor();
    await panel.locator(testid("queue-stats")).filter({ hasText: /^0 queued · 0 running · / }).waitFor();
    await stateIs("idle");
    // Once everything has settled, still so (no late reload brings back a stale figure).
    await page.waitForTimeout(600);
    await panel.locator(testid("queue-stats")).filter({ hasText: /^0 queued · 0 running · / }).waitFor();
    await queueAgrees();
    await shot(page, "12-queue-done");
  });

  await step("restoring the checkpoint takes the task's steps out of the context", async () => {
    await panel.locator(testid("agent-tab-activity")).click();
    await stepWith("user", "First task").waitFor();
    await panel.locator(testid("agent-tab-checkpoints")).click();
    await panel.locator(`${testid("checkpoint")}[data-name="before the tasks"]`).locator(testid("checkpoint-restore")).click();
    await page.locator(testid("restore-dialog-submit")).click();
    await page.locator(testid("restore-dialog")).waitFor({ state: "detached" });
    await panel.locator(testid("agent-tab-activity")).click();
    await stepWith("user", "Are you still there?").waitFor();
    await stepWith("user", "First task").first().waitFor({ state: "detached" });
  });

  await step("terminate (keeping the queue), then start again; a refused control shows why", async () => {
    await panel.locator(testid("agent-terminate")).click();
    const dialog = page.locator(testid("terminate-dialog"));
    await dialog.locator(testid("terminate-keep")).check();
    await dialog.locator(testid("terminate-dialog-submit")).click();
    await stateIs("terminated");
    await panel.locator(testid("agent-tab-activity")).click();
    await panel.locator(testid("terminated-bar")).waitFor();
    // A terminated agent does nothing: retrying from a step is refused, and the dialog says why.
    expectedRefusals.push(/\/v1\/agents\/[^/]+\/steps\/\d+:retry$/);
    await stepWith("user", "Are you still there?").locator(testid("step-retry")).click();
    const retry = page.locator(testid("retry-dialog"));
    await retry.locator(testid("retry-dialog-submit")).click();
    await retry.locator(testid("form-error")).filter({ hasText: "TERMINATED" }).waitFor();
    await shot(page, "13-refused-while-terminated");
    await page.keyboard.press("Escape");
    await retry.waitFor({ state: "detached" });
    await panel.locator(testid("agent-start")).click();
    await stateIs("idle");
  });

  await step("search an agent's memory, expand a hit and go to its step; search the workspace", async () => {
    await send(page, "Remember the launch code word: PELICAN");
    await messageFrom(page, "cora", "PELICAN").waitFor();
    await panel.locator(testid("agent-tab-memory")).click();
    const tab = panel.locator(testid("agent-memory-tab"));
    await tab.locator(testid("memory-stats")).filter({ hasText: /\d+ runs, \d+ segments/ }).waitFor();
    await tab.locator(testid("memory-query")).fill("launch code word");
    // The run reaches memory a moment after it ends: search until it is found.
    const hit = tab.locator(testid("memory-hit")).filter({ hasText: "PELICAN" }).first();
    for (let attempt = 0; attempt < 50 && !(await hit.count()); attempt += 1) {
      await tab.locator(testid("memory-search")).click();
      await tab.locator(testid("memory-status")).filter({ hasText: /found/ }).waitFor();
      if (!(await hit.count())) await page.waitForTimeout(200);
    }
    await hit.locator("mark").first().waitFor(); // the query's words are marked
    await hit.locator(testid("memory-expand")).click();
    const context = hit.locator(testid("memory-context"));
    await context.locator(".is-focus").waitFor();
    await shot(page, "14-agent-memory");
    await context.locator(testid("memory-goto")).click();
    await panel.locator(`${testid("step")}.is-target`).filter({ hasText: "PELICAN" }).waitFor();
    await shot(page, "15-memory-goes-to-its-step");

    await page.locator(testid("tab-memory")).click();
    const everywhere = page.locator(testid("workspace-memory"));
    await everywhere.locator(testid("memory-query")).fill("PELICAN");
    await everywhere.locator(testid("memory-type")).filter({ hasText: "Messages" }).click();
    await everywhere.locator(testid("memory-search")).click();
    await everywhere.locator(testid("memory-hit")).filter({ hasText: "PELICAN" }).first().waitFor();
    for (const type of await everywhere.locator(testid("memory-hit")).evaluateAll((els) => els.map((el) => el.dataset.type))) {
      if (type !== "SEGMENT_TYPE_USER_MESSAGE") throw new Error(`the type filter let a ${type} through`);
    }
    await shot(page, "16-workspace-memory");
    await page.setViewportSize(PHONE);
    await panel.locator(testid("agent-tab-memory")).click();
    await panel.locator(testid("agent-memory-tab")).locator(testid("memory-query")).fill("PELICAN");
    await panel.locator(testid("agent-memory-tab")).locator(testid("memory-search")).click();
    await panel.locator(testid("agent-memory-tab")).locator(testid("memory-hit")).first().waitFor();
    await shot(page, "17-agent-memory-phone");
    await panel.locator(testid("agent-panel-close")).click();
    await everywhere.locator(testid("memory-hit")).first().waitFor();
    await shot(page, "18-workspace-memory-phone");
    await page.setViewportSize(DESKTOP);
    await page.locator(testid("tab-chats")).click();
  });

  await step("a model that is down: the chat says why, and Retry gets the answer", async () => {
    const endpoint = process.env.AGENTIM_FAKE_LLM_URL;
    if (!endpoint) throw new Error("AGENTIM_FAKE_LLM_URL is not set");
    await newFromMenu(page, "new-agent");
    const dialog = page.locator(testid("agent-dialog"));
    await dialog.locator(testid("agent-name")).fill("flaky");
    await dialog.locator(testid("agent-role")).fill("tester");
    await dialog.locator(testid("agent-model")).fill("fake-model");
    await dialog.locator(testid("agent-base-url")).fill(endpoint);
    await dialog.locator(testid("agent-dialog-submit")).click();
    await dialog.waitFor({ state: "detached" });
    await page.locator(testid("agent-panel-name")).filter({ hasText: "flaky" }).waitFor();
    await page.locator(testid("agent-chat")).click();
    await page.locator(testid("chat-title")).filter({ hasText: "flaky" }).waitFor();
    await send(page, "Are you there?");
    const notice = page.locator(`${testid("message-list")} .agent-failure`).filter({ hasText: "my model did not respond" });
    await notice.waitFor();
    // The endpoint's own reason is in it, and the panel shows the full error.
    await notice.filter({ hasText: "the model is loading" }).waitFor();
    await page.locator(testid("agent-state")).filter({ hasText: "error" }).waitFor();
    // The step that never came is not left "streaming" in the panel.
    await page.locator(`${testid("agent-panel")} ${testid("step")}[data-live="true"]`).waitFor({ state: "detached" });
    await shot(page, "19-failure-in-chat");
    await page.setViewportSize(PHONE);
    // On a phone the panel is a sheet over the chat: closed, the chat and its notice show.
    await panel.locator(testid("agent-panel-close")).click();
    await notice.locator(testid("notice-retry")).waitFor();
    await shot(page, "20-failure-in-chat-phone");
    await page.setViewportSize(DESKTOP);
    await page.locator(testid("open-agent-panel")).click();
    await page.locator(testid("agent-state")).filter({ hasText: "error" }).waitFor();
    await notice.locator(testid("notice-retry")).click();
    await messageFrom(page, "flaky", "Back now").waitFor();
    await page.locator(testid("agent-state")).filter({ hasText: "idle" }).waitFor();
    await shot(page, "21-retry-answered");
  });

  await step("resume with a message waiting: the run starts at once; header and badge say RUNNING, then IDLE", async () => {
    await newFromMenu(page, "new-agent");
    const dialog = page.locator(testid("agent-dialog"));
    await dialog.locator(testid("agent-name")).fill("slowpoke");
    await dialog.locator(testid("agent-role")).fill("thinker");
    // The fake endpoint's slow model streams its answer over a few seconds.
    await dialog.locator(testid("agent-model")).fill("slow-model");
    await dialog.locator(testid("agent-base-url")).fill(process.env.AGENTIM_FAKE_LLM_URL);
    await dialog.locator(testid("agent-dialog-submit")).click();
    await dialog.waitFor({ state: "detached" });
    await page.locator(testid("agent-panel-name")).filter({ hasText: "slowpoke" }).waitFor();
    await page.locator(testid("agent-chat")).click();
    await page.locator(testid("chat-title")).filter({ hasText: "slowpoke" }).waitFor();
    await panel.locator(testid("agent-pause")).click();
    await stateIs("paused");
    await send(page, "Take your time.");
    await messageFrom(page, "Ada", "Take your time.").waitFor();
    // The race, made certain: ResumeAgent's answer (IDLE when it was made) reaches
    // the page only after the run's live state_changed (RUNNING) has.
    await page.route(
      /\/v1\/agents\/[^/]+:resume$/,
      async (route) => {
        const response = await route.fetch();
        await new Promise((resolve) => setTimeout(resolve, 1200));
        await route.fulfill({ response });
      },
      { times: 1 },
    );
    const resumed = page.waitForResponse(/\/v1\/agents\/[^/]+:resume$/);
    await panel.locator(testid("agent-resume")).click();
    await panel.locator(`${testid("step")}[data-role="assistant"][data-live="true"]`).waitFor();
    const answer = await (await resumed).json();
    log(`ResumeAgent answered ${answer.agent.state} (version ${answer.agent.stateVersion ?? "none"})`);
    await page.waitForTimeout(300);
    const shown = await page.evaluate(async () => {
      const me = JSON.parse(localStorage.getItem("agentim.identity")).memberId;
      const response = await fetch("/v1/agents?page_size=200", { headers: { "X-View-As": me } });
      const agent = (await response.json()).agents.find((a) => a.name === "slowpoke");
      return {
        api: agent.state,
        header: document.querySelector('[data-testid="chat-subtitle"]').dataset.agentState,
        badge: document.querySelector('[data-testid="agent-state"]').dataset.state,
        streaming: Boolean(document.querySelector('#agent-panel [data-testid="step"][data-live="true"]')),
      };
    });
    if (shown.api !== "AGENT_STATE_RUNNING" || !shown.streaming) throw new Error(`the slow run is not under way: ${JSON.stringify(shown)}`);
    if (shown.header !== "running" || shown.badge !== "running") throw new Error(`the UI does not say RUNNING while the agent runs: ${JSON.stringify(shown)}`);
    await shot(page, "22-resumed-running");
    await messageFrom(page, "slowpoke", "considered answer").waitFor();
    await stateIs("idle");
    await page.locator(`${testid("chat-subtitle")}[data-agent-state="idle"]`).waitFor();
  });

  await step("the owner reads the audit log: the IM's records and the agents', merged newest first; refusals", async () => {
    await page.setViewportSize(DESKTOP);
    await page.locator(testid("account-button")).click();
    const account = page.locator(testid("account-dialog"));
    await account.locator(testid("audit-open")).click();
    const log = page.locator(testid("audit-log"));
    const item = (action) => log.locator(`${testid("audit-item")}[data-action="${action}"]`);
    await item("RetryFromStep").first().waitFor();
    // Bob joined, made and revoked a token and signed out (the IM's log), further back: load more, to the start.
    const more = log.locator(testid("audit-more"));
    for (let i = 0; i < 30 && !(await more.isHidden()); i += 1) {
      const shown = await log.locator(testid("audit-item")).count();
      await more.click();
      await page.waitForFunction(([selector, before]) => document.querySelectorAll(selector).length > before || document.querySelector('[data-testid="audit-more"]').hidden, [testid("audit-item"), shown]);
    }
    for (const action of ["AcceptInvite", "CreatePersonalToken", "RevokePersonalToken", "SignOut", "PauseAgent", "UpdateStep"]) await item(action).first().waitFor();
    await log.locator(`${testid("audit-item")}[data-action="CreateAgent"][data-service="runtime"]`).first().waitFor();
    const shown = await log.locator(testid("audit-item")).evaluateAll((items) => items.map((i) => [i.dataset.action, i.dataset.time]));
    const actions = shown.map(([action]) => action);
    const times = shown.map(([, time]) => Date.parse(time));
    const ordered = times.every((t, i) => i === 0 || t <= times[i - 1]);
    if (!ordered || actions.at(-1) !== "CreateWorkspace" || actions.indexOf("SignOut") > actions.indexOf("AcceptInvite")) {
      throw new Error(`the audit log is not newest first: ${shown.map((s) => s.join(" ")).join(", ")}`);
    }
    const who = await item("RevokePersonalToken").first().locator(".audit-who").textContent();
    if (!who.startsWith("Bob")) throw new Error(`the token was revoked by ${who}`);
    await shot(page, "23-audit-log");
    // Only what was refused: the retry of a terminated agent, with why.
    await log.locator(testid("audit-outcome")).selectOption("AUDIT_OUTCOME_FILTER_REFUSED");
    const refused = log.locator(`${testid("audit-item")}[data-action="RetryFromStep"][data-outcome="FAILED_PRECONDITION"]`);
    await refused.first().waitFor();
    await refused.first().locator(".audit-reason").filter({ hasText: "TERMINATED" }).waitFor();
    const outcomes = await log.locator(testid("audit-item")).evaluateAll((items) => items.map((i) => i.dataset.outcome));
    if (outcomes.includes("OK")) throw new Error(`the refused filter shows successes: ${outcomes}`);
    await shot(page, "23a-audit-log-refused");
    await page.setViewportSize(PHONE);
    await shot(page, "23b-audit-log-phone");
    await page.setViewportSize(DESKTOP);
    for (let i = 0; i < 3 && (await page.locator(testid("audit")).count()); i += 1) await page.keyboard.press("Escape");
    for (let i = 0; i < 3 && (await account.count()); i += 1) await page.keyboard.press("Escape");
    await account.waitFor({ state: "detached" });
  });

  await step("no script error and no refused content in either tab", async () => {
    if (problems.length) throw new Error(problems.join("\n"));
    if (dialogs.length) throw new Error(`a dialog fired: ${dialogs.join("; ")}`);
  });
  log("all browser checks passed");
} catch (error) {
  exitCode = 1;
  console.error(`FAILED: ${error.stack || error}`);
  if (problems.length) console.error(`browser problems:\n${problems.join("\n")}`);
  const open = [context, bobContext].filter((c) => c && c.pages).flatMap((c) => { try { return c.pages(); } catch { return []; } });
  for (const [i, p] of open.entries()) {
    await p.screenshot({ path: path.join(ARTIFACTS, `failure-page${i + 1}.png`) }).catch(() => {});
    const text = await p.locator("body").innerText().catch(() => "");
    console.error(`--- page ${i + 1} text ---\n${text.slice(0, 3000)}`);
  }
} finally {
  await browser.close();
}
process.exit(exitCode);
