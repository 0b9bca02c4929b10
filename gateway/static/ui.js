// Notices, dialogs and the connection banner.

import { h } from "./dom.js";

// The width below which the UI shows one column at a time, as a phone
// messenger does (the same figure as style.css's phone media query).
const NARROW = window.matchMedia("(max-width: 700px)");

/** True on a phone-sized screen: one column at a time, the agent panel as a full-screen sheet. */
export function isNarrow() {
  return NARROW.matches;
}

/** Shows a short notice; kind "error" stays longer and can be closed. */
export function toast(message, kind = "info") {
  const box = document.getElementById("toasts");
  const el = h(
    "div",
    { class: `toast toast-${kind}`, role: kind === "error" ? "alert" : "status", testid: kind === "error" ? "error-toast" : "toast" },
    h("span", { class: "toast-text" }, message),
    h("button", { class: "toast-close", type: "button", "aria-label": "Close", onclick: () => el.remove() }, "×"),
  );
  box.append(el);
  setTimeout(() => el.remove(), kind === "error" ? 9000 : 2500);
  return el;
}

/** Shows what went wrong: the API's readable message. */
export function showError(error, what = "") {
  const message = error && error.message ? error.message : String(error);
  toast(what ? `${what}: ${message}` : message, "error");
  if (!(error && error.name === "ApiError")) console.error(error);
}

const streams = new Map();
let hideTimer = null;

/**
 * Tracks the live streams for the banner: "down" shows a reconnecting
 * notice; when every stream is back it says so briefly.
 */
export function streamStatus(name, status) {
  const banner = document.getElementById("banner");
  const wasDown = [...streams.values()].some((s) => s === "down");
  if (status === "closed") streams.delete(name);
  else streams.set(name, status === "open" ? "open" : "down");
  const down = [...streams.entries()].filter(([, s]) => s === "down").map(([n]) => n);
  clearTimeout(hideTimer);
  if (down.length) {
    banner.textContent = `Live updates disconnected (${down.join(", ")}) — reconnecting…`;
    banner.className = "banner banner-down";
    banner.dataset.state = "down";
    banner.hidden = false;
  } else if (wasDown && status === "open") {
    banner.textContent = "Live updates reconnected.";
    banner.className = "banner banner-up";
    banner.dataset.state = "up";
    banner.hidden = false;
    hideTimer = setTimeout(() => {
      banner.hidden = true;
    }, 3000);
  } else if (!down.length && banner.dataset.state === "down") {
    banner.hidden = true;
    banner.dataset.state = "";
  }
}

/**
 * Opens a modal dialog. `body` is an element (usually a form); `onSubmit`
 * (async) runs on submit, and its error is shown inside the dialog.
 * Returns { close, element }.
 */
export function modal(title, body, { onSubmit, submitLabel = "Save", testid = "modal", wide = false } = {}) {
  const error = h("div", { class: "form-error", role: "alert", testid: "form-error", hidden: true });
  const submit = onSubmit ? h("button", { class: "btn btn-primary", type: "submit", testid: `${testid}-submit` }, submitLabel) : null;
  const close = () => {
    overlay.remove();
    document.removeEventListener("keydown", onKey);
  };
  const form = h(
    "form",
    { class: `modal${wide ? " modal-wide" : ""}`, testid, novalidate: true },
    h("div", { class: "modal-head" }, h("h2", {}, title), h("button", { class: "icon-btn", type: "button", "aria-label": "Close", onclick: close }, "×")),
    h("div", { class: "modal-body" }, body),
    error,
    h("div", { class: "modal-foot" }, h("button", { class: "btn", type: "button", onclick: close }, onSubmit ? "Cancel" : "Close"), submit),
  );
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    if (!onSubmit) return;
    error.hidden = true;
    submit.disabled = true;
    try {
      const keepOpen = await onSubmit();
      if (keepOpen !== true) close();
    } catch (err) {
      error.textContent = err && err.message ? err.message : String(err);
      error.hidden = false;
    } finally {
      submit.disabled = false;
    }
  });
  const overlay = h("div", { class: "overlay", onmousedown: (event) => event.target === overlay && close() }, form);
  const onKey = (event) => {
    if (event.key === "Escape") close();
  };
  document.addEventListener("keydown", onKey);
  document.body.append(overlay);
  const first = form.querySelector("input:not([type=checkbox]):not([type=radio]), textarea, select");
  if (first) first.focus();
  return { close, element: form };
}

/** A labelled form field. */
export function field(label, control, hint = "") {
  return h("label", { class: "field" }, h("span", { class: "field-label" }, label), control, hint ? h("span", { class: "field-hint" }, hint) : null);
}

