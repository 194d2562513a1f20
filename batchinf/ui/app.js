// batchinf dashboard: plain JS + SVG over the /v1 API, no build step. The tenant's token lives in
// sessionStorage and goes out as the bearer header. A view builds its frame once and each poll (every
// 2 s while something on it is active) refills the frame's parts in place; navigating away, or the
// job reaching a terminal state, stops the polling.
"use strict";

const TOKEN_KEY = "batchinf.token";
const POLL_MS = 2000;
const ACTIVE = new Set(["submitted", "planning", "planned", "running", "verifying", "cancelling"]);
const COLORS = { committed: "#2e9d5b", running: "#2f6fde", retried: "#e0a100", failed: "#b0172b", lost: "#d2452f",
  released: "#6b8fb8", quarantined: "#8e44ad", superseded: "#9aa3b2" };
const OUTCOMES = Object.keys(COLORS);
const CANCELLED = "#138a8a";
const STATUSES = ["submitted", "planning", "planned", "running", "verifying", "succeeded", "failed", "cancelling",
  "cancelled", "expired"];
const PAGE = 20;
let timer = null;
let gen = 0;          // bumped by every render; a fetch that an older render started is dropped
let errorCode = "";
let armed = null;     // the job whose cancel button has had its first click
let cursors = [];     // the jobs list's earlier pages, for "Previous"

function el(tag, attrs, ...children) {
  const node = tag === "svg" || attrs && attrs.svg ? document.createElementNS("http://www.w3.org/2000/svg", tag)
    : document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "svg" || v === null || v === undefined) continue;
    if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, v);
  }
  for (const c of children.flat(Infinity)) if (c !== null && c !== undefined) node.append(c instanceof Node ? c : String(c));
  return node;
}
const s = (tag, attrs, ...children) => el(tag, { ...attrs, svg: true }, ...children);

function fmt(v, digits = 0) {
  if (v === null || v === undefined) return "–";
  return Number(v).toLocaleString("en-US", { maximumFractionDigits: digits, minimumFractionDigits: digits });
}
function dur(sec) {
  if (sec === null || sec === undefined) return "–";
  sec = Math.round(sec);
  const h = Math.floor(sec / 3600), m = Math.floor(sec % 3600 / 60), x = sec % 60;
  return h ? `${h}h ${m}m` : m ? `${m}m ${x}s` : `${x}s`;
}
const when = (t) => t ? new Date(t * 1000).toLocaleString() : "–";

class Unauthorized extends Error {}

async function api(path, options = {}) {
  const r = await fetch(path, { ...options, headers: { ...(options.headers || {}),
    "Authorization": "Bearer " + sessionStorage.getItem(TOKEN_KEY), "Content-Type": "application/json" } });
  if (r.status === 401) throw new Unauthorized((await r.json()).message);
  const body = await r.json();
  if (!r.ok) throw new Error(body.message || r.statusText);
  return body;
}

async function allPages(path) {
  const items = [];
  while (path) { const page = await api(path); items.push(...page.items); path = page.next; }
  return items;
}

function show(...nodes) {
  const main = document.getElementById("main");
  delete main.dataset.view;
  main.replaceChildren(...nodes.filter((n) => n !== null && n !== undefined));
}

// the view's frame, built once per page (key); later polls only refill its parts
function frame(key, build) {
  const main = document.getElementById("main");
  if (main.dataset.view === key) return false;
  show(...build());
  main.dataset.view = key;
  return true;
}
function fill(id, ...nodes) {
  document.getElementById(id).replaceChildren(...nodes.flat(Infinity).filter((n) => n !== null && n !== undefined));
}
// refill only when what it shows changed, so a focused or half-clicked control survives a poll
function fillIf(id, sig, build) {
  const box = document.getElementById(id);
  if (box.dataset.sig === sig) return;
  box.dataset.sig = sig;
  fill(id, build());
}
const plural = (n, word) => `${fmt(n)} ${word}${n === 1 ? "" : "s"}`;
// a long value (URI, name): one line cut with an ellipsis, the whole of it in the tooltip
const clip = (v, attrs = {}) => el("span", { class: "clip", title: v, ...attrs }, v);

