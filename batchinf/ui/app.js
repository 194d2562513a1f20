// batchinf dashboard: plain JS + SVG over the /v1 API, no build step. The tenant's token lives in
// sessionStorage and goes out as the bearer header; every view polls while it is shown.
"use strict";

const TOKEN_KEY = "batchinf.token";
const POLL_MS = 2000;
const ACTIVE = new Set(["submitted", "planning", "planned", "running", "verifying", "cancelling"]);
const COLORS = { committed: "#2e9d5b", running: "#2f6fde", retried: "#e0a100", failed: "#b0172b", lost: "#d2452f",
  released: "#6b8fb8", quarantined: "#8e44ad", superseded: "#9aa3b2" };
const OUTCOMES = Object.keys(COLORS);
let timer = null;
let errorCode = "";

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
  main.replaceChildren(...nodes.filter((n) => n !== null && n !== undefined));
}

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
  return el("span", { class: "bar", title: `${fmt(c.records_done)} of ${fmt(total)} records` },
    el("span", { style: `width:${ok}%` }), el("span", { class: "err", style: `left:${ok}%;width:${bad}%` }));
}

async function jobsView() {
  const page = await api("/v1/jobs?limit=100");
  const rows = page.items.map((j) => el("tr", { "data-job": j.job_id },
    el("td", {}, el("a", { href: `#/jobs/${j.job_id}` }, j.job_id)), el("td", {}, j.name),
    el("td", {}, el("span", { class: `badge ${j.status}`, "data-field": "status" }, j.status)),
    el("td", {}, progressBar(j), " ", el("span", { "data-field": "records_done" }, fmt(j.counts.records_done)),
      " / ", fmt(j.counts.records_total)),
    el("td", { class: "num", "data-field": "records_per_second" }, fmt(j.progress.records_per_second, 1)),
    el("td", { class: "num" }, dur(j.progress.eta_seconds)),
    el("td", {}, when(j.created_at))));
  show(el("h1", {}, "Jobs"), el("table", { id: "jobs" },
    el("thead", {}, el("tr", {}, ["job", "name", "status", "progress (records)", "records/s", "ETA", "created"]
      .map((h) => el("th", { class: h.includes("/s") || h === "ETA" ? "num" : null }, h)))),
    el("tbody", {}, rows.length ? rows : el("tr", {}, el("td", { colspan: 7, class: "muted" }, "No jobs yet.")))));
  return page.items.some((j) => ACTIVE.has(j.status));
}

function card(title, pairs) {
  return el("div", { class: "card" }, el("h3", {}, title), el("dl", {}, pairs.map(([k, v, field]) =>
    [el("dt", {}, k), el("dd", { "data-field": field || null }, v)])));
}

function timeline(attempts, st) {
  const W = 1100, lane = 22, left = 170, top = 20;
  const workers = [...new Set(attempts.map((a) => a.worker))].sort();
  const now = Date.now() / 1000;
  const t0 = Math.min(...attempts.map((a) => a.started_at));     // from the first attempt (planning is before)
  const end = (a) => a.finished_at || a.heartbeat_at || (ACTIVE.has(st.status) ? now : a.started_at);
  const t1 = Math.max(...attempts.map(end), st.finished_at || 0, t0 + 1);
  const x = (t) => left + (t - t0) / (t1 - t0) * (W - left - 10);
  const H = top + workers.length * lane + 24;
  const svg = s("svg", { id: "timeline", width: W, height: H, viewBox: `0 0 ${W} ${H}`, role: "img" });
  workers.forEach((w, i) => {
    svg.append(s("text", { x: 4, y: top + i * lane + 15, "font-size": 11, fill: "#444" },
      w.length > 26 ? "…" + w.slice(-25) : w));
    svg.append(s("line", { x1: left, x2: W - 10, y1: top + i * lane + lane - 1, y2: top + i * lane + lane - 1,
      stroke: "#eef0f4" }));
  });
  for (const a of attempts) {
    const y = top + workers.indexOf(a.worker) * lane + 3;
    const x0 = x(a.started_at), width = Math.max(2, x(end(a)) - x0);
    svg.append(s("rect", { x: x0, y, width, height: lane - 7, rx: 2, class: `attempt ${a.outcome}`,
      fill: COLORS[a.outcome] || "#999", "data-outcome": a.outcome, "data-shard": a.shard_id },
    s("title", {}, `${a.shard_id} attempt ${a.number} (bucket ${a.bucket}, shard ${a.shard_ordinal}): ` +
      `${a.outcome}, ${dur(end(a) - a.started_at)}${a.error ? " — " + a.error : ""}`)));
  }
  for (let k = 0; k <= 5; k++) {
    const t = t0 + (t1 - t0) * k / 5;
    svg.append(s("text", { x: x(t), y: H - 6, "font-size": 10, fill: "#888", "text-anchor": "middle" },
      "+" + dur(t - t0)));
  }
  return svg;
}

