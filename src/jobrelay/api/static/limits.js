// jobrelay console: the limits panel (GET /v1/limits?top=10, admin). Per limit (a job type's,
// or its name=): the value in force and where it comes from, its totals (running, waiting for
// admission, the oldest wait), then its keys with the most waiting, the rest counted. The
// server groups and bounds the rows; keys are the jobs' own data and are written as text.
// An override is set or cleared through PUT/DELETE /v1/limits/{name}, with a reason (required,
// as by the CLI), audited under the token.
"use strict";

(function () {
  const { session, $, el, duration, api } = window.JR;
  const TOP = 10;

  // "2", "10/s burst 10", "30/min burst 1": a rate in the unit its people wrote it in.
  function value(v) {
    if (!v) return "-";
    if (v.max !== null && v.max !== undefined) return String(v.max);
    if (v.perSecond === null || v.perSecond === undefined) return "-";
    const round = (n) => String(Math.round(n * 1000) / 1000);
    const rate = v.perSecond >= 1 ? round(v.perSecond) + "/s"
      : v.perSecond * 60 >= 1 ? round(v.perSecond * 60) + "/min" : round(v.perSecond * 3600) + "/h";
    return v.burst === null || v.burst === undefined ? rate : rate + " burst " + round(v.burst);
  }

  function overrideText(o, whose) {
    return value({ max: o.max, perSecond: o.max === null ? o.perSecond : null, burst: o.burst })
      + " (override" + whose + " by " + o.changedBy + ": " + o.reason + ")";
  }

  // Kinds that only order the admission (fair between keys, a prioritized queue): no value.
  function ordering(kind) {
    return kind === "fair" || kind === "priority";
  }

  // The group's line: what its jobs declared, and the whole limit's override if one applies.
  function groupValue(g) {
    const declared = g.declared.length ? g.declared.map(value).join(" or ") : "none declared by a waiting or running job";
    if (!g.override) return g.kind === "fair" ? "fair between keys" : g.kind === "priority" ? "by priority" : declared;
    return overrideText(g.override, " of the whole limit") + "; declared " + declared;
  }

  function rowValue(r) {
    if (!r.override) return ordering(r.kind) ? "-" : value(r.declared);
    const own = r.override.key === r.key && r.key !== null;
    return value(r.current) + (own ? " (override by " + r.override.changedBy + ": " + r.override.reason + ")" : " (the whole limit's override)");
  }

  function age(seconds, since) {
    const cell = el("td", seconds === null || seconds === undefined ? "-" : duration(seconds), "num age");
    if (since) cell.title = "waiting since " + since;
    return cell;
  }

  // A row's button fills the override form with its limit and key (and the value in force).
  function pick(limit, key, current) {
    const cell = el("td");
    const button = el("button", "Override…", "override-pick");
    button.type = "button";
    button.setAttribute("aria-label", "Override limit " + limit + (key === null ? "" : " key " + key));
    button.addEventListener("click", () => {
      $("override-name").value = limit;
      $("override-key").value = key === null ? "" : key;
      const max = current && current.max !== null && current.max !== undefined;
      $("override-concurrency").value = max ? String(current.max) : "";
      $("override-rate").value = "";
      $("override-burst").value = "";
      $("override-status").textContent = "";
      $(max || !current ? "override-concurrency" : "override-rate").focus();
    });
    cell.append(button);
    return cell;
  }

  function render(data) {
    const table = $("limit-list");
    for (const body of Array.from(table.tBodies)) body.remove();
    const rows = new Map();
    for (const r of data.limits) {
      const at = r.limit + "\u001f" + r.kind;
      if (!rows.has(at)) rows.set(at, []);
      rows.get(at).push(r);
    }
    for (const g of data.groups) {
      const body = el("tbody");
      body.dataset.limit = g.limit;
      body.dataset.kind = g.kind;
      const head = el("tr", null, "limit-total");
      const name = el("th", g.limit);
      name.scope = "rowgroup";
      head.append(
        name,
        el("td", g.kind + (g.keys ? ", " + g.keys + " key" + (g.keys === 1 ? "" : "s") : "")),
        el("td", groupValue(g), "reason"),
        el("td", g.running, "num running"),
        el("td", g.waiting, "num waiting"),
        age(g.waitingSeconds, g.waitingSince),
        ordering(g.kind) ? el("td") : pick(g.limit, null, g.override ? { max: g.override.max } : g.declared[0]),
      );
      body.append(head);
      for (const r of rows.get(g.limit + "\u001f" + g.kind) || []) {
        const row = el("tr", null, "limit-key");
        row.dataset.key = r.key === null ? "" : r.key;
        const key = el("th", r.key === null ? "(no key)" : r.key, "key");
        key.scope = "row";
        row.append(key, el("td", ""), el("td", rowValue(r), "reason"), el("td", r.running, "num running"), el("td", r.waiting, "num waiting"), age(r.waitingSeconds, r.waitingSince));
        if (r.key !== null && !ordering(r.kind)) row.append(pick(r.limit, r.key, r.current));
        else row.append(el("td"));
        body.append(row);
      }
      if (g.otherKeys > 0) {
        const rest = el("tr", null, "limit-rest");
        const cell = el("td", "and " + g.otherKeys + " more key" + (g.otherKeys === 1 ? "" : "s") + " (fewer waiting)", "muted");
        cell.colSpan = 3;
        rest.append(cell, el("td", g.otherRunning, "num running"), el("td", g.otherWaiting, "num waiting"), el("td", ""), el("td", ""));
        body.append(rest);
      }
      table.append(body);
    }
  }

  async function load() {
    const table = $("limit-list");
    const note = $("limits-note");
    $("limit-override").hidden = !session.admin;
    if (!session.admin) {
      table.hidden = true;
      note.textContent = "Limits need an admin token.";
      return;
    }
    try {
      const data = await api("GET", "/v1/limits?top=" + TOP);
      render(data);
      table.hidden = data.groups.length === 0;
      note.textContent = data.groups.length === 0
        ? "No limits in use: no unfinished job is under a limit, and no limit is overridden. A limit declared in code shows here once a job under it is enqueued."
        : data.groups.length + " limit(s); under each, its " + TOP + " keys with the most waiting. Updated " + new Date().toLocaleTimeString() + ".";
      $("limits").dataset.loaded = "true";
    } catch (error) {
      table.hidden = true;
      note.textContent = "Could not list the limits: " + error.message;
    }
  }

  // Set (PUT) or clear (DELETE) the override the form names; the reason is required first,
  // as the CLI's --reason; the server checks the rest (one of concurrency and rate, …).
  async function change(clear) {
    const status = $("override-status");
    const name = $("override-name").value.trim();
    const key = $("override-key").value;
    const reason = $("override-reason").value.trim();
    const target = "limit " + name + (key ? " key " + key : " (the whole limit)");
    if (!name) {
      status.textContent = "name the limit (or press Override… on its row)";
      $("override-name").focus();
      return;
    }
    if (!reason) {
      status.textContent = "give a reason to " + (clear ? "clear" : "set") + " an override (it is kept in the audit)";
      $("override-reason").focus();
      return;
    }
    const path = "/v1/limits/" + encodeURIComponent(name);
    try {
      if (clear) {
        if (!window.confirm("clear the override of " + target + "?")) return;
        await api("DELETE", path + (key ? "?key=" + encodeURIComponent(key) : ""), { reason: reason });
        status.textContent = "override of " + target + " cleared: the declared value holds from the relay's next round";
      } else {
        const body = { reason: reason };
        if (key) body.key = key;
        const concurrency = $("override-concurrency").value.trim();
        const rate = $("override-rate").value.trim();
        const burst = $("override-burst").value.trim();
        if (concurrency) body.concurrency = Number(concurrency);
        if (rate) body.rate = rate;
        if (burst) body.burst = Number(burst);
        if (!window.confirm("override " + target + "?")) return;
        const done = await api("PUT", path, body);
        status.textContent = target + " overridden: " + value({ max: done.max, perSecond: done.max === null ? done.perSecond : null, burst: done.burst }) + " from the relay's next round";
      }
      $("override-reason").value = "";
    } catch (error) {
      status.textContent = (clear ? "clear" : "override") + " refused: " + error.message;
    }
    await load();
  }

  window.JR.onToken(load);

  document.addEventListener("DOMContentLoaded", () => {
    $("refresh-limits").addEventListener("click", () => load());
    $("override-set").addEventListener("click", () => change(false));
    $("override-clear").addEventListener("click", () => change(true));
  });
})();
