// jobrelay console: the live overview (GET /v1/overview every few seconds) and the queues
// (pause and resume). The chart is uPlot, vendored under /console/vendor/ (no CDN).
"use strict";

(function () {
  const { session, $, el, ago, duration, api } = window.JR;
  const REFRESH_MS = 5000;
  const SERIES = [
    ["accepted", "accepted", "series-accepted"],
    ["succeeded", "succeeded", "series-succeeded"],
    ["retried", "retried", "series-retried"],
    ["quarantined", "quarantined", "series-quarantined"],
  ];
  let timer = null;
  let chart = null;

  function colour(name) {
    return getComputedStyle(document.documentElement).getPropertyValue("--" + name).trim() || "#888";
  }

  // The jobs list filtered by one value (jobs.js reads the address): #jobs?type=report.export
  function listLink(key, value, text) {
    const link = el("a", text === undefined ? value : text, "list-link");
    link.href = "#jobs?" + new URLSearchParams({ [key]: value }).toString();
    link.addEventListener("click", () => {
      // The address already names this list (its controls since edited): list it again.
      if (location.hash === link.hash) window.dispatchEvent(new HashChangeEvent("hashchange"));
    });
    return link;
  }

  function countTable(id, counts, label, key) {
    const body = $(id).tBodies[0];
    body.replaceChildren();
    const entries = Object.entries(counts).sort((a, b) => b[1] - a[1]);
    for (const [name, n] of entries) {
      const row = el("tr");
      row.dataset.name = name;
      const th = el("th");
      th.scope = "row";
      th.append(listLink(key, name));
      row.append(th, el("td", n, "num"));
      body.append(row);
    }
    if (!entries.length) {
      const row = el("tr");
      const td = el("td", "no jobs", "muted");
      td.colSpan = 2;
      row.append(td);
      body.append(row);
    }
    $(id).setAttribute("aria-label", label);
  }

  function drawChart(flow) {
    const xs = flow.minutes.map((m) => Date.parse(m) / 1000);
    const data = [xs, ...SERIES.map(([key]) => flow[key])];
    const box = $("throughput-chart");
    const width = Math.max(280, box.clientWidth || 600);
    const totals = SERIES.map(([key, label]) => flow[key].reduce((a, b) => a + b, 0) + " " + label);
    $("throughput-summary").textContent = "Last hour: " + totals.join(", ") + ".";
    if (typeof window.uPlot !== "function") {
      box.textContent = "(chart library not loaded)";
      return;
    }
    if (chart && chart.width === width) {
      chart.setData(data);
      return;
    }
    if (chart) chart.destroy();
    chart = new window.uPlot(
      {
        width: width,
        height: 220,
        series: [{}, ...SERIES.map(([, label, css]) => ({ label: label, stroke: colour(css), width: 2, points: { show: false } }))],
        axes: [
          { stroke: colour("text"), grid: { stroke: colour("grid") } },
          { stroke: colour("text"), grid: { stroke: colour("grid") }, label: "per minute" },
        ],
        scales: { x: { time: true } },
        legend: { live: false },
      },
      data,
      box,
    );
  }

  function renderQueues(rows, error) {
    const body = $("queue-list").tBodies[0];
    body.replaceChildren();
    const count = (n) => (n === null || n === undefined ? "unknown" : String(n));
    for (const q of rows) {
      const row = el("tr");
      row.dataset.queue = q.queue;
      row.dataset.paused = String(q.paused);
      const th = el("th");
      th.scope = "row";
      th.append(listLink("queue", q.queue));
      const buttons = el("td");
      const toggle = el("button", q.paused ? "Resume" : "Pause");
      toggle.type = "button";
      toggle.className = "queue-toggle";
      toggle.setAttribute("aria-label", (q.paused ? "Resume" : "Pause") + " queue " + q.queue);
      toggle.addEventListener("click", () => setPaused(q.queue, !q.paused));
      buttons.append(toggle);
      row.append(
        th,
        el("td", count(q.ready), "num"),
        el("td", count(q.consumers), "num"),
        el("td", count(q.inFlight), "num"),
        el("td", q.paused ? "paused " + ago(q.pausedAt) + " by " + q.pausedBy + " (" + q.pausedReason + ")" : "consuming"),
        buttons,
      );
      body.append(row);
    }
    $("queues-error").textContent = error ? "Broker counts unknown: " + error : "";
  }

  function renderProcesses(processes) {
    const body = $("process-list").tBodies[0];
    body.replaceChildren();
    for (const p of processes) {
      const row = el("tr");
      row.dataset.role = p.role;
      row.dataset.status = p.status;
      if (p.status === "gone") row.className = "gone";
      const th = el("th", p.id);
      th.scope = "row";
      // Seen: the server's verdict (it knows the heartbeat interval), the time from the row.
      const seen = el("td", null, "last-seen");
      if (p.status === "gone") seen.append("gone since ", window.JR.when(p.lastSeenAt));
      else seen.textContent = ago(p.lastSeenAt);
      row.append(th, el("td", p.role), el("td", p.host), el("td", p.pid, "num"), el("td", p.queues.join(", ") || "-"), el("td", ago(p.startedAt)), seen);
      body.append(row);
    }
    if (!processes.length) {
      const row = el("tr");
      const td = el("td", "no worker or relay has been seen lately", "muted");
      td.colSpan = 7;
      row.append(td);
      body.append(row);
    }
  }

  function renderFindings(reconciler) {
    const found = Object.entries(reconciler.counts).filter(([, n]) => n > 0);
    $("reconciler-summary").textContent = found.length
      ? found.map(([kind, n]) => n + " " + kind.replace("_", " ")).join(", ")
      : "Nothing fell between two hand-offs.";
    const list = $("reconciler-findings");
    list.replaceChildren();
    for (const f of reconciler.findings) {
      const item = el("li");
      item.dataset.kind = f.kind;
      item.append(el("strong", f.kind + " "));
      if (f.jobId) item.append(window.JR.jobLink(f.jobId, window.JR.open), " ");
      item.append(el("span", f.detail, "reason"));
      list.append(item);
    }
  }

  async function refresh() {
    if (!session.admin) return;
    try {
      const view = await api("GET", "/v1/overview");
      const byState = view.counts.byState;
      const cards = $("state-counts");
      cards.replaceChildren();
      for (const state of ["waiting", "queued", "running", "retry_wait", "succeeded", "quarantined", "cancelled"]) {
        const card = listLink("state", state, null);
        card.className = "card state-card " + state;
        card.dataset.state = state;
        card.setAttribute("aria-label", (byState[state] || 0) + " " + state.replace("_", " ") + ": list them");
        card.append(el("span", byState[state] || 0, "big"), el("span", state.replace("_", " ")));
        cards.append(card);
      }
      countTable("type-counts", view.counts.byType, "jobs per type", "type");
      countTable("queue-counts", view.counts.byQueue, "jobs per queue", "queue");
      drawChart(view.throughput);
      const out = view.outbox;
      $("outbox-backlog").textContent = String(out.backlog);
      $("outbox-oldest").textContent = out.oldestAt ? duration(out.oldestAgeSeconds) : "none waiting";
      $("relay-lag").textContent = out.lagSampled
        ? duration(out.lagMedianSeconds) + " median, " + duration(out.lagMaxSeconds) + " max (last " + out.lagSampled + ")"
        : "nothing published yet";
      renderQueues(view.queues, view.queuesError);
      renderProcesses(view.processes);
      renderFindings(view.reconciler);
      $("overview-updated").textContent = "Updated " + new Date(view.generatedAt).toLocaleTimeString() + "; " + view.counts.total + " jobs in all.";
      $("overview").dataset.loaded = "true";
    } catch (error) {
      $("overview-updated").textContent = "Could not load the overview: " + error.message;
    }
  }

  async function setPaused(queue, pause) {
    const action = pause ? "pause" : "resume";
    const reason = $("queue-reason").value.trim();
    const note = $("queues-note");
    if (!reason) {
      note.textContent = "give a reason to " + action + " queue " + queue + " (it is kept in the audit)";
      $("queue-reason").focus();
      return;
    }
    if (!window.confirm(action + " queue " + queue + "?")) return;
    try {
      const done = await api("POST", "/v1/queues/" + encodeURIComponent(queue) + "/" + action, { reason: reason });
      $("queue-reason").value = "";
      note.textContent = action + " done: " + done.queue + (done.paused ? " is paused; its messages wait in the broker" : " is consumed again");
    } catch (error) {
      note.textContent = action + " refused: " + error.message;
    }
    await refresh();
  }

  window.JR.onToken(async () => {
    if (timer) clearInterval(timer);
    timer = null;
    $("overview-body").hidden = !session.admin;
    $("queues-body").hidden = !session.admin;
    $("overview-note").hidden = session.admin;
    $("queues-admin-note").hidden = session.admin;
    if (!session.admin) return;
    await refresh();
    timer = setInterval(refresh, REFRESH_MS);
  });

  document.addEventListener("DOMContentLoaded", () => {
    $("refresh-overview").addEventListener("click", () => refresh());
    window.addEventListener("resize", () => {
      if (chart && $("throughput-chart").clientWidth && Math.abs(chart.width - $("throughput-chart").clientWidth) > 20) refresh();
    });
  });
})();