function throughputChart(series) {
  const W = 1100, H = 160, left = 50, pts = series.points;
  const max = Math.max(...pts.map((p) => p.records_per_second), 1e-9);
  const svg = s("svg", { id: "throughput", width: W, height: H, viewBox: `0 0 ${W} ${H}`, role: "img" });
  const bw = (W - left - 10) / pts.length;
  pts.forEach((p, i) => {
    const h = p.records_per_second / max * (H - 30);
    svg.append(s("rect", { x: left + i * bw + 1, y: H - 20 - h, width: Math.max(1, bw - 2), height: h,
      fill: "#2f6fde", "data-records": p.records },
    s("title", {}, `+${dur(p.t - series.start)}: ${fmt(p.records)} records, ${fmt(p.records_per_second, 1)}/s`)));
  });
  svg.append(s("text", { x: 4, y: 14, "font-size": 10, fill: "#888" }, `${fmt(max, 1)}/s`));
  svg.append(s("text", { x: 4, y: H - 22, "font-size": 10, fill: "#888" }, "0"));
  svg.append(s("text", { x: W - 10, y: H - 4, "font-size": 10, fill: "#888", "text-anchor": "end" },
    dur(series.end - series.start)));
  return svg;
}

async function jobView(id) {
  const st = await api(`/v1/jobs/${id}`);
  const [attempts, series, errors] = await Promise.all([
    allPages(`/v1/jobs/${id}/attempts?limit=1000`), api(`/v1/jobs/${id}/throughput?points=60`),
    api(`/v1/jobs/${id}/errors?limit=200${errorCode ? "&code=" + encodeURIComponent(errorCode) : ""}`)]);
  const c = st.counts, t = st.tokens, p = st.progress;
  const active = ACTIVE.has(st.status);
  const actions = el("div", { class: "toolbar" },
    active ? el("button", { id: "cancel", class: "danger", onclick: async (e) => {
      if (e.target.dataset.armed !== "1") {        // a second click confirms
        e.target.dataset.armed = "1";
        e.target.textContent = "Click again to cancel (committed results stay)";
        return;
      }
      e.target.disabled = true;
      await api(`/v1/jobs/${id}/cancel`, { method: "POST" });
      route();
    } }, "Cancel job") : null,
    !active && (st.errors.records || st.shards.total > st.shards.done) ? el("button", { id: "retry", onclick: async () => {
      const r = await api(`/v1/jobs/${id}/retry`, { method: "POST", body: JSON.stringify({
        errors: st.errors.records ? ["all"] : null, not_done: st.shards.total > st.shards.done }) });
      location.hash = `#/jobs/${r.job_id}`;
    } }, "Retry failed and unfinished records") : null,
    st.retry_of ? el("span", {}, "retries ", el("a", { href: `#/jobs/${st.retry_of}`, id: "retry-of" }, st.retry_of)) : null,
    st.retries.length ? el("span", {}, "retried by ", st.retries.map((r) => [el("a", { href: `#/jobs/${r}` }, r), " "])) : null);
  const codes = Object.entries(st.errors.by_code).sort((a, b) => b[1] - a[1]);
  const filter = el("select", { id: "error-filter", onchange: (e) => { errorCode = e.target.value; route(); } },
    el("option", { value: "" }, `all codes (${fmt(st.errors.records)})`),
    codes.map(([code, n]) => { const o = el("option", { value: code }, `${code} (${fmt(n)})`);
      if (code === errorCode) o.selected = true; return o; }));
  show(
    el("h1", {}, st.name, " ", el("span", { class: `badge ${st.status}`, id: "job-status", "data-field": "status" }, st.status),
      " ", el("span", { class: "muted", id: "job-id" }, st.job_id)),
    st.error ? el("p", { class: "error", id: "job-error" }, st.error) : null,
    actions,
    el("div", { class: "cards" },
      card("Records", [["total", fmt(c.records_total), "records_total"], ["done", fmt(c.records_done), "records_done"],
        ["succeeded", fmt(c.records_succeeded), "records_succeeded"], ["failed", fmt(c.records_failed), "records_failed"]]),
      card("Progress", [["progress", progressBar(st)], ["records/s", fmt(p.records_per_second, 1), "records_per_second"],
        ["tokens/s", fmt(p.tokens_per_second, 0), "tokens_per_second"], ["elapsed", dur(p.elapsed_seconds)],
        ["ETA", active ? dur(p.eta_seconds) : "done", "eta"]]),
      card("Tokens", [["input", fmt(t.input), "tokens_input"], ["real", fmt(t.real), "tokens_real"],
        ["padded", fmt(t.padded), "tokens_padded"],
        ["padding efficiency", t.padding_efficiency === null ? "–" : (t.padding_efficiency * 100).toFixed(1) + "%",
          "padding_efficiency"]]),
      card("Shards and cost", [["shards", `${st.shards.done} / ${st.shards.total} done`, "shards"],
        ["running", fmt(st.shards.running)], ["quarantined", fmt(st.shards.quarantined)],
        ["worker time", dur(st.worker_seconds)], ["cost", st.cost ? fmt(st.cost.total, 4) : "–", "cost"]]),
      card("Job", [["bundle", st.bundle], ["output", st.output_uri], ["created", when(st.created_at)],
        ["finished", when(st.finished_at)]])),
    el("h2", {}, "Shard timeline ", el("span", { class: "muted" }, `(${attempts.length} attempts, one lane per worker)`)),
    el("div", { class: "legend" }, OUTCOMES.map((o) => el("span", {}, el("i", { style: `background:${COLORS[o]}` }), o))),
    el("div", { class: "chart" }, attempts.length ? timeline(attempts, st) : el("p", { class: "muted" }, "No attempts yet.")),
    el("h2", {}, "Throughput ", el("span", { class: "muted" }, "(records committed per second)")),
    el("div", { class: "chart" }, throughputChart(series)),
    el("h2", {}, "Errors"),
    el("div", { class: "toolbar" }, "Filter by code: ", filter),
    el("table", { id: "errors" }, el("thead", {}, el("tr", {}, ["record", "source", "line", "code", "message"]
      .map((h) => el("th", {}, h)))),
    el("tbody", {}, errors.items.length ? errors.items.map((e) => el("tr", { "data-code": e.error },
      el("td", {}, e.record_id ?? "–"), el("td", {}, e.source.split("/").pop()), el("td", { class: "num" }, e.ordinal),
      el("td", {}, el("code", {}, e.error)), el("td", {}, e.message)))
      : el("tr", {}, el("td", { colspan: 5, class: "muted" }, "No error rows.")))));
  return active;
}

