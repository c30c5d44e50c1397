// jobrelay console: the hand-off lane of one job, as a pure function of its events (no DOM),
// so the browser draws it and the tests (node) check it. The lane is the FINAL attempt's:
// its claim, the outcome that attempt wrote and how its delivery was settled, each taken
// from the events after that claim, so a job that succeeded on attempt 3 never shows
// attempt 1's ack beside attempt 3's save, and a quarantined job shows its quarantine.
"use strict";

(function (root) {
  const OUTCOMES = { result_saved: "saved", quarantined: "quarantined", retry_scheduled: "retry" };
  const SETTLES = { ack_sent: "acked", rejected: "rejected", settle_lost: "settle lost" };

  // events: [{kind, at, detail}] in timeline order. Returns [{kind, label, at}]: accepted,
  // published, claimed, the outcome and the settle; `at` is null for a stage not reached.
  function handoffLane(events) {
    const list = events || [];
    let lastClaim = -1;
    list.forEach((e, i) => {
      if (e.kind === "claimed") lastClaim = i;
    });
    const after = lastClaim < 0 ? list : list.slice(lastClaim + 1);
    const find = (items, kinds) => items.find((e) => kinds.includes(e.kind)) || null;
    const accepted = find(list, ["accepted"]);
    // The message this claim took: the newest publish before it (or the newest at all).
    const upTo = lastClaim < 0 ? list : list.slice(0, lastClaim);
    const published = upTo.filter((e) => e.kind === "published").pop() || null;
    const outcome = find(after, Object.keys(OUTCOMES));
    const settle = find(after, Object.keys(SETTLES));
    return [
      { kind: "accepted", label: "accepted", at: accepted && accepted.at },
      { kind: "published", label: "published", at: published && published.at },
      { kind: "claimed", label: "claimed", at: lastClaim < 0 ? null : list[lastClaim].at },
      {
        kind: outcome ? outcome.kind : "result_saved",
        label: outcome ? OUTCOMES[outcome.kind] : "saved",
        at: outcome && outcome.at,
      },
      {
        kind: settle ? settle.kind : "ack_sent",
        label: settle ? SETTLES[settle.kind] : "acked",
        at: settle && settle.at,
      },
    ];
  }

  root.JR = root.JR || {};
  root.JR.handoffLane = handoffLane;
  if (typeof module !== "undefined" && module.exports) module.exports = { handoffLane };
})(typeof window !== "undefined" ? window : globalThis);
