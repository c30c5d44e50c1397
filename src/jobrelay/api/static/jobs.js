// jobrelay console: the jobs list (GET /v1/jobs with filters, a keyset page at a time) and
// the bulk actions on what the filter matches (POST /v1/bulk/replay|cancel, in batches).
// The filter is also the address: #jobs?state=retry_wait&type=report.export (the keys of
// GET /v1/jobs), so the overview's cards and rows link to a filtered list and a list can be
// bookmarked or sent to a colleague.
"use strict";

(function () {
  const { session, $, el, ago, when, api } = window.JR;
  const PAGE = 25;
  const BATCH = 50;
  const PARAMS_SHOWN = 60; // characters of a job's params in the list; all of them on hover
  // hash key (GET /v1/jobs's own) -> the form control that shows it
  const ROUTE_FIELDS = {
    state: "f-state",
    type: "f-type",
    queue: "f-queue",
    accountId: "f-account",
    reason: "f-reason",
    createdAfter: "f-after",
    createdBefore: "f-before",
  };
  let cursors = []; // the cursor of each page shown so far ("" for the first)

  function wrap(tag, child) {
    const node = el(tag);
    node.append(child);
    return node;
  }

  // The filter as the form states it; a datetime-local is the browser's zone, sent as UTC.
  function filter() {
    const f = {};
    const text = (id) => $(id).value.trim();
    if (text("f-state")) f.state = text("f-state");
    if (text("f-type")) f.type = text("f-type");
    if (text("f-queue")) f.queue = text("f-queue");
    if (text("f-account")) f.accountId = text("f-account");
    if (text("f-reason")) f.reason = text("f-reason");
    if (text("f-after")) f.createdAfter = new Date(text("f-after")).toISOString();
    if (text("f-before")) f.createdBefore = new Date(text("f-before")).toISOString();
    return f;
  }

  // An ISO time as a datetime-local control shows it: the browser's zone, to the second.
  function localInput(iso) {
    const at = new Date(iso);
    if (Number.isNaN(at.getTime())) return "";
    const pad = (n) => String(n).padStart(2, "0");
    return at.getFullYear() + "-" + pad(at.getMonth() + 1) + "-" + pad(at.getDate()) + "T"
      + pad(at.getHours()) + ":" + pad(at.getMinutes()) + ":" + pad(at.getSeconds());
  }

  // The filter the address names (#jobs?…), or null when the address is not the jobs list.
  function routed() {
    const hash = location.hash.slice(1);
    if (hash !== "jobs" && !hash.startsWith("jobs?")) return null;
    return new URLSearchParams(hash.slice(5));
  }

  // Show the address's filter in the controls (every control: a key left out is "any").
  // An account token's account control keeps its own account (jobs.js's onToken sets it).
  function applyRoute(query) {
    const ignored = [];
    for (const [key, id] of Object.entries(ROUTE_FIELDS)) {
      const control = $(id);
      if (control.disabled) continue;
      const value = query.get(key) || "";
      control.value = id === "f-after" || id === "f-before" ? (value ? localInput(value) : "") : value;
      if (value && !control.value) ignored.push(key + "=" + value);
    }
    $("bulk-run").disabled = true;
    return ignored;
  }

  // The address for the filter as the form states it, without adding a history entry; only
  // when the address is a jobs list already or the person searched with the form (a list
  // loaded beside an open job or at start leaves the address alone).
  function remember(f, fromForm) {
    if (!fromForm && routed() === null) return;
    const query = new URLSearchParams(f).toString();
    const hash = "#jobs" + (query ? "?" + query : "");
    if (location.hash !== hash) history.replaceState(null, "", hash);
  }

  // Say which of the address's keys no control could show (a state that does not exist).
  function routeNote(ignored) {
    if (ignored.length) $("jobs-note").textContent += " (not a filter, left out: " + ignored.join(", ") + ")";
  }

  // Compact JSON with a space after each top-level comma and colon, so a narrow column
  // wraps it between fields rather than inside a value.
  function paramsText(params) {
    if (!params || typeof params !== "object" || Array.isArray(params)) return JSON.stringify(params);
    const fields = Object.entries(params).map(([key, value]) => JSON.stringify(key) + ": " + JSON.stringify(value));
    return "{" + fields.join(", ") + "}";
  }

  function paramsCell(params) {
    const text = paramsText(params || {});
    const cell = el("td", text.length > PARAMS_SHOWN ? text.slice(0, PARAMS_SHOWN - 1) + "…" : text, "params");
    cell.title = text;
    return cell;
  }

  // The state, and for a retry_wait the next attempt: "in 12 seconds", the time on hover.
  function stateCell(job) {
    const cell = el("td", job.state, "state " + job.state);
    if (job.state === "retry_wait" && job.nextAttemptAt) {
      const next = el("time", null, "next-attempt");
      next.dateTime = job.nextAttemptAt;
      next.title = new Date(job.nextAttemptAt).toLocaleString() + " (" + job.nextAttemptAt + ")";
      const due = Date.parse(job.nextAttemptAt) <= Date.now();
      next.textContent = (due ? "next attempt due, " : "next attempt ") + ago(job.nextAttemptAt);
      cell.append(el("br"), next);
    }
    return cell;
  }

  // A delayed job not yet due: when it runs, not "no error".
  function runsAt(iso) {
    const node = when(iso);
    node.textContent = "runs at " + node.textContent;
    return node;
  }

  async function load(cursor) {
    const note = $("jobs-note");
    const body = $("job-list").tBodies[0];
    const query = new URLSearchParams(filter());
    query.set("limit", String(PAGE));
    if (cursor) query.set("cursor", cursor);
    try {
      const data = await api("GET", "/v1/jobs?" + query.toString());
      body.replaceChildren();
      for (const job of data.jobs) {
        const row = window.JR.jobRow(job.jobId, window.JR.open);
        row.dataset.state = job.state;
        row.append(
          wrap("td", window.JR.jobId(job.jobId, window.JR.open)),
          stateCell(job),
          el("td", job.type),
          el("td", job.queue),
          el("td", job.accountId || "-"),
          paramsCell(job.params),
          el("td", job.attempt + "/" + job.maxAttempts, "num"),
          wrap("td", when(job.createdAt)),
          job.state === "queued" && job.runAt && Date.parse(job.runAt) > Date.now()
            ? wrap("td", runsAt(job.runAt))
            : el("td", job.quarantineReason || job.lastError || "", "reason"),
        );
        body.append(row);
      }
      $("job-list").hidden = data.jobs.length === 0;
      const page = cursors.length;
      note.textContent = data.jobs.length === 0
        ? "No jobs match."
        : "Page " + page + ": " + data.jobs.length + " job(s), newest first" + (data.nextCursor ? "; more on the next page." : ".");
      $("jobs-next").hidden = !data.nextCursor;
      $("jobs-next").dataset.cursor = data.nextCursor || "";
      $("jobs-prev").hidden = page <= 1;
    } catch (error) {
      $("job-list").hidden = true;
      note.textContent = "Could not list jobs: " + error.message;
    }
  }

  async function search(fromForm) {
    cursors = [""];
    remember(filter(), fromForm === true);
    await load("");
  }

  // The address changed to a jobs list (a card or a row of the overview, a bookmark, Back):
  // show its filter, list what it matches, and bring the list into view.
  async function follow() {
    const query = routed();
    if (query === null) return;
    const ignored = applyRoute(query);
    if (!session.token) return;
    await search();
    routeNote(ignored);
    $("jobs").scrollIntoView();
  }

  // --- bulk -------------------------------------------------------------------------------

  function bulkBody(dryRun, before) {
    const f = filter();
    const bodyFilter = {};
    for (const key of ["state", "type", "queue", "accountId", "reason", "createdAfter", "createdBefore"]) {
      if (f[key]) bodyFilter[key] = f[key];
    }
    const body = { filter: bodyFilter, reason: $("bulk-reason").value.trim(), dryRun: dryRun, limit: BATCH };
    if (before !== undefined && before !== null) body.before = before;
    return body;
  }

  function status(text) {
    $("bulk-status").textContent = text;
  }

  async function count() {
    const body = bulkBody(true);
    if (!body.reason) {
      status("give a reason first (it is kept in every job's timeline)");
      $("bulk-reason").focus();
      return null;
    }
    try {
      const action = $("bulk-action").value;
      const dry = await api("POST", "/v1/bulk/" + action, body);
      status("Dry run: " + dry.matched + " job(s) match; " + action + " would act on each of them.");
      $("bulk-run").disabled = dry.matched === 0;
      $("bulk-run").dataset.total = String(dry.matched);
      // The run acts on the jobs this count saw: every round passes the count's bound.
      $("bulk-run").dataset.before = String(dry.before);
      return dry.matched;
    } catch (error) {
      status("Refused: " + error.message);
      return null;
    }
  }

  async function run() {
    const action = $("bulk-action").value;
    const total = Number($("bulk-run").dataset.total || "0");
    const before = $("bulk-run").dataset.before ? Number($("bulk-run").dataset.before) : null;
    if (!window.confirm(action + " " + total + " job(s)?")) return;
    const progress = $("bulk-progress");
    progress.hidden = false;
    progress.max = Math.max(total, 1);
    progress.value = 0;
    $("bulk-run").disabled = true;
    let done = 0;
    let refused = 0;
    let remaining = total;
    try {
      // Batches until nothing of the counted set matches: a job acted on leaves it for good
      // (one that fails again entered its state after the bound), so this ends, and each job
      // is acted on once. An interrupted run is counted and run again.
      for (let round = 0; round < 10000; round += 1) {
        const batch = await api("POST", "/v1/bulk/" + action, bulkBody(false, before));
        done += batch.done;
        refused += batch.refused;
        remaining = batch.remaining;
        progress.max = Math.max(done + remaining, 1);
        progress.value = done;
        status(action + ": " + done + " of " + (done + remaining) + " done" + (refused ? ", " + refused + " refused (state changed meanwhile)" : "") + "…");
        if (batch.remaining === 0 || batch.done + batch.refused === 0) break;
      }
      status(action + " finished: " + done + " done, " + refused + " refused, " + remaining + " remaining.");
    } catch (error) {
      status(action + " stopped after " + done + " done: " + error.message + " (running it again continues)");
    }
    await search();
    if (window.JR.reloadQuarantined) await window.JR.reloadQuarantined();
  }

  window.JR.onToken(async () => {
    $("jobs-body").hidden = !session.token;
    $("bulk").hidden = !session.admin;
    $("f-account").disabled = !session.admin;
    $("f-account").value = session.admin ? "" : session.accountId || "";
    $("jobs-note").textContent = session.token ? "" : "Listing jobs needs a token.";
    if (!session.token) return;
    const query = routed();
    const ignored = query === null ? [] : applyRoute(query);
    await search();
    routeNote(ignored);
    if (query !== null) $("jobs").scrollIntoView();
  });

  document.addEventListener("DOMContentLoaded", () => {
    window.addEventListener("hashchange", () => follow());
    $("jobs-filter").addEventListener("submit", (event) => {
      event.preventDefault();
      search(true);
    });
    $("jobs-next").addEventListener("click", () => {
      const cursor = $("jobs-next").dataset.cursor;
      cursors.push(cursor);
      load(cursor);
    });
    $("jobs-prev").addEventListener("click", () => {
      cursors.pop();
      load(cursors[cursors.length - 1] || "");
    });
    $("bulk-count").addEventListener("click", () => count());
    $("bulk-run").addEventListener("click", () => run());
    for (const id of ["bulk-action", "bulk-reason", "f-state", "f-type", "f-queue", "f-account", "f-reason", "f-after", "f-before"]) {
      $(id).addEventListener("input", () => {
        $("bulk-run").disabled = true; // count again for the filter as it is now
      });
    }
  });
})();
