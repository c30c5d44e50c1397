// jobrelay support console: plain JavaScript against the /v1 API, no build step.
// Every value from the server is written with textContent, never parsed as HTML.
"use strict";

(function () {
  const TOKEN_KEY = "jobrelay.console.token";
  const session = { token: sessionStorage.getItem(TOKEN_KEY) || "", admin: false, job: null };
  const $ = (id) => document.getElementById(id);

  function el(tag, text, className) {
    const node = document.createElement(tag);
    if (text !== undefined && text !== null) node.textContent = String(text);
    if (className) node.className = className;
    return node;
  }

  function ago(iso) {
    if (!iso) return "-";
    const seconds = Math.round((Date.now() - Date.parse(iso)) / 1000);
    const span = Math.abs(seconds) < 120 ? Math.abs(seconds) + " s" : Math.round(Math.abs(seconds) / 60) + " min";
    return seconds >= 0 ? span + " ago" : "in " + span;
  }

  function say(text, isError) {
    const message = $("message");
    message.textContent = text || "";
    message.className = isError ? "error" : "";
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
      const error = new Error((data && (data.detail || data.title)) || "HTTP " + response.status);
      error.status = response.status;
      throw error;
    }
    return data;
  }

  // --- token ------------------------------------------------------------------------------

  async function useToken(token) {
    session.token = token.trim();
    session.admin = false;
    if (!session.token) {
      $("whoami").textContent = "no token yet";
      return;
    }
    try {
      const me = await api("GET", "/v1/whoami");
      session.admin = Boolean(me.admin);
      sessionStorage.setItem(TOKEN_KEY, session.token);
      $("whoami").textContent = me.admin ? "admin token" : "token for account " + me.accountId;
      $("whoami").dataset.admin = String(session.admin);
    } catch (error) {
      sessionStorage.removeItem(TOKEN_KEY);
      $("whoami").textContent = "token rejected: " + error.message;
      $("whoami").dataset.admin = "false";
    }
    await loadQuarantined();
    await loadSchedules();
    if (session.job) renderActions(session.job);
  }

  // --- one job ----------------------------------------------------------------------------

  async function lookUp(jobId) {
    jobId = jobId.trim();
    if (!jobId) return;
    if (!session.token) {
      say("paste an API token first", true);
      return;
    }
    $("job-id").value = jobId;
    try {
      const job = await api("GET", "/v1/jobs/" + encodeURIComponent(jobId) + "/explain");
      session.job = job;
      renderJob(job);
      history.replaceState(null, "", "#job=" + encodeURIComponent(job.jobId));
      say("");
    } catch (error) {
      session.job = null;
      $("job").hidden = true;
      say(error.status === 404 ? "no job " + jobId + " visible to this token" : error.message, true);
    }
  }

  function fact(list, name, value) {
    list.append(el("dt", name), el("dd", value === null || value === undefined || value === "" ? "-" : value));
  }

  function renderJob(job) {
    $("job").hidden = false;
    $("job").dataset.jobId = job.jobId;
    $("job-title").textContent = job.type + " " + job.jobId;
    const badge = $("job-state");
    badge.textContent = job.state;
    badge.className = "state " + job.state;
    $("next-step").textContent = "next: " + job.nextStep;

    const facts = $("facts");
    facts.replaceChildren();
    fact(facts, "account", job.accountId);
    fact(facts, "params", JSON.stringify(job.params));
    fact(facts, "published", job.published ? "yes" : job.unpublishedSince ? "no (an outbox row waits since " + ago(job.unpublishedSince) + ")" : "no");
    if (!job.published && job.lastPublishError) fact(facts, "publish error", job.lastPublishError);
    fact(facts, "attempts", job.attempt + "/" + job.maxAttempts);
    fact(facts, "last error", job.lastError);
    if (job.quarantineReason) fact(facts, "quarantined for", job.quarantineReason);
    fact(facts, "next attempt", job.nextAttemptAt ? job.nextAttemptAt + " (" + ago(job.nextAttemptAt) + ")" : null);
    fact(facts, "lease", job.leaseOwner ? job.leaseOwner + " until " + ago(job.leaseExpiresAt) : null);
    fact(facts, "result key", job.resultKey);
    if (job.progress) fact(facts, "progress", job.progress.done + "/" + job.progress.total + " rows");
    fact(facts, "trace id", job.traceId);
    fact(facts, "accepted", job.createdAt + " (" + ago(job.createdAt) + ")");
    fact(facts, "updated", job.updatedAt + " (" + ago(job.updatedAt) + ")");

    const attempts = $("attempts").tBodies[0];
    attempts.replaceChildren();
    for (const a of job.attempts) {
      const row = el("tr");
      row.append(el("td", a.attempt), el("td", a.startedAt), el("td", a.worker || "-"), el("td", a.outcome), el("td", a.error || "", "reason"));
      attempts.append(row);
    }

    const timeline = $("timeline").tBodies[0];
    timeline.replaceChildren();
    for (const event of job.events) {
      const detail = Object.entries(event.detail || {})
        .filter(([, value]) => value !== null && value !== undefined)
        .map(([key, value]) => key + "=" + (typeof value === "object" ? JSON.stringify(value) : value))
        .join(", ");
      const row = el("tr");
      row.dataset.kind = event.kind;
      row.append(el("td", event.at), el("td", event.kind), el("td", detail, "detail"));
      timeline.append(row);
    }
    renderActions(job);
  }

  function renderActions(job) {
    const replayable = job.state === "quarantined";
    const cancellable = ["queued", "retry_wait", "quarantined"].includes(job.state);
    $("replay").hidden = !(session.admin && replayable);
    $("cancel").hidden = !(session.admin && cancellable);
    $("actions").hidden = $("replay").hidden && $("cancel").hidden;
  }

  async function act(action, jobId) {
    const reason = $("action-reason").value.trim();
    if (action === "cancel" && !reason) {
      say("give a reason to cancel (it is kept in the job's timeline)", true);
      $("action-reason").focus();
      return;
    }
    if (!window.confirm(action + " job " + jobId + "?")) return;
    try {
      const body = reason ? { reason: reason } : action === "replay" ? {} : undefined;
      const done = await api("POST", "/v1/jobs/" + encodeURIComponent(jobId) + "/" + action, body);
      $("action-reason").value = "";
      await lookUp(jobId);
      say(action + " done: job " + done.jobId + " is now " + done.state + " (was " + done.previousState + ")");
    } catch (error) {
      say(action + " refused: " + error.message, true);
    }
    await loadQuarantined();
  }

  // --- quarantined list -------------------------------------------------------------------

  async function loadQuarantined() {
    const table = $("quarantined");
    const note = $("quarantine-note");
    const body = table.tBodies[0];
    body.replaceChildren();
    if (!session.admin) {
      table.hidden = true;
      note.textContent = "Listing jobs needs an admin token.";
      return;
    }
    try {
      const data = await api("GET", "/v1/jobs?state=quarantined&limit=200");
      for (const job of data.jobs) {
        const row = el("tr");
        row.dataset.jobId = job.jobId;
        const idCell = el("td");
        const link = el("a", job.jobId);
        link.href = "#job=" + encodeURIComponent(job.jobId);
        link.addEventListener("click", (event) => {
          event.preventDefault();
          lookUp(job.jobId);
        });
        idCell.append(link);
        const buttons = el("td");
        const replay = el("button", "Replay");
        replay.type = "button";
        replay.className = "replay-row";
        replay.addEventListener("click", () => act("replay", job.jobId));
        buttons.append(replay);
        row.append(
          idCell,
          el("td", job.accountId),
          el("td", job.type),
          el("td", job.attempt + "/" + job.maxAttempts),
          el("td", ago(job.updatedAt)),
          el("td", job.quarantineReason || job.lastError || "", "reason"),
          buttons,
        );
        body.append(row);
      }
      table.hidden = data.jobs.length === 0;
      note.textContent = data.jobs.length === 0 ? "No quarantined jobs." : data.jobs.length + " quarantined job(s), newest first.";
    } catch (error) {
      table.hidden = true;
      note.textContent = "Could not list quarantined jobs: " + error.message;
    }
  }

  // --- schedules --------------------------------------------------------------------------

  function jobLink(jobId) {
    const link = el("a", jobId);
    link.href = "#job=" + encodeURIComponent(jobId);
    link.addEventListener("click", (event) => {
      event.preventDefault();
      lookUp(jobId);
    });
    return link;
  }

  function skippedText(s) {
    const parts = [];
    if (s.skippedWhilePaused) parts.push(s.skippedWhilePaused.count + " while paused");
    if (s.lastSkipped) parts.push(s.lastSkipped.count + " (" + s.lastSkipped.reason + ", " + s.lastSkipped.first + " .. " + s.lastSkipped.last + ")");
    return parts.join("; ") || "-";
  }

  async function loadSchedules() {
    const table = $("schedule-list");
    const note = $("schedules-note");
    const body = table.tBodies[0];
    body.replaceChildren();
    $("schedule-actions").hidden = true;
    if (!session.admin) {
      table.hidden = true;
      note.textContent = "Listing schedules needs an admin token.";
      return;
    }
    try {
      const data = await api("GET", "/v1/schedules");
      for (const s of data.schedules) {
        const row = el("tr");
        row.dataset.schedule = s.name;
        row.dataset.paused = String(s.paused);
        const last = el("td");
        if (s.lastJobId) last.append(jobLink(s.lastJobId));
        else last.textContent = "-";
        const state = el("td", s.lastJobId ? s.lastJobState || "pruned" : "-", "state " + (s.lastJobState || ""));
        const buttons = el("td");
        const toggle = el("button", s.paused ? "Resume" : "Pause");
        toggle.type = "button";
        toggle.className = "schedule-toggle";
        toggle.addEventListener("click", () => setPaused(s.name, !s.paused));
        buttons.append(toggle);
        row.append(
          el("td", s.name),
          el("td", s.cron),
          el("td", s.timezone),
          el("td", s.paused ? "-" : s.nextTick),
          el("td", s.lastTick || "-"),
          last,
          state,
          el("td", s.paused ? "paused by " + s.pausedBy + " (" + s.pausedReason + ")" : "no"),
          el("td", skippedText(s), "reason"),
          buttons,
        );
        body.append(row);
      }
      table.hidden = data.schedules.length === 0;
      $("schedule-actions").hidden = data.schedules.length === 0;
      note.textContent = data.schedules.length === 0
        ? "No schedules yet (one appears once a relay or `up` has run it)."
        : data.schedules.length + " schedule(s).";
    } catch (error) {
      table.hidden = true;
      note.textContent = "Could not list schedules: " + error.message;
    }
  }

  async function setPaused(name, pause) {
    const action = pause ? "pause" : "resume";
    const reason = $("schedule-reason").value.trim();
    if (!reason) {
      $("schedules-note").textContent = "give a reason to " + action + " (it is kept in the schedule's timeline)";
      $("schedule-reason").focus();
      return;
    }
    if (!window.confirm(action + " schedule " + name + "?")) return;
    try {
      const done = await api("POST", "/v1/schedules/" + encodeURIComponent(name) + "/" + action, { reason: reason });
      $("schedule-reason").value = "";
      await loadSchedules();
      const skipped = done.skipped ? "; " + done.skipped.count + " tick(s) were skipped while paused" : "";
      $("schedules-note").textContent = action + " done: " + done.name + (done.paused ? " is paused" : " runs again") + skipped;
    } catch (error) {
      await loadSchedules();
      $("schedules-note").textContent = action + " refused: " + error.message;
    }
  }

  // --- wiring -----------------------------------------------------------------------------

  document.addEventListener("DOMContentLoaded", () => {
    $("token-form").addEventListener("submit", (event) => {
      event.preventDefault();
      useToken($("token").value);
    });
    $("lookup-form").addEventListener("submit", (event) => {
      event.preventDefault();
      lookUp($("job-id").value);
    });
    $("replay").addEventListener("click", () => session.job && act("replay", session.job.jobId));
    $("cancel").addEventListener("click", () => session.job && act("cancel", session.job.jobId));
    $("refresh-quarantine").addEventListener("click", () => loadQuarantined());
    $("refresh-schedules").addEventListener("click", () => loadSchedules());
    const fromHash = new URLSearchParams(location.hash.slice(1)).get("job");
    (async () => {
      if (session.token) {
        $("token").value = session.token;
        await useToken(session.token);
      }
      if (fromHash) await lookUp(fromHash);
    })();
  });
})();
