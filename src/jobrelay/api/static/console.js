// jobrelay console: the token, one job (its facts, lane, attempts and timeline), the
// quarantined list and the schedules. The overview, queues and jobs list are overview.js
// and jobs.js; what they share is common.js (window.JR).
"use strict";

(function () {
  const { session, $, el, ago, when, duration, api } = window.JR;

  function say(text, isError) {
    const message = $("message");
    message.textContent = text || "";
    message.className = isError ? "error" : "";
  }

  // --- token ------------------------------------------------------------------------------

  async function useToken(token) {
    session.token = token.trim();
    session.admin = false;
    session.accountId = null;
    if (!session.token) {
      $("whoami").textContent = "no token yet";
    } else {
      try {
        const me = await api("GET", "/v1/whoami");
        session.admin = Boolean(me.admin);
        session.accountId = me.accountId;
        sessionStorage.setItem(window.JR.TOKEN_KEY, session.token);
        $("whoami").textContent = me.admin ? "admin token" : "token for account " + me.accountId;
      } catch (error) {
        sessionStorage.removeItem(window.JR.TOKEN_KEY);
        $("whoami").textContent = "token rejected: " + error.message;
      }
    }
    $("whoami").dataset.admin = String(session.admin);
    document.body.dataset.admin = String(session.admin);
    await loadQuarantined();
    await loadSchedules();
    await window.JR.tokenChanged();
    if (pendingJob && (session.admin || session.accountId)) await lookUp(pendingJob);
    else if (session.job) renderActions(session.job);
  }

  function jobInHash() {
    return new URLSearchParams(location.hash.slice(1)).get("job");
  }

  // --- one job ----------------------------------------------------------------------------

  // A job named by the page's link (#job=<id>) before this tab had a token: a link opened
  // in a new tab has none (the token lives in the tab's sessionStorage). Opened once a
  // token is accepted.
  let pendingJob = null;

  async function lookUp(jobId) {
    jobId = jobId.trim();
    if (!jobId) return;
    $("job-id").value = jobId;
    if (!session.token) {
      pendingJob = jobId;
      say("paste an API token first: job " + jobId + " opens then", true);
      $("token").focus();
      return;
    }
    pendingJob = null;
    try {
      const job = await api("GET", "/v1/jobs/" + encodeURIComponent(jobId) + "/explain");
      session.job = job;
      renderJob(job);
      history.replaceState(null, "", "#job=" + encodeURIComponent(job.jobId));
      say("");
      $("job-title").focus();
    } catch (error) {
      session.job = null;
      $("job").hidden = true;
      say(error.status === 404 ? "no job " + jobId + " visible to this token" : error.message, true);
    }
  }
  window.JR.open = lookUp;

  function fact(list, name, value) {
    const shown = value === null || value === undefined || value === "" ? "-" : value;
    list.append(el("dt", name), shown instanceof Node ? wrap("dd", shown) : el("dd", shown));
  }

  function wrap(tag, child) {
    const node = el(tag);
    node.append(child);
    return node;
  }

  // "waiting for 3 of 1,000: <id> (succeeded), <id> (running), …": each id opens its job.
  function linkedJobs(head, jobs, total) {
    const node = el("span", null, "linked-jobs");
    node.append(head + ": ");
    jobs.forEach((j, i) => {
      if (i) node.append(", ");
      node.append(window.JR.jobLink(j.jobId, lookUp), " (" + (j.state || "pruned") + ")");
    });
    if (total > jobs.length) node.append(", …");
    return node;
  }

  // The hand-offs of the job's final attempt, in order (lane.js); the lane shows how long
  // each took and where it waits.
  function renderLane(job) {
    const lane = $("lane");
    lane.replaceChildren();
    let previous = null;
    let waiting = false;
    for (const { kind, label, at } of window.JR.handoffLane(job.events)) {
      if (previous !== null) {
        const gap = el("li", null, "gap");
        if (at) {
          const seconds = (Date.parse(at) - Date.parse(previous)) / 1000;
          gap.textContent = "+" + duration(Math.max(0, seconds));
          gap.classList.add(seconds >= 10 ? "slow" : seconds >= 1 ? "medium" : "fast");
        } else if (!waiting && !["succeeded", "cancelled", "quarantined"].includes(job.state)) {
          gap.textContent = "waiting " + ago(previous).replace(/ ago$/, "");
          gap.classList.add("stuck");
          waiting = true;
        } else {
          gap.textContent = "";
        }
        gap.setAttribute("aria-hidden", "true");
        lane.append(gap);
      }
      const stage = el("li", null, "stage " + (at ? "reached" : "missing"));
      stage.dataset.stage = kind;
      stage.append(el("span", label, "name"));
      stage.append(at ? when(at) : el("span", "not yet", "muted"));
      lane.append(stage);
      if (at) previous = at;
    }
  }

  function renderJob(job) {
    $("job").hidden = false;
    $("job").dataset.jobId = job.jobId;
    $("job-title").textContent = job.type + " " + job.jobId;
    const copy = $("copy-job-id");
    copy.dataset.copy = job.jobId;
    copy.dataset.copied = "";
    copy.textContent = "copy id";
    const badge = $("job-state");
    badge.textContent = job.state;
    badge.className = "state " + job.state;
    $("next-step").textContent = "next: " + job.nextStep;

    const facts = $("facts");
    facts.replaceChildren();
    fact(facts, "account", job.accountId);
    fact(facts, "params", JSON.stringify(job.params));
    // after=: the jobs it runs after ("waiting for 3 of 1,000") and those waiting for it.
    if (job.after) {
      const head = job.state === "waiting"
        ? "waiting for " + job.after.waitingFor.toLocaleString() + " of " + job.after.total.toLocaleString()
        : job.after.total.toLocaleString() + (job.after.total === 1 ? " job" : " jobs");
      fact(facts, "runs after", linkedJobs(head, job.after.jobs, job.after.total));
    }
    if (job.dependants) {
      const head = job.dependants.total.toLocaleString() + (job.dependants.total === 1 ? " job" : " jobs");
      fact(facts, "waited for by", linkedJobs(head, job.dependants.jobs, job.dependants.total));
    }
    const delayed = job.state === "queued" && job.runAt && Date.parse(job.runAt) > Date.now();
    if (job.runAt) fact(facts, delayed ? "runs at" : "run at", when(job.runAt));
    fact(facts, "published", job.published ? "yes" : delayed ? "not yet: held until its run time" : job.unpublishedSince ? "no (an outbox row waits since " + ago(job.unpublishedSince) + ")" : "no");
    if (!job.published && job.lastPublishError) fact(facts, "publish error", job.lastPublishError);
    fact(facts, "attempts", job.attempt + "/" + job.maxAttempts);
    fact(facts, "last error", job.lastError);
    if (job.quarantineReason) fact(facts, "quarantined for", job.quarantineReason);
    fact(facts, "next attempt", job.nextAttemptAt ? when(job.nextAttemptAt) : null);
    if ("leaseOwner" in job) fact(facts, "lease", job.leaseOwner ? job.leaseOwner + " until " + ago(job.leaseExpiresAt) : null);
    fact(facts, "result key", job.resultKey);
    if (job.result !== undefined && job.result !== null) fact(facts, "result", JSON.stringify(job.result));
    if (job.progress) fact(facts, "progress", job.progress.done + "/" + job.progress.total);
    // With JOBRELAY_TRACE_URL, the trace id opens the trace in the tracing backend.
    if (job.traceUrl && /^https?:\/\//.test(job.traceUrl)) {
      const link = el("a", job.traceId);
      link.href = job.traceUrl;
      link.target = "_blank";
      link.rel = "noopener noreferrer";
      fact(facts, "trace id", link);
    } else {
      fact(facts, "trace id", job.traceId);
    }
    fact(facts, "accepted", when(job.createdAt));
    fact(facts, "updated", when(job.updatedAt));
    // Operators' only: the account view has no lastTraceback, and an admin's shows it
    // collapsed (it is long; the facts above say what failed, this says where).
    const traceback = session.admin && job.lastTraceback ? job.lastTraceback : "";
    $("traceback").hidden = !traceback;
    $("traceback").open = false;
    $("traceback-text").textContent = traceback;

    renderLane(job);
    const admin = "leaseOwner" in job; // the operator document; the account view has no workers
    $("attempts").classList.toggle("no-worker", !admin);
    const attempts = $("attempts").tBodies[0];
    attempts.replaceChildren();
    for (const a of job.attempts) {
      const row = el("tr");
      const took = a.durationSeconds !== null && a.durationSeconds !== undefined
        ? duration(a.durationSeconds)
        : a.outcome === "running" ? duration((Date.now() - Date.parse(a.startedAt)) / 1000) + " so far" : "-";
      row.append(el("td", a.attempt), wrap("td", when(a.startedAt)), el("td", took, "duration"));
      if (admin) row.append(el("td", a.worker || "-"));
      row.append(el("td", a.outcome), el("td", a.error || "", "reason"));
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
      row.append(wrap("td", when(event.at)), el("td", event.kind), el("td", detail, "detail"));
      timeline.append(row);
    }
    renderActions(job);
  }

  function renderActions(job) {
    const replayable = job.state === "quarantined";
    // A running job's cancel is a request: its worker stops it and it ends cancelled.
    const cancellable = ["waiting", "queued", "running", "retry_wait", "quarantined"].includes(job.state);
    $("replay").hidden = !(session.admin && replayable);
    $("cancel").hidden = !(session.admin && cancellable);
    renderResend(job);
    $("actions").hidden = $("replay").hidden && $("cancel").hidden && $("resend").hidden;
  }

  // A queued job whose message was lost (dead-lettered, purged): an admin sends it again.
  function renderResend(job) {
    $("resend").hidden = !(session.admin && job.state === "queued");
  }

  async function act(action, jobId) {
    const reason = $("action-reason").value.trim();
    if ((action === "cancel" || action === "resend") && !reason) {
      say("give a reason to " + action + " (it is kept in the job's timeline)", true);
      $("action-reason").focus();
      return;
    }
    if (!window.confirm(action + " job " + jobId + "?")) return;
    try {
      const body = reason ? { reason: reason } : action === "replay" ? {} : undefined;
      const done = await api("POST", "/v1/jobs/" + encodeURIComponent(jobId) + "/" + action, body);
      $("action-reason").value = "";
      await lookUp(jobId);
      if (done.cancelRequested) {
        say("cancel requested: job " + done.jobId + " is stopped by its worker and ends cancelled");
      } else {
        say(action + " done: job " + done.jobId + " is now " + done.state + " (was " + done.previousState + ")");
      }
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
      note.textContent = "Listing quarantined jobs needs an admin token.";
      return;
    }
    try {
      const data = await api("GET", "/v1/jobs?state=quarantined&limit=200");
      for (const job of data.jobs) {
        const row = window.JR.jobRow(job.jobId, lookUp);
        const buttons = el("td");
        const replay = el("button", "Replay");
        replay.type = "button";
        replay.className = "replay-row";
        replay.setAttribute("aria-label", "Replay job " + job.jobId);
        replay.addEventListener("click", () => act("replay", job.jobId));
        buttons.append(replay);
        row.append(
          wrap("td", window.JR.jobId(job.jobId, lookUp)),
          el("td", job.accountId),
          el("td", job.type),
          el("td", job.attempt + "/" + job.maxAttempts),
          wrap("td", when(job.updatedAt)),
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
  window.JR.reloadQuarantined = loadQuarantined;

  // --- schedules --------------------------------------------------------------------------

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
        if (s.lastJobId) last.append(window.JR.jobId(s.lastJobId, lookUp));
        else last.textContent = "-";
        const state = el("td", s.lastJobId ? s.lastJobState || "pruned" : "-", "state " + (s.lastJobState || ""));
        const buttons = el("td");
        const toggle = el("button", s.paused ? "Resume" : "Pause");
        toggle.type = "button";
        toggle.className = "schedule-toggle";
        toggle.setAttribute("aria-label", (s.paused ? "Resume" : "Pause") + " schedule " + s.name);
        toggle.addEventListener("click", () => setPaused(s.name, !s.paused));
        buttons.append(toggle);
        row.append(
          el("th", s.name),
          el("td", s.cron),
          el("td", s.timezone),
          s.paused ? el("td", "-") : wrap("td", when(s.nextTick)),
          s.lastTick ? wrap("td", when(s.lastTick)) : el("td", "-"),
          last,
          state,
          el("td", s.paused ? "paused by " + s.pausedBy + " (" + s.pausedReason + ")" : "no"),
          el("td", skippedText(s), "reason"),
          buttons,
        );
        row.firstChild.scope = "row";
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
    $("resend").addEventListener("click", () => session.job && act("resend", session.job.jobId));
    $("refresh-quarantine").addEventListener("click", () => loadQuarantined());
    $("refresh-schedules").addEventListener("click", () => loadSchedules());
    $("copy-job-id").addEventListener("click", async () => {
      const copy = $("copy-job-id");
      const done = await window.JR.copyText(copy.dataset.copy || "");
      copy.dataset.copied = done ? copy.dataset.copy : "";
      copy.textContent = done ? "copied" : "copy failed";
    });
    const fromHash = jobInHash();
    // Another job's link followed in this tab (the page is not reloaded for a new hash).
    window.addEventListener("hashchange", () => {
      const wanted = jobInHash();
      if (wanted && !(session.job && session.job.jobId === wanted)) lookUp(wanted);
    });
    (async () => {
      if (session.token) {
        $("token").value = session.token;
        await useToken(session.token);
      }
      if (fromHash) await lookUp(fromHash);
    })();
  });
})();
