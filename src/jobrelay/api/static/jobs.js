// jobrelay console: the jobs list (GET /v1/jobs with filters, a keyset page at a time) and
// the bulk actions on what the filter matches (POST /v1/bulk/replay|cancel, in batches).
"use strict";

(function () {
  const { session, $, el, when, api } = window.JR;
  const PAGE = 25;
  const BATCH = 50;
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
          wrap("td", window.JR.jobLink(job.jobId, window.JR.open)),
          el("td", job.state, "state " + job.state),
          el("td", job.type),
          el("td", job.queue),
          el("td", job.accountId || "-"),
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

  async function search() {
    cursors = [""];
    await load("");
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
    if (session.token) await search();
  });

  document.addEventListener("DOMContentLoaded", () => {
    $("jobs-filter").addEventListener("submit", (event) => {
      event.preventDefault();
      search();
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