async function bundlesView() {
  const items = await api("/v1/bundles");
  show(el("h1", {}, "Bundles"), el("table", { id: "bundles" },
    el("thead", {}, el("tr", {}, ["name", "aliases", "task", "family", "digest", "imported"].map((h) => el("th", {}, h)))),
    el("tbody", {}, items.map((b) => el("tr", {}, el("td", {}, b.name),
      el("td", { "data-field": "aliases" }, b.aliases.join(", ") || "–"),
      el("td", {}, b.task), el("td", {}, b.family), el("td", {}, el("code", {}, b.digest.slice(0, 19) + "…")),
      el("td", {}, when(b.created_at)))))));
  return false;
}

async function route() {
  clearTimeout(timer);
  if (!sessionStorage.getItem(TOKEN_KEY)) return signIn();
  document.getElementById("signout").hidden = false;
  const hash = location.hash || "#/";
  const m = hash.match(/^#\/jobs\/(job-[0-9a-f]{16})$/);
  try {
    const live = m ? await jobView(m[1]) : hash === "#/bundles" ? await bundlesView() : await jobsView();
    document.body.dataset.loaded = hash;
    if (live) timer = setTimeout(route, POLL_MS);
  } catch (err) {
    if (err instanceof Unauthorized) return signIn(err.message);
    show(el("p", { class: "error", id: "load-error" }, String(err.message || err)));
    timer = setTimeout(route, POLL_MS * 2);
  }
}

document.getElementById("signout").addEventListener("click", () => { sessionStorage.removeItem(TOKEN_KEY); route(); });
window.addEventListener("hashchange", () => { errorCode = ""; route(); });
route();
