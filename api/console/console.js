// Ballast console: one page, hash routes, plain DOM. Served with a strict CSP (api/console.py):
// no inline script or style, nothing from another origin. Every value from the API goes
// through esc() before it reaches innerHTML.
"use strict";

(() => {
  const STORE = "ballast.console.key";
  const POLL_MS = 5000;
  const PAGE = 100; // batches and jobs per page (the API's maximum)

  // -- small helpers ---------------------------------------------------------------------

  const $ = (id) => document.getElementById(id);
  const ESC = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };
  const esc = (v) => String(v ?? "").replace(/[&<>"']/g, (c) => ESC[c]);
  const isNum = (v) => typeof v === "number" && Number.isFinite(v);
  const int = (n) => (isNum(n) ? String(Math.round(n)).replace(/\B(?=(\d{3})+(?!\d))/g, ",") : "—");
  const dec = (n, d = 1) => (isNum(n) ? n.toFixed(d) : "—");
  // Axis labels: 1,500 → "1.5k", 50,000,000 → "50M".
  const compact = (n) => {
    if (!isNum(n)) return "—";
    const a = Math.abs(n);
    const [d, u] = a >= 1e9 ? [1e9, "G"] : a >= 1e6 ? [1e6, "M"] : a >= 1e4 ? [1e3, "k"] : [1, ""];
    return `${Number((n / d).toPrecision(3))}${u}`;
  };
  const pct = (x) => (isNum(x) ? `${(x * 100).toFixed(1)}%` : "—");
  const iso = (t) => new Date(t * 1000).toISOString();
  const hms = (t) => (isNum(t) ? iso(t).slice(11, 19) : "—");
  const hm = (t) => (isNum(t) ? iso(t).slice(11, 16) : "—");
  const day = (t) => (isNum(t) ? iso(t).slice(0, 10) : "—");
  const when = (t) => (isNum(t) ? `${iso(t).slice(0, 19).replace("T", " ")} UTC` : "—");
  const seconds = (v) => (isNum(v) ? v : typeof v === "string" && !Number.isNaN(Date.parse(v)) ? Date.parse(v) / 1000 : null);
  const now = () => Math.floor(Date.now() / 1000);
  const tag = (word) => `<span class="tag ${esc(String(word).replace(/[^a-z_]/gi, ""))}">${esc(word)}</span>`;
  const ago = (t) => {
    if (!isNum(t)) return "—";
    const d = Math.round(t - Date.now() / 1000);
    const a = Math.abs(d);
    const span = a < 90 ? `${a} s` : a < 5400 ? `${Math.round(a / 60)} min` : `${(a / 3600).toFixed(1)} h`;
    return d >= 0 ? `in ${span}` : `${span} ago`;
  };

  class ApiError extends Error {
    constructor(status, message, code) {
      super(message);
      this.status = status;
      this.code = code;
    }
  }

  const state = { key: null, session: null, gen: 0, timers: [], batches: [null], jobs: [null] };

  async function request(path, key = state.key) {
    const r = await fetch(path, { headers: { Authorization: `Bearer ${key}` }, cache: "no-store", credentials: "omit" });
    if (!r.ok) {
      let message = `${r.status} ${r.statusText}`;
      let code = null;
      try {
        const body = await r.json();
        if (body && body.error) {
          message = body.error.message || message;
          code = body.error.code;
        }
      } catch (_) { /* not JSON: the status says it */ }
      if (r.status === 401 && key === state.key && state.session) signOut(`Signed out: ${message}`);
      throw new ApiError(r.status, message, code);
    }
    return r;
  }
  const get = async (path) => (await request(path)).json();

  // Every page of a list endpoint that pages with `after` (OpenAI's cursor).
  async function all(path, max = 50) {
    const out = [];
    let after = null;
    for (let i = 0; i < max; i += 1) {
      const sep = path.includes("?") ? "&" : "?";
      const page = await get(`${path}${sep}limit=100${after ? `&after=${encodeURIComponent(after)}` : ""}`);
      out.push(...page.data);
      if (!page.has_more || !page.data.length) break;
      after = page.data[page.data.length - 1].id;
    }
    return out;
  }

  function problem(err, what) {
    const missing = err && err.status === 404 && !err.code;
    const text = missing ? `${what} is not available on this server (404): ${err.message}` :
      `${what} could not be loaded${err && err.status ? ` (${err.status})` : ""}: ${err ? err.message : "unknown error"}`;
    return `<p class="error" role="alert">${esc(text)}</p>`;
  }

  // -- charts: inline SVG, numbers beside ------------------------------------------------

  function nice(x) {
    if (!(x > 0)) return 1;
    const p = 10 ** Math.floor(Math.log10(x));
    return [1, 2, 2.5, 5, 10].map((m) => m * p).find((v) => v >= x * 1.0001) || 10 * p;
  }

  // series: [{key, label, axis: "left"|"right", points: [[x, y|null], ...]}]
  // limits: [{axis, value, label}]; shades: [[x0, x1], ...]
  function chart(o) {
    const W = 720;
    const H = o.height || 240;
    const right = o.series.some((s) => s.axis === "right");
    const m = { l: 58, r: right ? 58 : 18, t: 14, b: 30 };
    const iw = W - m.l - m.r;
    const ih = H - m.t - m.b;
    const x0 = o.x0;
    const x1 = o.x1 > o.x0 ? o.x1 : o.x0 + 1;
    const X = (x) => m.l + ((x - x0) / (x1 - x0)) * iw;
    const most = (axis) => Math.max(0, ...o.series.filter((s) => (s.axis || "left") === axis)
      .flatMap((s) => s.points.map((p) => p[1]).filter(isNum)));
    // A limit far above the data would flatten it: such a limit is named, not drawn to scale.
    const onScale = (l) => l.value <= 4 * most(l.axis || "left");
    const top = (axis) => nice(Math.max(most(axis), ...(o.limits || []).filter((l) => (l.axis || "left") === axis && onScale(l))
      .map((l) => l.value)));
    const tops = { left: top("left"), right: top("right") };
    const Y = (y, axis) => m.t + ih - (y / tops[axis || "left"]) * ih;
    const f = (v) => v.toFixed(1);
    const parts = [];
    for (const [a, b] of o.shades || []) {
      const xa = Math.max(m.l, X(a));
      const xb = Math.min(m.l + iw, X(b));
      if (xb > xa) parts.push(`<rect class="shade" x="${f(xa)}" y="${m.t}" width="${f(Math.max(1, xb - xa))}" height="${ih}"></rect>`);
    }
    for (let i = 0; i <= 4; i += 1) {
      const y = m.t + (ih * i) / 4;
      parts.push(`<line class="grid" x1="${m.l}" x2="${m.l + iw}" y1="${f(y)}" y2="${f(y)}"></line>`);
      parts.push(`<text x="${m.l - 6}" y="${f(y + 4)}" text-anchor="end">${esc(o.yfmt((tops.left * (4 - i)) / 4))}</text>`);
      if (right) parts.push(`<text x="${m.l + iw + 6}" y="${f(y + 4)}">${esc((o.y2fmt || o.yfmt)((tops.right * (4 - i)) / 4))}</text>`);
    }
    for (let i = 0; i <= 4; i += 1) {
      const x = x0 + ((x1 - x0) * i) / 4;
      const anchor = i === 0 ? "start" : i === 4 ? "end" : "middle";
      parts.push(`<text x="${f(X(x))}" y="${H - 10}" text-anchor="${anchor}">${esc(o.xfmt(x))}</text>`);
    }
    parts.push(`<line class="axis" x1="${m.l}" x2="${m.l + iw}" y1="${m.t + ih}" y2="${m.t + ih}"></line>`);
    let above = 0;
    for (const l of o.limits || []) {
      if (onScale(l)) {
        const y = f(Y(l.value, l.axis));
        parts.push(`<path class="s-limit" data-limit="${esc(l.label)}" d="M${m.l},${y} L${m.l + iw},${y}"></path>`);
      } else {
        above += 1;
        parts.push(`<text class="offscale" data-limit="${esc(l.label)}" x="${m.l + iw - 4}" y="${m.t + 12 * above}" text-anchor="end">↑ ${esc(l.label)} (above the chart)</text>`);
      }
    }
    let drawn = 0;
    for (const s of o.series) {
      let d = "";
      let pen = false;
      const dots = [];
      const real = s.points.filter((p) => isNum(p[1]));
      s.points.forEach(([x, y], i) => {
        if (!isNum(y)) { pen = false; return; }
        d += `${pen ? "L" : "M"}${f(X(x))},${f(Y(y, s.axis))} `;
        const lone = !isNum((s.points[i - 1] || [])[1]) && !isNum((s.points[i + 1] || [])[1]);
        if (lone || real.length <= 40) dots.push(`<circle class="dot-${esc(s.key)}" cx="${f(X(x))}" cy="${f(Y(y, s.axis))}" r="2.5"></circle>`);
        pen = true;
      });
      drawn += real.length;
      if (d) parts.push(`<path class="line s-${esc(s.key)}" data-series="${esc(s.key)}" d="${d.trim()}"></path>`, ...dots);
    }
    if (!drawn) parts.push(`<text class="empty" x="${m.l + iw / 2}" y="${m.t + ih / 2}" text-anchor="middle">${esc(o.empty || "No data in this window")}</text>`);
    const legend = o.series.map((s) => `<li class="${esc(s.key)}">${esc(s.label)}</li>`)
      .concat((o.limits || []).map((l) => `<li class="limit">${esc(l.label)}</li>`))
      .concat(o.shades && o.shadeLabel ? [`<li class="shade">${esc(o.shadeLabel)}</li>`] : []);
    return `<figure><svg id="${esc(o.id)}" viewBox="0 0 ${W} ${H}" role="img" aria-labelledby="${esc(o.id)}-title ${esc(o.id)}-desc">` +
      `<title id="${esc(o.id)}-title">${esc(o.title)}</title><desc id="${esc(o.id)}-desc">${esc(o.desc)}</desc>${parts.join("")}</svg>` +
      `<ul class="legend" aria-hidden="true">${legend.join("")}</ul></figure>`;
  }

  const readout = (pairs) => `<dl class="readout">${pairs.map(([k, v]) => `<dt>${esc(k)}</dt><dd>${esc(v)}</dd>`).join("")}</dl>`;

  function dataTable(id, caption, head, rows, note) {
    return `<details id="${esc(id)}"><summary>${esc(caption)} (${rows.length} rows)</summary>` +
      (note ? `<p class="note">${esc(note)}</p>` : "") +
      `<div class="scroll"><table><thead><tr>${head.map((h) => `<th scope="col"${h.num ? ' class="num"' : ""}>${esc(h.label)}</th>`).join("")}</tr></thead>` +
      `<tbody>${rows.join("")}</tbody></table></div></details>`;
  }

  // -- sign-in, sign-out and routes ------------------------------------------------------

  const PAGES = [
    { id: "fleet", label: "Fleet", admin: true, render: fleetPage },
    { id: "tenants", label: "Tenants", admin: true, tenant: true, render: tenantsPage },
    { id: "batches", label: "Batches", tenant: true, render: batchesPage },
    { id: "fine-tunes", label: "Fine-tunes", tenant: true, render: fineTunesPage },
  ];
  const may = (p) => Boolean((p.admin && state.session.admin) || (p.tenant && state.session.tenant));
  const label = (p) => (p.id === "tenants" && !state.session.admin ? "Usage" : p.label);

  function boot() {
    $("sign-in-form").addEventListener("submit", onSignIn);
    $("sign-out").addEventListener("click", () => signOut());
    window.addEventListener("hashchange", () => route(true));
    const key = sessionStorage.getItem(STORE);
    if (!key) { showSignIn(); return; }
    request("/console/session", key).then((r) => r.json()).then((s) => enter(key, s, false))
      .catch((err) => { sessionStorage.removeItem(STORE); showSignIn(`Sign in again: ${err.message}`); });
  }

  async function onSignIn(event) {
    event.preventDefault();
    const input = $("key");
    const key = input.value.trim();
    const error = $("sign-in-error");
    if (!key) { error.textContent = "Paste an API key first."; input.focus(); return; }
    const button = $("sign-in-button");
    button.disabled = true;
    error.textContent = "";
    try {
      const s = await (await request("/console/session", key)).json();
      input.value = "";
      enter(key, s, true);
    } catch (err) {
      error.textContent = err.status === 401 ? `That key was refused: ${err.message}` : `Could not sign in: ${err.message}`;
      input.focus();
    } finally {
      button.disabled = false;
    }
  }

  function enter(key, session, fresh) {
    state.key = key;
    state.session = session;
    sessionStorage.setItem(STORE, key);
    const who = session.admin ? (session.tenant ? `Admin key (tenant ${session.tenant})` : "Admin key") : `Tenant ${session.tenant}`;
    $("who-text").textContent = who;
    $("nav-links").innerHTML = PAGES.filter(may).map((p) => `<li><a href="#/${p.id}" id="nav-${p.id}">${esc(label(p))}</a></li>`).join("");
    $("nav").hidden = false;
    $("who").hidden = false;
    $("sign-in").hidden = true;
    $("view").hidden = false;
    route(fresh);
  }

  function showSignIn(message = "") {
    $("nav").hidden = true;
    $("who").hidden = true;
    $("view").hidden = true;
    $("view").innerHTML = "";
    $("sign-in").hidden = false;
    $("sign-in-error").textContent = message;
    $("key").focus();
  }

  function signOut(message = "") {
    stop();
    state.gen += 1;
    state.key = null;
    state.session = null;
    state.batches = [null];
    state.jobs = [null];
    sessionStorage.removeItem(STORE);
    history.replaceState(null, "", location.pathname);
    showSignIn(message);
  }

  function stop() {
    state.timers.forEach(clearInterval);
    state.timers = [];
  }

  function route(focus) {
    if (!state.session) return;
    stop();
    const gen = ++state.gen;
    const [name, ...rest] = location.hash.replace(/^#\/?/, "").split("/");
    const page = PAGES.find((p) => p.id === name);
    const first = PAGES.find(may);
    if (!page) { location.replace(`#/${first ? first.id : "tenants"}`); return; }
    for (const a of $("nav-links").querySelectorAll("a")) {
      if (a.id === `nav-${page.id}`) a.setAttribute("aria-current", "page"); else a.removeAttribute("aria-current");
    }
    document.title = `${label(page)} · Ballast console`;
    const view = $("view");
    if (!may(page)) {
      const why = page.admin ? "The fleet is an admin's view: this key belongs to a tenant and may not see it."
        : "Batches and fine-tunes belong to tenants: sign in with a tenant's key to see them.";
      view.innerHTML = `<h1 tabindex="-1">${esc(page.label)}</h1><p class="error" role="alert" id="refused">${esc(why)}</p>`;
    } else {
      page.render(view, gen, rest.filter(Boolean).map(decodeURIComponent));
    }
    const h = view.querySelector("h1");
    if (focus && h) h.focus();
  }

  const live = (gen) => gen === state.gen;

  // -- Fleet (admin) -----------------------------------------------------------------------

  const WINDOWS = [[900, 10, "Last 15 minutes"], [3600, 30, "Last hour"], [6 * 3600, 180, "Last 6 hours"], [86400, 720, "Last 24 hours"]];

  function fleetPage(view, gen) {
    if (!state.session.admin_api) {
      view.innerHTML = `<h1 tabindex="-1">Fleet</h1><p class="error" role="alert">This server answers /admin only on its admin listener (BALLAST_ADMIN_PORT); open the console there to see the fleet.</p>`;
      return;
    }
    view.innerHTML = `<h1 tabindex="-1">Fleet</h1>
      <div class="bar"><label for="fleet-window">Timeline</label>
        <select id="fleet-window">${WINDOWS.map(([s, , l], i) => `<option value="${i}">${esc(l)}</option>`).join("")}</select>
        <button type="button" id="fleet-refresh">Refresh now</button>
        <span class="note" id="fleet-updated">Loading…</span></div>
      <div id="fleet-summary" class="cards"></div>
      <h2 id="fleet-timeline-title">Interactive TTFT against batch throughput</h2>
      <div id="fleet-timeline" class="chart-block">
        <div id="timeline-error"></div>
        <div class="chart" id="timeline-box"><div id="timeline-figure"><p class="muted">Loading…</p></div><div id="timeline-readout"></div></div>
        <details id="timeline-data"><summary>Buckets with activity (<span id="timeline-count">0</span> rows)</summary>
          <p class="note" id="timeline-note"></p>
          <div class="scroll"><table><thead><tr><th scope="col">Bucket (UTC)</th><th scope="col" class="num">Requests</th>
            <th scope="col" class="num">p50 TTFT ms</th><th scope="col" class="num">p99 TTFT ms</th><th scope="col" class="num">Batch tokens/s</th>
            <th scope="col">Surging</th></tr></thead><tbody id="timeline-rows"></tbody></table></div></details>
      </div>
      <h2>Pools</h2><div id="fleet-pools"></div>
      <h2>Load by tier</h2><div id="fleet-tiers"></div>
      <h2>Regions</h2><div id="fleet-regions"></div>
      <h2>Engines</h2><div id="fleet-engines"></div>`;
    let busy = false;
    const refresh = async () => {
      if (busy || !live(gen) || document.hidden) return;
      busy = true;
      const [span, step] = WINDOWS[Number($("fleet-window").value) || 0];
      const until = now();
      const source = `/admin/timeline?since=${until - span}&until=${until}&step=${step}`;
      const [engines, timeline] = await Promise.allSettled([get("/admin/engines"), get(source)]);
      busy = false;
      if (!live(gen)) return;
      renderFleet(engines, timeline, source, span);
      $("fleet-updated").textContent = `Updated ${hms(until)} UTC; refreshes every ${POLL_MS / 1000} s`;
    };
    $("fleet-window").addEventListener("change", refresh);
    $("fleet-refresh").addEventListener("click", refresh);
    refresh();
    state.timers.push(setInterval(refresh, POLL_MS));
  }

  function renderFleet(enginesResult, timelineResult, source, span) {
    const tl = timelineResult.status === "fulfilled" ? timelineResult.value : null;
    const engines = enginesResult.status === "fulfilled" ? enginesResult.value.data : null;
    const surging = new Set(tl && tl.data.length ? tl.data[tl.data.length - 1].surging : []);

    // The timeline.
    // The timeline: its parts are rewritten in place, so a focused control in it keeps its focus.
    $("timeline-error").innerHTML = tl ? "" : problem(timelineResult.reason, "The timeline (GET /admin/timeline)");
    if (tl) timelineChart(tl, source, span);

    if (!engines) {
      const p = problem(enginesResult.reason, "The engines (GET /admin/engines)");
      for (const id of ["fleet-pools", "fleet-tiers", "fleet-regions", "fleet-engines"]) $(id).innerHTML = p;
      $("fleet-summary").innerHTML = "";
      return;
    }
    const st = (e) => e.stats || {};
    const sum = (list, f) => list.reduce((a, e) => a + (Number(f(e)) || 0), 0);
    const region = (e) => e.region || st(e).region || "—";
    const pools = [...new Set(engines.map((e) => e.model))].sort();
    for (const p of surging) if (!pools.includes(p)) pools.push(p);
    const of = (pool) => engines.filter((e) => e.model === pool);
    const serving = engines.filter((e) => e.state !== "draining").length;
    $("fleet-summary").innerHTML = [
      ["Engines", `${int(engines.length)} (${int(serving)} serving, ${int(engines.length - serving)} draining)`],
      ["Running", int(sum(engines, (e) => e.running))], ["Waiting", int(sum(engines, (e) => e.waiting))],
      ["Surging pools", surging.size ? [...surging].sort().join(", ") : "none"],
    ].map(([k, v]) => `<div class="card" data-card="${esc(k)}"><div class="k">${esc(k)}</div><div class="v">${esc(v)}</div></div>`).join("");

    const mean = (list, f) => (list.length ? sum(list, f) / list.length : null);
    $("fleet-pools").innerHTML = `<table id="pools-table"><thead><tr><th scope="col">Pool (model)</th><th scope="col" class="num">Engines</th>
      <th scope="col" class="num">Serving</th><th scope="col" class="num">Draining</th><th scope="col" class="num">Running</th>
      <th scope="col" class="num">Waiting</th><th scope="col" class="num">KV cache (mean)</th><th scope="col">Surge</th></tr></thead><tbody>${
      pools.map((p) => {
        const es = of(p);
        const capped = es.filter((e) => isNum(e.batch_cap) || isNum(st(e).fleet_cap)).length;
        return `<tr data-pool="${esc(p)}"><th scope="row">${esc(p)}</th><td class="num">${int(es.length)}</td>
          <td class="num">${int(es.filter((e) => e.state !== "draining").length)}</td><td class="num">${int(es.filter((e) => e.state === "draining").length)}</td>
          <td class="num">${int(sum(es, (e) => e.running))}</td><td class="num">${int(sum(es, (e) => e.waiting))}</td>
          <td class="num">${pct(mean(es, (e) => e.kv_cache_usage))}</td>
          <td>${surging.has(p) ? tag("surging") : "calm"}${capped ? ` · batch capped on ${int(capped)}` : ""}</td></tr>`;
      }).join("")}</tbody></table>${pools.length ? "" : '<p class="muted">No engine has announced itself.</p>'}`;

    $("fleet-tiers").innerHTML = `<table id="tiers-table"><thead><tr><th scope="col">Pool</th><th scope="col" class="num">Interactive in flight</th>
      <th scope="col" class="num">of which flex</th><th scope="col" class="num">Batch running</th><th scope="col" class="num">Batch queued</th>
      <th scope="col" class="num">Slots</th><th scope="col">Share of slots</th></tr></thead><tbody>${
      pools.map((p) => {
        const es = of(p);
        const inter = sum(es, (e) => st(e).interactive);
        const batch = sum(es, (e) => st(e).batch);
        const slots = sum(es, (e) => st(e).max_seqs);
        return `<tr data-pool="${esc(p)}"><th scope="row">${esc(p)}</th><td class="num">${int(inter)}</td><td class="num">${int(sum(es, (e) => st(e).flex))}</td>
          <td class="num">${int(batch)}</td><td class="num">${int(sum(es, (e) => st(e).batch_queued))}</td><td class="num">${int(slots)}</td>
          <td>${shareBar(p, inter, batch, slots)}</td></tr>`;
      }).join("")}</tbody></table>`;

    const regions = [...new Set(engines.map(region))].sort();
    $("fleet-regions").innerHTML = `<table id="regions-table"><thead><tr><th scope="col">Region</th><th scope="col" class="num">Engines</th>
      <th scope="col">Pools</th><th scope="col" class="num">Running</th><th scope="col" class="num">Waiting</th></tr></thead><tbody>${
      regions.map((r) => {
        const es = engines.filter((e) => region(e) === r);
        return `<tr data-region="${esc(r)}"><th scope="row">${esc(r)}</th><td class="num">${int(es.length)}</td>
          <td>${esc([...new Set(es.map((e) => e.model))].sort().join(", "))}</td>
          <td class="num">${int(sum(es, (e) => e.running))}</td><td class="num">${int(sum(es, (e) => e.waiting))}</td></tr>`;
      }).join("")}</tbody></table>`;

    $("fleet-engines").innerHTML = `<table id="engines-table"><thead><tr><th scope="col">Engine</th><th scope="col">Model</th><th scope="col">Region</th>
      <th scope="col">State</th><th scope="col" class="num">Running</th><th scope="col" class="num">Waiting</th><th scope="col" class="num">KV cache</th>
      <th scope="col" class="num">Batch cap</th><th scope="col">Seen</th></tr></thead><tbody>${
      engines.map((e) => `<tr data-engine="${esc(e.id)}"><th scope="row" class="id">${esc(e.id)}</th><td>${esc(e.model)}</td><td>${esc(region(e))}</td>
        <td>${tag(e.state || "serving")}</td><td class="num">${int(e.running)}</td><td class="num">${int(e.waiting)}</td>
        <td class="num">${pct(e.kv_cache_usage)}</td><td class="num">${esc(e.batch_cap ?? st(e).fleet_cap ?? "—")}</td>
        <td>${esc(hms(seconds(e.seen_at)))}</td></tr>`).join("")}</tbody></table>`;
  }

  function shareBar(pool, inter, batch, slots) {
    const total = Math.max(slots, inter + batch, 1);
    const w = (n) => ((n / total) * 160).toFixed(1);
    const text = `${pool}: ${inter} interactive and ${batch} batch of ${slots} slots`;
    return `<svg class="share" viewBox="0 0 160 12" width="160" height="12" role="img" aria-label="${esc(text)}">` +
      `<rect x="0" y="0" width="160" height="12" fill="#eceff3"></rect><rect x="0" y="0" width="${w(inter)}" height="12" fill="#1d4ed8"></rect>` +
      `<rect x="${w(inter)}" y="0" width="${w(batch)}" height="12" fill="#067647"></rect></svg>`;
  }

  function surgeSpans(buckets, step) {
    const spans = [];
    const open = new Map();
    for (const b of buckets) {
      for (const p of b.surging) if (!open.has(p)) open.set(p, b.t);
      for (const [p, t0] of [...open]) {
        if (!b.surging.includes(p)) { spans.push([p, t0, b.t]); open.delete(p); }
      }
    }
    const end = buckets.length ? buckets[buckets.length - 1].t + step : 0;
    for (const [p, t0] of open) spans.push([p, t0, end]);
    return spans;
  }

  function timelineChart(tl, source, span) {
    const b = tl.data;
    const step = tl.step;
    const mid = (x) => x.t + step / 2;
    const spans = surgeSpans(b, step);
    const withReq = b.filter((x) => isNum(x.chat_ttft_p99_ms));
    const lastReq = withReq[withReq.length - 1];
    const peak = withReq.reduce((a, x) => (!a || x.chat_ttft_p99_ms > a.chat_ttft_p99_ms ? x : a), null);
    const withTok = b.filter((x) => x.batch_tokens > 0);
    const lastTok = withTok[withTok.length - 1];
    const peakTok = withTok.reduce((a, x) => (!a || x.batch_tokens_per_s > a.batch_tokens_per_s ? x : a), null);
    const requests = b.reduce((a, x) => a + x.chat_requests, 0);
    const tokens = b.reduce((a, x) => a + x.batch_tokens, 0);
    const svg = chart({
      id: "timeline-chart", x0: b.length ? b[0].t : 0, x1: b.length ? b[b.length - 1].t + step : 1,
      title: `Interactive TTFT p50 and p99 (ms, left axis) against batch tokens per second (right axis), ${step}-second buckets`,
      desc: `${int(requests)} interactive requests and ${int(tokens)} batch tokens in the window` +
        (peak ? `; peak p99 TTFT ${dec(peak.chat_ttft_p99_ms)} ms at ${hms(peak.t)} UTC` : "") +
        (peakTok ? `; peak batch throughput ${dec(peakTok.batch_tokens_per_s)} tokens/s at ${hms(peakTok.t)} UTC` : "") +
        (spans.length ? `; surges shaded: ${spans.map(([p, a, z]) => `${p} ${hms(a)}–${hms(z)}`).join(", ")}` : "; no surge"),
      series: [
        { key: "p50", label: "TTFT p50 (ms)", axis: "left", points: b.map((x) => [mid(x), x.chat_ttft_p50_ms]) },
        { key: "p99", label: "TTFT p99 (ms)", axis: "left", points: b.map((x) => [mid(x), x.chat_ttft_p99_ms]) },
        { key: "tokens", label: "Batch tokens/s (right axis)", axis: "right", points: b.map((x) => [mid(x), x.batch_tokens_per_s]) },
      ],
      shades: spans.map(([, a, z]) => [a, z]), shadeLabel: "Surge",
      xfmt: span > 6 * 3600 ? hm : hms, yfmt: (v) => `${compact(v)} ms`, y2fmt: compact,
      empty: "No interactive request or batch token in this window",
    });
    const text = readout([
      ["Latest TTFT", lastReq ? `p50 ${dec(lastReq.chat_ttft_p50_ms)} ms, p99 ${dec(lastReq.chat_ttft_p99_ms)} ms at ${hms(lastReq.t)} UTC` : "no request in the window"],
      ["Peak p99 TTFT", peak ? `${dec(peak.chat_ttft_p99_ms)} ms at ${hms(peak.t)} UTC` : "—"],
      ["Latest batch throughput", lastTok ? `${dec(lastTok.batch_tokens_per_s)} tokens/s at ${hms(lastTok.t)} UTC` : "no batch token in the window"],
      ["Peak batch throughput", peakTok ? `${dec(peakTok.batch_tokens_per_s)} tokens/s at ${hms(peakTok.t)} UTC` : "—"],
      ["In the window", `${int(requests)} requests, ${int(tokens)} batch tokens`],
      ["Surges", spans.length ? spans.map(([p, a, z]) => `${p} ${hms(a)}–${hms(z)} UTC`).join("; ") : "none"],
    ]);
    const rows = b.filter((x) => x.chat_requests || x.batch_tokens || x.surging.length).map((x) =>
      `<tr data-t="${x.t}"><td>${hms(x.t)}</td><td class="num">${int(x.chat_requests)}</td><td class="num">${dec(x.chat_ttft_p50_ms)}</td>` +
      `<td class="num">${dec(x.chat_ttft_p99_ms)}</td><td class="num">${dec(x.batch_tokens_per_s)}</td><td>${esc(x.surging.join(", ") || "—")}</td></tr>`);
    // One write each, and the source last: whoever reads data-source finds what it drew.
    $("timeline-figure").innerHTML = svg;
    $("timeline-readout").innerHTML = text;
    $("timeline-rows").innerHTML = rows.join("") || '<tr><td colspan="6" class="muted">No activity in this window.</td></tr>';
    $("timeline-count").textContent = String(rows.length);
    $("timeline-note").textContent = `From ${source}: interactive requests (chat and completions) counted when they were journaled.`;
    $("timeline-box").dataset.source = source;
  }

  // -- Tenants: usage against each limit -----------------------------------------------------

  async function tenantsPage(view, gen, [tenant]) {
    const admin = state.session.admin;
    if (!admin) { usage(view, gen, state.session.tenant, null); return; }
    view.innerHTML = `<h1 tabindex="-1">Tenants</h1><div class="split"><nav aria-label="Tenants"><ul id="tenant-list"><li class="muted">Loading…</li></ul></nav>
      <div id="tenant-detail">${tenant ? "" : '<p class="muted">Choose a tenant to see its usage against its limits.</p>'}</div></div>`;
    if (!state.session.admin_api) {
      $("tenant-list").innerHTML = `<li>${problem(new ApiError(0, "this listener does not answer /admin"), "The tenant list")}</li>`;
    } else {
      try {
        const list = (await get("/admin/tenants")).data;
        if (!live(gen)) return;
        $("tenant-list").innerHTML = list.map((t) => `<li><a href="#/tenants/${encodeURIComponent(t.id)}" data-tenant="${esc(t.id)}"${t.id === tenant ? ' aria-current="page"' : ""}>${esc(t.id)}</a></li>`).join("") ||
          '<li class="muted">No tenants.</li>';
      } catch (err) {
        if (!live(gen)) return;
        $("tenant-list").innerHTML = `<li>${problem(err, "The tenant list (GET /admin/tenants)")}</li>`;
      }
    }
    if (tenant) usage($("tenant-detail"), gen, tenant, tenant);
  }

  const DIMENSIONS = {
    requests_per_min: "Requests per minute", input_tokens_per_min: "Input tokens per minute",
    output_tokens_per_min: "Output tokens per minute", concurrent_requests: "Concurrent requests",
    tokens_per_day: "Tokens per day", batch_queue_tokens: "Queued batch tokens", concurrent_fine_tunes: "Concurrent fine-tunes",
  };

  // `as`: the tenant an admin asks about (query `tenant=`); null for a tenant's own key.
  async function usage(el, gen, tenant, as) {
    const q = as ? `&tenant=${encodeURIComponent(as)}` : "";
    const heading = as ? "h2" : "h1";
    el.innerHTML = `<${heading} tabindex="-1">Usage of tenant <span class="id">${esc(tenant)}</span></${heading}>
      <h3 id="limits-title">Limits now</h3><div id="limits">Loading…</div>
      <h3>Last hour, per minute</h3><div id="usage-minute" class="chart-block">Loading…</div>
      <h3>Last 14 days, per day</h3><div id="usage-day" class="chart-block">Loading…</div>`;
    const end = now();
    const minute = Math.floor(end / 60) * 60 - 59 * 60;
    const dayStart = Math.floor(end / 86400) * 86400 - 13 * 86400;
    const limitsUrl = `/v1/limits${as ? `?tenant=${encodeURIComponent(as)}` : ""}`;
    const byMinute = `/v1/usage/completions?start_time=${minute}&end_time=${end}&bucket_width=1m&group_by=model&group_by=service_tier&limit=60${q}`;
    const byDay = `/v1/usage/completions?start_time=${dayStart}&end_time=${end}&bucket_width=1d&group_by=model&group_by=service_tier&limit=14${q}`;
    const [limits, perMinute, perDay] = await Promise.allSettled([get(limitsUrl), usagePages(byMinute), usagePages(byDay)]);
    if (!live(gen)) return;
    const rows = limits.status === "fulfilled" ? limits.value.data : null;
    $("limits").innerHTML = rows ? limitsTable(rows, limitsUrl) : problem(limits.reason, `The limits (GET ${limitsUrl.split("?")[0]})`);
    const lim = (dim) => (rows || []).find((r) => r.limit === dim && r.model === "*");
    $("usage-minute").innerHTML = perMinute.status === "fulfilled"
      ? usageCharts("minute", perMinute.value, minute, minute + 3600, 60, [
        { id: "usage-tokens-minute", what: "tokens per minute", series: [["input", "Input tokens", (r) => r.input_tokens], ["output", "Output tokens", (r) => r.output_tokens]],
          limits: [["input_tokens_per_min", "input"], ["output_tokens_per_min", "output"]] },
        { id: "usage-requests-minute", what: "requests per minute", series: [["requests", "Requests", (r) => r.num_model_requests]], limits: [["requests_per_min", "requests"]] },
      ], lim, byMinute)
      : problem(perMinute.reason, "Usage (GET /v1/usage/completions)");
    $("usage-day").innerHTML = perDay.status === "fulfilled"
      ? usageCharts("day", perDay.value, dayStart, dayStart + 14 * 86400, 86400, [
        { id: "usage-tokens-day", what: "tokens per day", series: [["input", "Input + output tokens", (r) => r.input_tokens + r.output_tokens]], limits: [["tokens_per_day", "tokens"]] },
      ], lim, byDay)
      : problem(perDay.reason, "Usage (GET /v1/usage/completions)");
  }

  async function usagePages(url) {
    const buckets = [];
    let page = null;
    for (let i = 0; i < 20; i += 1) {
      const body = await get(page ? `${url}&page=${encodeURIComponent(page)}` : url);
      buckets.push(...body.data);
      if (!body.has_more || !body.next_page) break;
      page = body.next_page;
    }
    return buckets;
  }

  function limitsTable(rows, url) {
    if (!rows.length) return '<p class="muted">No limit is set on this tenant.</p>';
    return `<table id="limits-table" data-source="${esc(url)}"><thead><tr><th scope="col">Model</th><th scope="col">Limit</th>
      <th scope="col" class="num">Used</th><th scope="col" class="num">Allowed</th><th scope="col">Use</th></tr></thead><tbody>${
      rows.map((r) => {
        const share = r.allowed > 0 ? Math.min(1, r.used / r.allowed) : r.used > 0 ? 1 : 0;
        return `<tr data-model="${esc(r.model)}" data-limit="${esc(r.limit)}"><td>${esc(r.model === "*" ? "* (all models)" : r.model)}</td>
          <td>${esc(DIMENSIONS[r.limit] || r.limit)}</td><td class="num">${int(r.used)}</td><td class="num">${int(r.allowed)}</td>
          <td><progress max="1" value="${share.toFixed(4)}" aria-label="${esc(`${DIMENSIONS[r.limit] || r.limit}: ${int(r.used)} of ${int(r.allowed)}`)}"></progress> ${pct(r.allowed > 0 ? r.used / r.allowed : null)}</td></tr>`;
      }).join("")}</tbody></table>`;
  }

  function usageCharts(kind, buckets, x0, x1, step, specs, lim, url) {
    const total = (b, f) => (b.results || []).reduce((a, r) => a + (Number(f(r)) || 0), 0);
    const fmtT = kind === "minute" ? hm : day;
    const byModel = new Map();
    for (const b of buckets) {
      for (const r of b.results || []) {
        const tier = r.service_tier ?? r.tier ?? "—";
        const k = `${r.model ?? "—"}\u0000${tier}`;
        const t = byModel.get(k) || { model: r.model ?? "—", tier, input: 0, output: 0, requests: 0 };
        t.input += r.input_tokens || 0;
        t.output += r.output_tokens || 0;
        t.requests += r.num_model_requests || 0;
        byModel.set(k, t);
      }
    }
    let html = "";
    for (const s of specs) {
      const series = s.series.map(([key, lbl, f]) => ({ key, label: lbl, points: buckets.map((b) => [b.start_time + step / 2, total(b, f)]) }));
      const limits = s.limits.map(([dim]) => lim(dim)).filter(Boolean).map((l) => ({ value: l.allowed, label: `${DIMENSIONS[l.limit]} limit: ${int(l.allowed)}` }));
      const peaks = series.map((se) => {
        const best = se.points.reduce((a, p) => (!a || p[1] > a[1] ? p : a), null);
        return [`Peak ${se.label.toLowerCase()}`, best && best[1] > 0 ? `${int(best[1])} at ${fmtT(best[0] - step / 2)}${kind === "minute" ? " UTC" : ""}` : "0"];
      });
      const svg = chart({
        id: s.id, x0, x1, series, limits, xfmt: fmtT, yfmt: compact,
        title: `${s.what[0].toUpperCase()}${s.what.slice(1)}, ${kind === "minute" ? "last hour" : "last 14 days"}`,
        desc: `${peaks.map(([k, v]) => `${k}: ${v}`).join("; ")}; ${limits.length ? limits.map((l) => l.label).join("; ") : "no limit on all models together"}`,
        empty: "No usage in this window",
      });
      const text = readout([...peaks, ...series.map((se) => [`Total ${se.label.toLowerCase()}`, int(se.points.reduce((a, p) => a + p[1], 0))]),
        ["Limit (all models)", limits.length ? limits.map((l) => l.label).join("; ") : "none set"]]);
      const rows = buckets.filter((b) => (b.results || []).length).map((b) =>
        `<tr data-start="${b.start_time}">` + `<td>${esc(kind === "minute" ? hms(b.start_time) : day(b.start_time))}</td>` +
        series.map((se) => `<td class="num">${int(se.points.find((p) => p[0] === b.start_time + step / 2)[1])}</td>`).join("") + "</tr>");
      html += `<div class="chart" data-source="${esc(url)}"><div>${svg}</div>${text}</div>` +
        dataTable(`${s.id}-data`, "Buckets with usage", [{ label: "Bucket (UTC)" }, ...series.map((se) => ({ label: se.label, num: true }))], rows);
    }
    const models = [...byModel.values()].sort((a, b) => (a.model + a.tier).localeCompare(b.model + b.tier));
    html += `<table id="usage-${kind}-models"><caption class="note">By model and service tier, ${kind === "minute" ? "last hour" : "last 14 days"}</caption><thead><tr><th scope="col">Model</th><th scope="col">Tier</th>
      <th scope="col" class="num">Requests</th><th scope="col" class="num">Input tokens</th><th scope="col" class="num">Output tokens</th></tr></thead><tbody>${
      models.map((t) => `<tr><td>${esc(t.model)}</td><td>${esc(t.tier)}</td><td class="num">${int(t.requests)}</td><td class="num">${int(t.input)}</td><td class="num">${int(t.output)}</td></tr>`).join("") ||
      '<tr><td colspan="5" class="muted">No usage in this window.</td></tr>'}</tbody></table>`;
    return html;
  }

  // -- Batches (tenant) --------------------------------------------------------------------

  function batchesPage(view, gen) {
    view.innerHTML = `<h1 tabindex="-1">Batches</h1>
      <div class="bar"><button type="button" id="batches-prev">Previous page</button><span id="batches-page" aria-live="polite"></span>
        <button type="button" id="batches-next">Next page</button><button type="button" id="batches-refresh">Refresh</button></div>
      <div id="batches-error"></div>
      <table id="batches-table"><thead><tr><th scope="col">Batch</th><th scope="col">Status</th><th scope="col">Progress</th>
        <th scope="col" class="num">Preemptions</th><th scope="col">Estimated completion</th><th scope="col">Files</th></tr></thead>
        <tbody id="batches-rows"></tbody></table>`;
    const load = async () => {
      const at = state.batches.length - 1;
      const after = state.batches[at];
      $("batches-page").textContent = `Page ${at + 1}: loading…`;
      try {
        const page = await get(`/v1/batches?limit=${PAGE}${after ? `&after=${encodeURIComponent(after)}` : ""}`);
        if (!live(gen)) return;
        $("batches-error").innerHTML = "";
        $("batches-rows").innerHTML = page.data.map(batchRow).join("") || '<tr><td colspan="6" class="muted">No batches.</td></tr>';
        $("batches-page").textContent = `Page ${at + 1}: ${page.data.length} batches${page.has_more ? ", more after" : ""}`;
        $("batches-prev").disabled = at === 0;
        $("batches-next").disabled = !page.has_more;
        $("batches-next").dataset.after = page.last_id || "";
      } catch (err) {
        if (!live(gen)) return;
        $("batches-error").innerHTML = problem(err, "The batches (GET /v1/batches)");
        $("batches-page").textContent = `Page ${at + 1}`;
      }
    };
    $("batches-next").addEventListener("click", () => { state.batches.push($("batches-next").dataset.after); load(); });
    $("batches-prev").addEventListener("click", () => { if (state.batches.length > 1) state.batches.pop(); load(); });
    $("batches-refresh").addEventListener("click", load);
    $("batches-rows").addEventListener("click", download);
    $("batches-prev").disabled = true;
    $("batches-next").disabled = true;
    load();
  }

  function batchRow(b) {
    const c = b.request_counts || { total: 0, completed: 0, failed: 0 };
    const done = (c.completed || 0) + (c.failed || 0);
    const x = b.ballast || {};
    const eta = isNum(b.estimated_completion) ? `${when(b.estimated_completion)} (${ago(b.estimated_completion)})`
      : isNum(b.completed_at) ? `done ${when(b.completed_at)}` : "—";
    const file = (id, what) => (id ? `<button type="button" data-file="${esc(id)}" data-name="${esc(`${b.id}-${what}.jsonl`)}" aria-label="Download the ${what} file of ${esc(b.id)}">${esc(what)}</button>` : "");
    return `<tr data-id="${esc(b.id)}"><td><span class="id">${esc(b.id)}</span><br><span class="note">created ${esc(when(b.created_at))}</span></td>
      <td>${tag(b.status)}</td>
      <td><progress max="${Math.max(1, c.total)}" value="${done}" aria-label="${esc(`${b.id}: ${done} of ${c.total} requests done`)}"></progress>
        <span class="progress-text">${int(done)} / ${int(c.total)}${c.failed ? ` (${int(c.failed)} failed)` : ""}</span></td>
      <td class="num preemptions">${int(x.preemptions || 0)}${x.items_preempted ? ` (${int(x.items_preempted)} items)` : ""}</td>
      <td class="eta">${esc(eta)}</td>
      <td><div class="files">${file(b.input_file_id, "input")}${file(b.output_file_id, "output")}${file(b.error_file_id, "errors")}</div></td></tr>`;
  }

  async function download(event) {
    const button = event.target.closest("button[data-file]");
    if (!button) return;
    button.disabled = true;
    try {
      const blob = await (await request(`/v1/files/${encodeURIComponent(button.dataset.file)}/content`)).blob();
      const url = URL.createObjectURL(blob);
      const a = document.createElement("a");
      a.href = url;
      a.download = button.dataset.name;
      document.body.append(a);
      a.click();
      a.remove();
      setTimeout(() => URL.revokeObjectURL(url), 10000);
    } catch (err) {
      const cell = button.closest("td");
      if (cell) cell.insertAdjacentHTML("beforeend", problem(err, "The file"));
    } finally {
      button.disabled = false;
      button.focus();
    }
  }

  // -- Fine-tunes (tenant) -----------------------------------------------------------------

  function fineTunesPage(view, gen, [job]) {
    if (job) { fineTune(view, gen, job); return; }
    view.innerHTML = `<h1 tabindex="-1">Fine-tuning jobs</h1>
      <div class="bar"><button type="button" id="jobs-prev">Previous page</button><span id="jobs-page" aria-live="polite"></span>
        <button type="button" id="jobs-next">Next page</button><button type="button" id="jobs-refresh">Refresh</button></div>
      <div id="jobs-error"></div>
      <table id="jobs-table"><thead><tr><th scope="col">Job</th><th scope="col">Model</th><th scope="col">Status</th><th scope="col">Fine-tuned model</th>
        <th scope="col" class="num">Trained tokens</th><th scope="col">Created</th><th scope="col">Finished / estimated</th></tr></thead><tbody id="jobs-rows"></tbody></table>`;
    const load = async () => {
      const at = state.jobs.length - 1;
      const after = state.jobs[at];
      try {
        const page = await get(`/v1/fine_tuning/jobs?limit=${PAGE}${after ? `&after=${encodeURIComponent(after)}` : ""}`);
        if (!live(gen)) return;
        $("jobs-error").innerHTML = "";
        $("jobs-rows").innerHTML = page.data.map((j) => `<tr data-id="${esc(j.id)}"><td><a href="#/fine-tunes/${encodeURIComponent(j.id)}" class="id">${esc(j.id)}</a></td>
          <td>${esc(j.model)}</td><td>${tag(j.status)}</td><td class="id">${esc(j.fine_tuned_model || "—")}</td><td class="num">${int(j.trained_tokens)}</td>
          <td>${esc(when(j.created_at))}</td><td>${esc(isNum(j.finished_at) ? when(j.finished_at) : isNum(j.estimated_finish) ? `${when(j.estimated_finish)} (${ago(j.estimated_finish)})` : "—")}</td></tr>`).join("") ||
          '<tr><td colspan="7" class="muted">No fine-tuning jobs.</td></tr>';
        $("jobs-page").textContent = `Page ${at + 1}: ${page.data.length} jobs${page.has_more ? ", more after" : ""}`;
        $("jobs-prev").disabled = at === 0;
        $("jobs-next").disabled = !page.has_more;
        $("jobs-next").dataset.after = page.data.length ? page.data[page.data.length - 1].id : "";
      } catch (err) {
        if (!live(gen)) return;
        $("jobs-error").innerHTML = problem(err, "The fine-tuning jobs (GET /v1/fine_tuning/jobs)");
      }
    };
    $("jobs-next").addEventListener("click", () => { state.jobs.push($("jobs-next").dataset.after); load(); });
    $("jobs-prev").addEventListener("click", () => { if (state.jobs.length > 1) state.jobs.pop(); load(); });
    $("jobs-refresh").addEventListener("click", load);
    $("jobs-prev").disabled = true;
    $("jobs-next").disabled = true;
    load();
  }

  async function fineTune(view, gen, id) {
    const base = `/v1/fine_tuning/jobs/${encodeURIComponent(id)}`;
    view.innerHTML = `<p><a href="#/fine-tunes" id="jobs-back">← All fine-tuning jobs</a></p>
      <h1 tabindex="-1">Fine-tuning job <span class="id">${esc(id)}</span></h1>
      <div id="job-summary" class="cards"></div>
      <h2>Loss</h2><div id="job-loss" class="chart-block">Loading…</div>
      <h2>Checkpoints</h2><div id="job-checkpoints">Loading…</div>`;
    const [job, events, checkpoints] = await Promise.allSettled([get(base), all(`${base}/events`), all(`${base}/checkpoints`)]);
    if (!live(gen)) return;
    if (job.status === "rejected") { $("job-summary").innerHTML = problem(job.reason, "The job"); }
    else {
      const j = job.value;
      $("job-summary").innerHTML = [["Status", j.status], ["Model", j.model], ["Fine-tuned model", j.fine_tuned_model || "—"],
        ["Trained tokens", int(j.trained_tokens)], ["Created", when(j.created_at)],
        [isNum(j.finished_at) ? "Finished" : "Estimated finish", isNum(j.finished_at) ? when(j.finished_at) : when(j.estimated_finish)],
        ["Epochs · batch · LR ×", `${j.hyperparameters.n_epochs} · ${j.hyperparameters.batch_size} · ${j.hyperparameters.learning_rate_multiplier}`]]
        .map(([k, v]) => `<div class="card"><div class="k">${esc(k)}</div><div class="v">${esc(v)}</div></div>`).join("");
    }
    // A finished job's metrics file has every step's train loss (and the validation loss at
    // each checkpoint); before that, the events carry each checkpoint's.
    const metrics = job.status === "fulfilled" && (job.value.result_files || [])[0];
    let perStep = null;
    if (metrics) {
      try {
        perStep = parseMetrics(await (await request(`/v1/files/${encodeURIComponent(metrics)}/content`)).text());
      } catch (_) { perStep = null; /* deleted or unreadable: the events still say it */ }
      if (!live(gen)) return;
    }
    if (perStep && perStep.length) $("job-loss").innerHTML = lossChart(perStep, `/v1/files/${metrics}/content`, "Every step's train loss and each checkpoint's validation loss, from the job's metrics file.");
    else if (events.status === "rejected") $("job-loss").innerHTML = problem(events.reason, `The job's events (GET ${base}/events)`);
    else {
      // Oldest first; the lines that carry a step's metrics (a checkpoint's).
      const points = events.value.filter((e) => e.data && isNum(e.data.step)).map((e) => e.data).sort((a, b) => a.step - b.step);
      $("job-loss").innerHTML = lossChart(points, `${base}/events`, "Each checkpoint's metrics, from the job's events.");
    }
    if (checkpoints.status === "rejected") $("job-checkpoints").innerHTML = problem(checkpoints.reason, `The checkpoints (GET ${base}/checkpoints)`);
    else {
      $("job-checkpoints").innerHTML = `<table id="checkpoints-table"><thead><tr><th scope="col" class="num">Step</th><th scope="col" class="num">Train loss</th>
        <th scope="col">Created</th><th scope="col">Checkpoint model</th><th scope="col">SHA-256</th></tr></thead><tbody>${
        checkpoints.value.map((c) => `<tr data-id="${esc(c.id)}"><td class="num">${int(c.step_number)}</td><td class="num">${dec((c.metrics || {}).train_loss, 4)}</td>
          <td>${esc(when(c.created_at))}</td><td class="id">${esc(c.fine_tuned_model_checkpoint)}</td><td class="id" title="${esc(c.sha256 || "")}">${esc((c.sha256 || "").slice(0, 12))}</td></tr>`).join("") ||
        '<tr><td colspan="5" class="muted">No checkpoint yet.</td></tr>'}</tbody></table>`;
    }
  }

  // The metrics CSV (step, train_loss, train_accuracy, valid_loss, …): numbers only.
  function parseMetrics(text) {
    const [head, ...lines] = text.trim().split(/\r?\n/);
    const cols = head.split(",");
    const at = (name) => cols.indexOf(name);
    const value = (cells, name) => (at(name) >= 0 && cells[at(name)] !== "" ? Number(cells[at(name)]) : null);
    return lines.map((ln) => ln.split(",")).map((c) => ({ step: value(c, "step"), train_loss: value(c, "train_loss"), valid_loss: value(c, "valid_loss") }))
      .filter((p) => isNum(p.step)).sort((a, b) => a.step - b.step);
  }

  function lossChart(points, source, note) {
    const steps = points.map((p) => p.step);
    const lastTrain = [...points].reverse().find((p) => isNum(p.train_loss));
    const lastValid = [...points].reverse().find((p) => isNum(p.valid_loss));
    const hasValid = points.some((p) => isNum(p.valid_loss));
    const series = [{ key: "train", label: "Train loss", points: points.filter((p) => isNum(p.train_loss)).map((p) => [p.step, p.train_loss]) }];
    if (hasValid) series.push({ key: "valid", label: "Validation loss", points: points.filter((p) => isNum(p.valid_loss)).map((p) => [p.step, p.valid_loss]) });
    const svg = chart({
      id: "loss-chart", x0: Math.min(0, ...steps), x1: Math.max(1, ...steps), series, xfmt: (x) => `step ${Math.round(x)}`, yfmt: (v) => v.toFixed(2),
      title: "Training and validation loss by step",
      desc: `${points.length} steps reported` + (lastTrain ? `; train loss ${dec(lastTrain.train_loss, 4)} at step ${lastTrain.step}` : "") +
        (lastValid ? `; validation loss ${dec(lastValid.valid_loss, 4)} at step ${lastValid.step}` : "; no validation loss"),
      empty: "No step has reported a loss yet",
    });
    const text = readout([
      ["Latest train loss", lastTrain ? `${dec(lastTrain.train_loss, 4)} at step ${lastTrain.step}` : "—"],
      ["Latest validation loss", lastValid ? `${dec(lastValid.valid_loss, 4)} at step ${lastValid.step}` : "none (no validation file, or no checkpoint yet)"],
      ["Steps with a loss", int(points.length)],
    ]);
    const rows = points.map((p) => `<tr data-step="${p.step}"><td class="num">${int(p.step)}</td><td class="num">${dec(p.train_loss, 4)}</td><td class="num">${dec(p.valid_loss, 4)}</td></tr>`);
    return `<div class="chart" data-source="${esc(source)}"><div>${svg}</div>${text}</div>` +
      dataTable("loss-data", "Loss by step", [{ label: "Step", num: true }, { label: "Train loss", num: true }, { label: "Validation loss", num: true }], rows,
        `${note} Source: ${source}.`);
  }

  boot();
})();
