// hermes-batch view: the list, the filters and the live refresh. Everything is rendered by the server;
// this script only asks for pages of rows, record fragments and the summary, and follows the run.
"use strict";
(function () {
  const $ = (id) => document.getElementById(id);
  const FIELDS = ["q", "status", "tool", "toolset", "end", "filter", "error", "verdict", "min_reward", "sort"];
  const PAGE = 50;
  let offset = 0, total = 0, generation = null, selected = null, summaryShown = false, summaryGeneration = null;

  function params() {
    const p = new URLSearchParams();
    for (const f of FIELDS) { const v = $(f).value.trim(); if (v) p.set(f, v); }
    if ($("desc").checked) p.set("desc", "1");
    p.set("offset", offset); p.set("limit", PAGE);
    return p;
  }

  function text(tag, cls, value) {
    const el = document.createElement(tag);
    if (cls) el.className = cls;
    el.textContent = value;
    return el;
  }

  async function loadList() {
    const res = await fetch("/api/records?" + params());
    const data = await res.json();
    total = data.total;
    const list = $("list");
    list.replaceChildren();
    for (const row of data.rows) {
      const a = document.createElement("a");
      a.className = "row" + (row.ref === selected ? " selected" : "");
      a.href = "#/" + row.ref;
      a.dataset.ref = row.ref;
      a.dataset.status = row.status;
      const line1 = document.createElement("div");
      line1.className = "line1";
      line1.append(text("span", "st-" + row.status, row.status), text("span", "", "#" + row.prompt_index),
        text("span", "", row.turns + " calls"), text("span", "", row.duration + " s"),
        text("span", "", row.tokens.toLocaleString() + " tok"), text("span", "", row.detail || ""));
      if (row.verdict !== "unscored") line1.append(text("span", "verdict v-" + row.verdict, row.verdict + " " + row.reward));
      a.append(line1, text("div", "prompt", row.preview));
      list.append(a);
    }
    const last = Math.min(offset + data.rows.length, total);
    $("total").textContent = total ? `${offset + 1}–${last} of ${total.toLocaleString()} (${data.elapsed_ms} ms)` : "no match";
    $("prev").disabled = offset === 0;
    $("next").disabled = last >= total;
  }

  async function openRecord(ref) {
    selected = ref;
    for (const row of document.querySelectorAll(".list .row")) row.classList.toggle("selected", row.dataset.ref === ref);
    const res = await fetch("/api/record?ref=" + encodeURIComponent(ref));
    $("detail").innerHTML = await res.text();
  }

  async function loadSummary() {
    const res = await fetch("/api/summary");
    $("pane-summary").innerHTML = await res.text();
    // the server recomputes at most every few seconds: ask again until it covers the latest records
    summaryGeneration = Number(res.headers.get("X-Generation"));
  }

  function fillFacets(facets) {
    // the reward filters only where a verifier ran (--verifier): other runs look as they always did
    $("verdict").hidden = $("min_reward").hidden = !(facets.verdict || []).length;
    for (const select of document.querySelectorAll("select[data-facet]")) {
      const have = new Set([...select.options].map((o) => o.value));
      for (const value of facets[select.dataset.facet] || []) {
        if (!have.has(value)) select.append(new Option(value, value));
      }
    }
  }

  async function poll() {
    try {
      const res = await fetch("/api/state");
      if (res.status === 403) {  // another start of the viewer: its token is not the one this page got
        $("live").textContent = "refused: open the URL hermes-batch view printed";
        return;
      }
      const state = await res.json();
      $("live").textContent = `${state.counts.kept.toLocaleString()} kept · ${state.counts.discarded.toLocaleString()} discarded · ` +
        `${state.counts.failed.toLocaleString()} failure records · live`;
      fillFacets(state.facets);
      if (state.generation !== generation) {
        const first = generation === null;
        generation = state.generation;
        if (!first) await loadList();
      }
      if (summaryShown && summaryGeneration !== generation) await loadSummary();
    } catch (e) {
      $("live").textContent = "viewer stopped";
    }
  }

  function restart() { offset = 0; loadList(); }
  let timer = null;
  $("q").addEventListener("input", () => { clearTimeout(timer); timer = setTimeout(restart, 250); });
  for (const f of FIELDS.slice(1)) $(f).addEventListener("change", restart);
  $("desc").addEventListener("change", restart);
  $("prev").addEventListener("click", () => { offset = Math.max(0, offset - PAGE); loadList(); });
  $("next").addEventListener("click", () => { offset += PAGE; loadList(); });
  window.addEventListener("hashchange", () => { if (location.hash.startsWith("#/")) openRecord(decodeURIComponent(location.hash.slice(2))); });
  function tab(name) {
    summaryShown = name === "summary";
    $("tab-records").classList.toggle("on", !summaryShown);
    $("tab-summary").classList.toggle("on", summaryShown);
    $("pane-records").hidden = summaryShown;
    $("pane-summary").hidden = !summaryShown;
    if (summaryShown && summaryGeneration !== generation) loadSummary();
  }
  $("tab-records").addEventListener("click", () => tab("records"));
  $("tab-summary").addEventListener("click", () => tab("summary"));

  // The run's controls (hermes-batch ctl), through the viewer: shown while a run listens in the folder.
  function showControl(answer) {
    const st = answer.status;
    const live = answer.listening && st;
    $("control").classList.toggle("off", !live);
    for (const id of ["ctl-pause", "ctl-resume", "ctl-set-workers", "ctl-set-max-cost", "ctl-stop"]) $(id).disabled = !live;
    if (!live) { $("control-state").textContent = answer.ok === false && answer.listening ? answer.error : "no run listening"; return; }
    $("control-state").textContent = `${st.paused ? "paused" : "running"} · ${st.running} of ${st.workers} workers · ` +
      `${st.model_calls} calls · $${Number(st.cost).toFixed(4)}` + (st.max_cost !== null ? ` of $${st.max_cost}` : "");
    $("ctl-workers").max = st.max_workers;
    if (document.activeElement !== $("ctl-workers")) $("ctl-workers").value = st.workers;
    if (document.activeElement !== $("ctl-max-cost")) $("ctl-max-cost").value = st.max_cost === null ? "" : st.max_cost;
  }
  async function control(command, value) {
    const init = command ? {method: "POST", headers: {"Content-Type": "application/json", "X-Hermes-Batch-Control": "1"},
                            body: JSON.stringify({command, value})} : undefined;
    try {
      const res = await fetch("/api/control", init);
      const answer = await res.json();
      if (answer.ok === false && answer.listening !== false) { $("control-state").textContent = answer.error; return; }
      showControl(answer);
    } catch (e) { showControl({listening: false}); }
  }
  $("ctl-pause").addEventListener("click", () => control("pause"));
  $("ctl-resume").addEventListener("click", () => control("resume"));
  $("ctl-stop").addEventListener("click", () => control("stop"));
  $("ctl-set-workers").addEventListener("click", () => control("workers", $("ctl-workers").value));
  $("ctl-set-max-cost").addEventListener("click", () => control("max_cost", $("ctl-max-cost").value));
  control();
  setInterval(() => control(), 2000);

  poll().then(loadList).then(() => {
    if (location.hash.startsWith("#/")) openRecord(decodeURIComponent(location.hash.slice(2)));
  });
  setInterval(poll, 1500);
})();
