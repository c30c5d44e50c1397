// jobrelay console: what every part of the page shares (no build step, no framework).
// Every value from the server is written with textContent, never parsed as HTML.
"use strict";

window.JR = (function () {
  const TOKEN_KEY = "jobrelay.console.token";
  const session = { token: sessionStorage.getItem(TOKEN_KEY) || "", admin: false, accountId: null, job: null };
  const listeners = [];
  const $ = (id) => document.getElementById(id);

  function el(tag, text, className) {
    const node = document.createElement(tag);
    if (text !== undefined && text !== null) node.textContent = String(text);
    if (className) node.className = className;
    return node;
  }

  const relative = new Intl.RelativeTimeFormat(undefined, { numeric: "auto" });
  const absolute = new Intl.DateTimeFormat(undefined, { dateStyle: "medium", timeStyle: "medium" });

  // "3 min ago" / "in 5 s", from the browser's clock.
  function ago(iso) {
    if (!iso) return "-";
    const seconds = Math.round((Date.parse(iso) - Date.now()) / 1000);
    const size = Math.abs(seconds);
    if (size < 90) return relative.format(seconds, "second");
    if (size < 5400) return relative.format(Math.round(seconds / 60), "minute");
    if (size < 129600) return relative.format(Math.round(seconds / 3600), "hour");
    return relative.format(Math.round(seconds / 86400), "day");
  }

  // A <time>: the local date and time (browser zone) with the relative time; ISO on hover.
  function when(iso) {
    const node = el("time");
    if (!iso) {
      node.textContent = "-";
      return node;
    }
    node.dateTime = iso;
    node.title = iso;
    node.textContent = absolute.format(new Date(iso)) + " (" + ago(iso) + ")";
    return node;
  }

  function duration(seconds) {
    if (seconds === null || seconds === undefined) return "-";
    if (seconds < 1) return Math.round(seconds * 1000) + " ms";
    if (seconds < 120) return (Math.round(seconds * 10) / 10) + " s";
    if (seconds < 7200) return Math.round(seconds / 60) + " min";
    return Math.round(seconds / 360) / 10 + " h";
  }

  async function api(method, path, body) {
    const headers = { Accept: "application/json", Authorization: "Bearer " + session.token };
    const init = { method: method, headers: headers };
    if (body !== undefined) {
      headers["Content-Type"] = "application/json";
      init.body = JSON.stringify(body);
    }
    const response = await fetch(path, init);
    let data = null;
    try {
      data = await response.json();
    } catch (ignored) {
      data = null;
    }
    if (!response.ok) {
      const fields = data && data.errors ? " (" + data.errors.map((e) => e.field + ": " + e.message).join("; ") + ")" : "";
      const error = new Error(((data && (data.detail || data.title)) || "HTTP " + response.status) + fields);
      error.status = response.status;
      throw error;
    }
    return data;
  }

  // A table row that opens a job: a link for the mouse, Enter on the focused row for keys.
  function jobRow(jobId, open) {
    const row = el("tr");
    row.dataset.jobId = jobId;
    row.tabIndex = 0;
    row.className = "clickable";
    row.addEventListener("keydown", (event) => {
      if (event.key === "Enter" && event.target === row) open(jobId);
    });
    return row;
  }

  function jobLink(jobId, open) {
    const link = el("a", jobId, "job-link");
    link.href = "#job=" + encodeURIComponent(jobId);
    link.addEventListener("click", (event) => {
      event.preventDefault();
      open(jobId);
    });
    return link;
  }

  // The clipboard API where the page may use it (a secure context: https or localhost),
  // else a selected, off-screen textarea and the older copy command. True when copied.
  async function copyText(text) {
    if (navigator.clipboard && window.isSecureContext) {
      try {
        await navigator.clipboard.writeText(text);
        return true;
      } catch (ignored) {
        // denied (no permission, page not focused): try the fallback
      }
    }
    const area = el("textarea", text, "copy-source");
    area.setAttribute("readonly", "");
    document.body.append(area);
    area.select();
    let done = false;
    try {
      done = document.execCommand("copy");
    } catch (ignored) {
      done = false;
    }
    area.remove();
    return done;
  }

  // A job id as a table shows it: "…" and the last 8 characters as the link, the whole id
  // on hover and to screen readers, and a button copying the whole id, so a 36-character id
  // never widens a column past a phone's edge. The end, not the start: a UUIDv7 starts with
  // its creation time, the same 8 characters for every job of the same minute, and ends
  // with random bits (a keyed id is random throughout).
  function jobId(id, open) {
    const box = el("span", null, "job-id");
    const link = jobLink(id, open);
    link.textContent = id.length > 9 ? "…" + id.slice(-8) : id;
    link.title = id;
    link.setAttribute("aria-label", "job " + id);
    const copy = el("button", "copy", "copy-id");
    copy.type = "button";
    copy.dataset.copy = id;
    copy.title = "Copy the job id";
    copy.setAttribute("aria-label", "Copy job id " + id);
    copy.addEventListener("click", async (event) => {
      event.stopPropagation();
      const done = await copyText(id);
      copy.dataset.copied = done ? id : "";
      copy.textContent = done ? "copied" : "copy failed";
      if (!done) window.prompt("Copy the job id", id);
    });
    box.append(link, copy);
    return box;
  }

  return {
    TOKEN_KEY: TOKEN_KEY,
    session: session,
    $: $,
    el: el,
    ago: ago,
    when: when,
    duration: duration,
    api: api,
    jobRow: jobRow,
    jobLink: jobLink,
    jobId: jobId,
    copyText: copyText,
    onToken: (fn) => listeners.push(fn),
    tokenChanged: async () => {
      for (const fn of listeners) await fn();
    },
    open: null, // set by console.js: look a job up and show it
  };
})();