function signIn(message) {
  sessionStorage.removeItem(TOKEN_KEY);
  document.getElementById("signout").hidden = true;
  const input = el("input", { id: "token", type: "password", placeholder: "bi_…", autocomplete: "off" });
  show(el("form", { class: "signin", id: "signin", onsubmit: async (e) => {
    e.preventDefault();
    sessionStorage.setItem(TOKEN_KEY, input.value.trim());
    route();
  } }, el("h1", {}, "Sign in"),
  el("label", { for: "token" }, "API token (from ", el("code", {}, "batchinf token create --tenant NAME"), ")"),
  input, el("button", { type: "submit" }, "Sign in"),
  message ? el("p", { class: "error", id: "signin-error" }, message) : null));
}

function progressBar(st) {
  const total = st.counts.records_total, c = st.counts;
  const ok = total ? c.records_succeeded / total * 100 : 0, bad = total ? c.records_failed / total * 100 : 0;
  return el("span", { class: `bar ${st.status}`, "data-field": "progress",
    title: `${fmt(c.records_done)} of ${fmt(total)} records${st.status === "cancelled" ? " (cancelled)" : ""}` },
  el("span", { style: `width:${ok}%` }), el("span", { class: "err", style: `left:${ok}%;width:${bad}%` }));
}

function listQuery() {
  const q = new URLSearchParams((location.hash || "#/").replace(/^#\/\??/, ""));
  const limit = Math.min(100, Math.max(1, parseInt(q.get("limit"), 10) || PAGE));
  return { status: STATUSES.includes(q.get("status")) ? q.get("status") : "", name: q.get("name") || "",
    cursor: /^[A-Za-z0-9_-]+$/.test(q.get("cursor") || "") ? q.get("cursor") : "", limit };
}
function listHash(q) {
  const p = new URLSearchParams();
  for (const k of ["status", "name", "cursor"]) if (q[k]) p.set(k, q[k]);
  if (q.limit !== PAGE) p.set("limit", q.limit);
  const text = p.toString();
  return text ? "#/?" + text : "#/";
}

async function jobsView() {
  const q = listQuery();
  const p = new URLSearchParams({ limit: q.limit });
  if (q.status) p.set("status", q.status);
  if (q.name) p.set("name_contains", q.name);
  if (q.cursor) p.set("cursor", q.cursor);
  const page = await api("/v1/jobs?" + p);
  return () => {
    frame(location.hash || "#/", () => {
      const status = el("select", { id: "filter-status", "aria-label": "status" }, el("option", { value: "" }, "any status"),
        STATUSES.map((v) => { const o = el("option", { value: v }, v); if (v === q.status) o.selected = true; return o; }));
      const name = el("input", { id: "filter-name", type: "search", placeholder: "name contains…", value: q.name,
        maxlength: 200, "aria-label": "name contains" });
      return [el("h1", {}, "Jobs"),
        el("form", { class: "toolbar wrap", id: "filters", onsubmit: (e) => {
          e.preventDefault();
          cursors = [];
          location.hash = listHash({ ...q, status: status.value, name: name.value.trim(), cursor: "" });
        } }, status, name, el("button", { type: "submit" }, "Filter"),
        q.status || q.name ? el("a", { href: listHash({ limit: q.limit }), id: "filter-clear" }, "clear") : null),
        el("div", { class: "scroll" }, el("table", { id: "jobs" },
          el("thead", {}, el("tr", {}, ["job", "name", "status", "progress (records)", "records/s", "ETA", "created"]
            .map((h, i) => el("th", { class: [h.includes("/s") || h === "ETA" ? "num" : "", i > 3 || !i ? "opt" : ""]
              .join(" ").trim() || null }, h)))),
          el("tbody", { id: "jobs-body" }))),
        el("div", { class: "toolbar", id: "pager" })];
    });
    fill("jobs-body", page.items.length ? page.items.map((j) => el("tr", { "data-job": j.job_id },
      el("td", { class: "nowrap opt" }, el("a", { href: `#/jobs/${j.job_id}` }, j.job_id)),
      el("td", { class: "name" }, el("a", { href: `#/jobs/${j.job_id}` }, clip(j.name))),
      el("td", {}, el("span", { class: `badge ${j.status}`, "data-field": "status" }, j.status)),
      el("td", { class: "nowrap" }, progressBar(j), " ", el("span", { "data-field": "records_done" }, fmt(j.counts.records_done)),
        " / ", fmt(j.counts.records_total)),
      el("td", { class: "num opt", "data-field": "records_per_second" }, fmt(j.progress.records_per_second, 1)),
      el("td", { class: "num opt" }, dur(j.progress.eta_seconds)),
      el("td", { class: "nowrap opt" }, when(j.created_at))))
      : el("tr", {}, el("td", { colspan: 7, class: "muted" }, q.status || q.name ? "No job matches." : "No jobs yet.")));
    fill("pager",
      el("button", { id: "prev", disabled: q.cursor ? null : "", onclick: () => {
        location.hash = listHash({ ...q, cursor: cursors.pop() || "" });
      } }, "‹ Previous"),
      el("span", { class: "muted", id: "page-info" }, `page ${cursors.length + 1} · ${plural(page.items.length, "job")}`),
      el("button", { id: "next", disabled: page.next_cursor ? null : "", onclick: () => {
        cursors.push(q.cursor);
        location.hash = listHash({ ...q, cursor: page.next_cursor });
      } }, "Next ›"));
    return page.items.some((j) => ACTIVE.has(j.status));
  };
}

function card(title, pairs) {
  return el("div", { class: "card" }, el("h3", {}, title), el("dl", {}, pairs.map(([k, v, field]) =>
    [el("dt", {}, k), el("dd", { "data-field": field || null }, v)])));
}

// one time axis for the shard timeline and the throughput chart: same start, end and x scale
const W = 1100, LEFT = 170, RIGHT = 16;
function timeAxis(attempts, st, series) {
  const now = Date.now() / 1000;
  const end = (a) => a.finished_at || a.heartbeat_at || (ACTIVE.has(st.status) ? now : a.started_at);
  const t0 = Math.min(series.start, ...attempts.map((a) => a.started_at));
  const t1 = Math.max(series.end, ...attempts.map(end), st.finished_at || 0, t0 + 1);
  const x = (t) => LEFT + (t - t0) / (t1 - t0) * (W - LEFT - RIGHT);
  const span = t1 - t0, want = span / 6;
  const steps = [1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 14400, 21600, 43200, 86400];
  const step = steps.find((v) => v >= want) || Math.ceil(want / 86400) * 86400;
  const ticks = [];
  for (let k = 0; k * step <= span + 1e-9; k++) ticks.push(k * step);
  return { t0, t1, x, end, ticks };
}
function tickLabel(sec) {
  const h = Math.floor(sec / 3600), m = Math.floor(sec % 3600 / 60), x = Math.round(sec % 60);
  if (h) return m ? `${h}h ${m}m` : `${h}h`;
  if (m) return x ? `${m}m ${x}s` : `${m}m`;
  return `${x}s`;
}
function axisTicks(svg, ax, top, bottom) {
  for (const t of ax.ticks) {
    const xt = ax.x(ax.t0 + t);
    svg.append(s("line", { x1: xt, x2: xt, y1: top, y2: bottom, stroke: "#eef0f4", class: "grid" }));
    const anchor = xt < LEFT + 20 ? "start" : xt > W - 40 ? "end" : "middle";
    svg.append(s("text", { x: xt, y: bottom + 13, "font-size": 11, fill: "#6b7385", "text-anchor": anchor,
      class: "tick", "data-x": xt.toFixed(2) }, tickLabel(t)));
  }
}
function chartSvg(id, H, ax) {
  return s("svg", { id, width: W, height: H, viewBox: `0 0 ${W} ${H}`, role: "img", "data-t0": ax.t0, "data-t1": ax.t1 });
}

function timeline(attempts, st, ax) {
  const lane = 22, top = 8;
  const workers = [...new Set(attempts.map((a) => a.worker))].sort();
  const bottom = top + Math.max(1, workers.length) * lane;
  const svg = chartSvg("timeline", bottom + 20, ax);
  axisTicks(svg, ax, top, bottom);
  workers.forEach((w, i) => {
    svg.append(s("text", { x: 4, y: top + i * lane + 15, "font-size": 11, fill: "#444" },
      w.length > 26 ? "…" + w.slice(-25) : w, s("title", {}, w)));
    svg.append(s("line", { x1: LEFT, x2: W - RIGHT, y1: top + i * lane + lane - 1, y2: top + i * lane + lane - 1,
      stroke: "#eef0f4" }));
  });
  for (const a of attempts) {
    const y = top + workers.indexOf(a.worker) * lane + 3;
    const x0 = ax.x(a.started_at), width = Math.max(2, ax.x(ax.end(a)) - x0);
    svg.append(s("rect", { x: x0, y, width, height: lane - 7, rx: 2, class: `attempt ${a.outcome}`,
      fill: COLORS[a.outcome] || "#999", "data-outcome": a.outcome, "data-shard": a.shard_id },
    s("title", {}, `${a.shard_id} attempt ${a.number} (bucket ${a.bucket}, shard ${a.shard_ordinal}): ` +
      `${a.outcome}, ${dur(ax.end(a) - a.started_at)}${a.error ? " — " + a.error : ""}`)));
  }
  if (st.status === "cancelled" && st.finished_at) {      // where the cancel stopped the job
    const xc = ax.x(st.finished_at);
    svg.append(s("line", { x1: xc, x2: xc, y1: top - 4, y2: bottom, stroke: CANCELLED, "stroke-width": 2,
      class: "cancelled" }, s("title", {}, `cancelled at +${dur(st.finished_at - ax.t0)}`)));
  }
  return svg;
}

function throughputChart(series, ax) {
  const H = 150, top = 8, bottom = H - 20, pts = series.points;
  const max = Math.max(...pts.map((p) => p.records_per_second), 1e-9);
  const svg = chartSvg("throughput", H, ax);
  axisTicks(svg, ax, top, bottom);
  pts.forEach((p) => {
    const h = p.records_per_second / max * (bottom - top);
    const x0 = ax.x(p.t), x1 = ax.x(p.t + series.interval_seconds);
    svg.append(s("rect", { x: x0 + 0.5, y: bottom - h, width: Math.max(1, x1 - x0 - 1), height: h,
      fill: "#2f6fde", "data-records": p.records },
    s("title", {}, `+${dur(p.t - ax.t0)}: ${fmt(p.records)} records, ${fmt(p.records_per_second, 1)}/s`)));
  });
  svg.append(s("line", { x1: LEFT, x2: W - RIGHT, y1: bottom, y2: bottom, stroke: "#c9ced8" }));
  svg.append(s("text", { x: LEFT - 6, y: top + 10, "font-size": 11, fill: "#6b7385", "text-anchor": "end" },
    `${fmt(max, 1)} rec/s`));
  svg.append(s("text", { x: LEFT - 6, y: bottom, "font-size": 11, fill: "#6b7385", "text-anchor": "end" }, "0"));
  return svg;
}

function jobFrame(id) {
  const part = (tag, pid, attrs = {}) => el(tag, { id: pid, ...attrs });
  return [part("h1", "job-head", { class: "wrap" }), part("div", "job-error-box"), part("div", "actions", { class: "toolbar wrap" }),
    part("div", "cards", { class: "cards" }),
    part("h2", "timeline-title"),
    el("div", { class: "legend" }, OUTCOMES.map((o) => el("span", {}, el("i", { style: `background:${COLORS[o]}` }), o)),
      el("span", {}, el("i", { style: `background:${CANCELLED}` }), "cancelled (job stopped)")),
    part("div", "timeline-box", { class: "chart" }),
    el("h2", {}, "Throughput ", el("span", { class: "muted" }, "(records committed per second, same time axis)")),
    part("div", "throughput-box", { class: "chart" }),
    el("h2", {}, "Errors"),
    part("div", "error-codes-box", { class: "scroll narrow" }),
    part("div", "error-filter-box", { class: "toolbar wrap" }),
    el("div", { class: "scroll" }, el("table", { id: "errors" }, el("thead", {}, el("tr", {},
      ["record", "source", "line", "code", "message"].map((h) => el("th", {}, h)))), part("tbody", "errors-body")))];
}

function setCode(code) { errorCode = code; route(); }

async function jobView(id) {
  const st = await api(`/v1/jobs/${id}`);
  const [attempts, series, errors] = await Promise.all([
    allPages(`/v1/jobs/${id}/attempts?limit=1000`), api(`/v1/jobs/${id}/throughput?points=60`),
    api(`/v1/jobs/${id}/errors?limit=200${errorCode ? "&code=" + encodeURIComponent(errorCode) : ""}`)]);
  return () => {
    const c = st.counts, t = st.tokens, p = st.progress;
    const active = ACTIVE.has(st.status);
    frame(location.hash, () => jobFrame(id));
    fill("job-head", clip(st.name, { class: "clip name" }), " ",
      el("span", { class: `badge ${st.status}`, id: "job-status", "data-field": "status" }, st.status),
      " ", el("span", { class: "muted", id: "job-id" }, st.job_id));
    fill("job-error-box", st.error ? el("p", { class: "error", id: "job-error" }, st.error) : null);
    const canRetry = !active && (st.errors.records || st.shards.total > st.shards.done);
    fillIf("actions", JSON.stringify([active, canRetry, st.retry_of, st.retries]), () => [
      active ? el("button", { id: "cancel", class: "danger", onclick: async (e) => {
        if (armed !== id) {        // a second click confirms
          armed = id;
          e.target.textContent = "Click again to cancel (committed results stay)";
          return;
        }
        e.target.disabled = true;
        await api(`/v1/jobs/${id}/cancel`, { method: "POST" });
        route();
      } }, armed === id ? "Click again to cancel (committed results stay)" : "Cancel job") : null,
      canRetry ? el("button", { id: "retry", onclick: async () => {
        const r = await api(`/v1/jobs/${id}/retry`, { method: "POST", body: JSON.stringify({
          errors: st.errors.records ? ["all"] : null, not_done: st.shards.total > st.shards.done }) });
        location.hash = `#/jobs/${r.job_id}`;
      } }, "Retry failed and unfinished records") : null,
      st.retry_of ? el("span", {}, "retries ", el("a", { href: `#/jobs/${st.retry_of}`, id: "retry-of" }, st.retry_of)) : null,
      st.retries.length ? el("span", {}, "retried by ", st.retries.map((r) => [el("a", { href: `#/jobs/${r}` }, r), " "])) : null]);
    fill("cards",
      card("Records", [["total", fmt(c.records_total), "records_total"], ["done", fmt(c.records_done), "records_done"],
        ["succeeded", fmt(c.records_succeeded), "records_succeeded"], ["failed", fmt(c.records_failed), "records_failed"]]),
      card("Progress", [["progress", progressBar(st)], ["records/s", fmt(p.records_per_second, 1), "records_per_second"],
        ["tokens/s", fmt(p.tokens_per_second, 0), "tokens_per_second"], ["elapsed", dur(p.elapsed_seconds), "elapsed"],
        ["ETA", active ? dur(p.eta_seconds) : "done", "eta"],
        // a task that runs denoising steps (generate_image): steps x images, done of planned
        ...(p.steps_planned === null || p.steps_planned === undefined ? []
          : [["steps", `${fmt(p.steps_done)} / ${fmt(p.steps_planned)}`, "steps"]]),
        // a task that transcribes audio: audio time done of planned, and audio seconds per second
        ...(p.audio_seconds_planned === null || p.audio_seconds_planned === undefined ? []
          : [["audio", `${dur(p.audio_seconds_done)} / ${dur(p.audio_seconds_planned)}`, "audio"],
             ["audio-s/s", fmt(p.audio_seconds_per_second, 1), "audio_seconds_per_second"]])]),
      card("Tokens", [["input", fmt(t.input), "tokens_input"], ["real", fmt(t.real), "tokens_real"],
        ["padded", fmt(t.padded), "tokens_padded"],
        ["padding efficiency", t.padding_efficiency === null ? "–" : (t.padding_efficiency * 100).toFixed(1) + "%",
          "padding_efficiency"]]),
      card("Shards and cost", [["shards", `${st.shards.done} / ${st.shards.total} done`, "shards"],
        ["running", fmt(st.shards.running)], ["quarantined", fmt(st.shards.quarantined)],
        ["worker time", dur(st.worker_seconds)], ["cost", st.cost ? fmt(st.cost.total, 4) : "–", "cost"]]),
      card("Job", [["bundle", clip(st.bundle), "bundle"], ["output", clip(st.output_uri), "output_uri"],
        ["created", when(st.created_at)], ["finished", when(st.finished_at)]]));
    fill("timeline-title", "Shard timeline ", el("span", { class: "muted", id: "attempt-count" },
      `(${plural(attempts.length, "attempt")}, one lane per worker)`));
    const ax = timeAxis(attempts, st, series);
    fill("timeline-box", attempts.length ? timeline(attempts, st, ax) : el("p", { class: "muted" }, "No attempts yet."));
    fill("throughput-box", throughputChart(series, ax));
    const codes = Object.entries(st.errors.by_code).sort((a, b) => b[1] - a[1] || (a[0] < b[0] ? -1 : 1));
    fill("error-codes-box", codes.length ? el("table", { id: "error-codes" },
      el("thead", {}, el("tr", {}, el("th", {}, "code"), el("th", { class: "num" }, "records"))),
      el("tbody", {}, codes.map(([code, n]) => el("tr", { "data-code": code, class: code === errorCode ? "picked" : null },
        el("td", {}, el("button", { type: "button", class: "link", onclick: () => setCode(code) },
          el("code", {}, code))),
        el("td", { class: "num", "data-count": n }, fmt(n)))))) : el("p", { class: "muted" }, "No record errors."));
    fillIf("error-filter-box", JSON.stringify([codes, errorCode, st.errors.records]), () => [
      el("label", { for: "error-filter" }, "Filter by code: "),
      el("select", { id: "error-filter", onchange: (e) => setCode(e.target.value) },
        el("option", { value: "" }, `all codes (${fmt(st.errors.records)})`),
        codes.map(([code, n]) => { const o = el("option", { value: code }, `${code} (${fmt(n)})`);
          if (code === errorCode) o.selected = true; return o; }))]);
    fill("errors-body", errors.items.length ? errors.items.map((e) => el("tr", { "data-code": e.error },
      el("td", {}, clip(String(e.record_id ?? "–"))), el("td", {}, clip(e.source.split("/").pop())),
      el("td", { class: "num" }, e.ordinal), el("td", {}, el("code", {}, e.error)), el("td", { class: "wrap" }, e.message)))
      : el("tr", {}, el("td", { colspan: 5, class: "muted" }, "No error rows.")));
    return active;
  };
}

async function bundlesView() {
  const items = await api("/v1/bundles");
  return () => {
    show(el("h1", {}, "Bundles"), el("div", { class: "scroll" }, el("table", { id: "bundles" },
      el("thead", {}, el("tr", {}, ["name", "aliases", "task", "family", "digest", "imported"].map((h) => el("th", {}, h)))),
      el("tbody", {}, items.map((b) => el("tr", {}, el("td", {}, clip(b.name)),
        el("td", { "data-field": "aliases" }, b.aliases.join(", ") || "–"),
        el("td", {}, b.task), el("td", {}, b.family), el("td", {}, el("code", { title: b.digest }, b.digest.slice(0, 19) + "…")),
        el("td", { class: "nowrap" }, when(b.created_at))))))));
    return false;
  };
}

async function route() {
  clearTimeout(timer);
  timer = null;
  const mine = ++gen;
  if (!sessionStorage.getItem(TOKEN_KEY)) return signIn();
  document.getElementById("signout").hidden = false;
  const hash = location.hash || "#/";
  const m = hash.match(/^#\/jobs\/(job-[0-9a-f]{16})$/);
  try {
    const paint = m ? await jobView(m[1]) : hash === "#/bundles" ? await bundlesView() : await jobsView();
    if (mine !== gen) return;           // navigated (or re-rendered) meanwhile: that render wins
    const live = paint();
    document.body.dataset.loaded = hash;
    document.body.dataset.polls = String(Number(document.body.dataset.polls || 0) + 1);
    document.body.dataset.live = live ? "1" : "0";
    if (live) timer = setTimeout(route, POLL_MS);
  } catch (err) {
    if (mine !== gen) return;
    if (err instanceof Unauthorized) return signIn(err.message);
    show(el("p", { class: "error", id: "load-error" }, String(err.message || err)));
    timer = setTimeout(route, POLL_MS * 2);
  }
}

document.getElementById("signout").addEventListener("click", () => { sessionStorage.removeItem(TOKEN_KEY); route(); });
window.addEventListener("hashchange", () => {
  errorCode = "";
  armed = null;
  if (!/^#\/(\?|$)/.test(location.hash || "#/")) cursors = [];
  route();
});
route();
