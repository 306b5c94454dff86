// The monitor page: draws each snapshot from /events on canvases and SVG. Self-contained, no library.
"use strict";
const COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf"];
const GROUP_COLORS = ["#fde0dd", "#d0e8ff", "#dff5d0", "#fff0b3", "#eadcff", "#ffe0c0", "#d5f5f0", "#f0f0f0"];
let snap = null, storyPrompt = null, storyBusy = false, lastStoryAt = 0;
const $ = (id) => document.getElementById(id);
const color = (models, m) => COLORS[models.indexOf(m) % COLORS.length];
const fmt = (v, d = 3) => (v === null || v === undefined) ? "-" : Number(v).toFixed(d);
const esc = (s) => String(s).replace(/[&<>"]/g, (c) => ({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;"}[c]));

// --- charts: lines (or dots) per model on a canvas; data-points says how many points were drawn ---
function chart(canvas, lines, opts = {}) {
  const ctx = canvas.getContext("2d"), W = canvas.width, H = canvas.height, L = 46, B = 26, T = 8, R = 10;
  ctx.clearRect(0, 0, W, H);
  const pts = lines.flatMap((l) => l.points);
  canvas.dataset.points = pts.length;
  ctx.font = "11px sans-serif"; ctx.fillStyle = "#666";
  if (!pts.length) { ctx.fillText("no data yet", W / 2 - 30, H / 2); return; }
  let [x0, x1] = [Math.min(...pts.map((p) => p[0])), Math.max(...pts.map((p) => p[0]))];
  let [y0, y1] = opts.y || [Math.min(...pts.map((p) => p[1])), Math.max(...pts.map((p) => p[1]))];
  if (x1 === x0) x1 = x0 + 1; if (y1 === y0) { y0 -= 0.5; y1 += 0.5; }
  const X = (x) => L + (x - x0) / (x1 - x0) * (W - L - R), Y = (y) => H - B - (y - y0) / (y1 - y0) * (H - B - T);
  ctx.strokeStyle = "#ccc"; ctx.beginPath(); ctx.moveTo(L, T); ctx.lineTo(L, H - B); ctx.lineTo(W - R, H - B); ctx.stroke();
  for (let i = 0; i <= 4; i++) {
    const y = y0 + (y1 - y0) * i / 4, x = x0 + (x1 - x0) * i / 4;
    ctx.fillText(fmt(y, Math.abs(y1 - y0) < 5 ? 2 : 0), 2, Y(y) + 4);
    ctx.fillText(fmt(x, Math.abs(x1 - x0) < 5 ? 1 : 0), X(x) - 10, H - B + 14);
  }
  if (opts.xlabel) ctx.fillText(opts.xlabel, W - R - ctx.measureText(opts.xlabel).width, H - 2);
  lines.forEach((l, k) => {
    ctx.strokeStyle = ctx.fillStyle = l.color; ctx.lineWidth = 1.5;
    if (l.dots) l.points.forEach((p) => { ctx.beginPath(); ctx.arc(X(p[0]), Y(p[1]), 3, 0, 7); ctx.fill(); });
    else { ctx.beginPath(); l.points.forEach((p, i) => i ? ctx.lineTo(X(p[0]), Y(p[1])) : ctx.moveTo(X(p[0]), Y(p[1]))); ctx.stroke(); }
    ctx.fillText(l.label, L + 8 + 90 * k, T + 10);
  });
}

function bars(canvas, models, hists) {
  const ctx = canvas.getContext("2d"), W = canvas.width, H = canvas.height, L = 40, B = 24, n = 9;
  ctx.clearRect(0, 0, W, H); ctx.font = "11px sans-serif";
  const shares = models.map((m) => { const h = hists[m], s = h.reduce((a, b) => a + b, 0) || 1; return h.map((c) => c / s); });
  canvas.dataset.points = models.reduce((a, m) => a + hists[m].reduce((x, y) => x + y, 0), 0);
  const bw = (W - L - 10) / n / Math.max(models.length, 1);
  shares.forEach((sh, k) => sh.forEach((v, i) => {
    ctx.fillStyle = color(models, models[k]);
    ctx.fillRect(L + (i * models.length + k) * bw, H - B - v * (H - B - 14), bw - 1, v * (H - B - 14));
  }));
  ctx.fillStyle = "#666";
  for (let i = 0; i < n; i++) ctx.fillText(i === n - 1 ? "8+" : String(i), L + (i + 0.4) * bw * models.length, H - 8);
  ctx.fillText("share", 2, 14);
  models.forEach((m, k) => { ctx.fillStyle = color(models, m); ctx.fillText(m, W - 90, 14 + 13 * k); });
}

function drawModels(s) {
  const models = Object.keys(s.models), byTime = $("xaxis").value === "time", t0 = s.t0 || 0;
  const xOf = (p) => byTime ? p[1] - t0 : p[0], xl = byTime ? "seconds" : "own samples trained";
  chart($("chart-reward"), models.map((m) => ({label: m, color: color(models, m),
    points: s.models[m].reward.map((p) => [xOf(p), p[2]])})), {y: [0, 1], xlabel: xl});
  chart($("chart-accuracy"), models.map((m) => {
    const v = s.models[m], pts = v.accuracy.map((p) => [xOf(p), p[2]]);
    if (v.warm_accuracy !== null) pts.unshift([byTime ? 0 : 0, v.warm_accuracy]);
    const last = v.reward.length ? xOf(v.reward[v.reward.length - 1]) : 0;
    if (v.final_accuracy !== null) pts.push([last, v.final_accuracy]);
    return {label: m, color: color(models, m), points: pts, dots: true};
  }), {y: [0, 1], xlabel: xl});
  chart($("chart-length"), models.map((m) => ({label: m, color: color(models, m),
    points: s.models[m].length.map((p) => [p[0] - t0, p[1]])})), {xlabel: "seconds"});
  bars($("chart-staleness"), models, Object.fromEntries(models.map((m) => [m, s.models[m].staleness])));
  $("throughput").innerHTML = "<tr><th>model</th><th>step</th><th>samples/s</th><th>tokens/s</th><th>samples generated</th>" +
    "<th>mean staleness</th><th>held-out acc (warm → final)</th></tr>" + models.map((m) => { const v = s.models[m];
    return `<tr><td style="color:${color(models, m)}">${esc(m)}</td><td>${v.step}</td><td>${fmt(v.samples_per_s, 1)}</td>` +
      `<td>${fmt(v.tokens_per_s, 0)}</td><td>${v.samples}</td><td>${fmt(v.staleness_mean, 2)}</td>` +
      `<td>${fmt(v.warm_accuracy)} → ${fmt(v.final_accuracy)}</td></tr>`; }).join("");
}

// --- the exchange: models on a circle, a curved arrow per directed pair ---
function drawExchange(s) {
  const svg = $("exchange"), models = Object.keys(s.models), n = models.length, cx = 230, cy = 150, r = 105;
  const pos = Object.fromEntries(models.map((m, i) => [m, [cx + r * Math.cos(Math.PI + 2 * Math.PI * i / n),
    cy + r * Math.sin(Math.PI + 2 * Math.PI * i / n)]]));
  let out = '<defs><marker id="arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="10" markerHeight="10" markerUnits="userSpaceOnUse" orient="auto">' +
    '<path d="M0,0L10,5L0,10z" fill="#555"/></marker></defs>';
  for (const e of s.edges) {
    const [a, b] = [pos[e.src], pos[e.dst]], dx = b[0] - a[0], dy = b[1] - a[1], len = Math.hypot(dx, dy) || 1;
    const [ux, uy] = [dx / len, dy / len], [nx, ny] = [-uy, ux], bend = 40;
    const p = [a[0] + ux * 30, a[1] + uy * 30], q = [b[0] - ux * 30, b[1] - uy * 30];
    const c = [(p[0] + q[0]) / 2 + nx * bend, (p[1] + q[1]) / 2 + ny * bend], w = 1 + Math.min(6, Math.log1p(e.rate));
    out += `<g class="edge" data-src="${esc(e.src)}" data-dst="${esc(e.dst)}"><path d="M${p}Q${c} ${q}" fill="none" ` +
      `stroke="${color(models, e.src)}" stroke-width="${w}" marker-end="url(#arrow)"/>` +
      `<text x="${c[0] - 55}" y="${c[1]}" font-size="11">${fmt(e.rate, 1)} exp/s · rescued ${fmt(e.rescue, 0)}</text>` +
      `<text x="${c[0] - 55}" y="${c[1] + 13}" font-size="11">THL residual ${fmt(e.residual, 2)}</text></g>`;
  }
  for (const m of models) out += `<g class="node"><circle cx="${pos[m][0]}" cy="${pos[m][1]}" r="28" fill="#fff" ` +
    `stroke="${color(models, m)}" stroke-width="3"/><text x="${pos[m][0]}" y="${pos[m][1] + 4}" text-anchor="middle">${esc(m)}</text></g>`;
  svg.innerHTML = out;
  $("edges").innerHTML = "<tr><th>sender → receiver</th><th>exp/s</th><th>rescued</th><th>THL residual</th>" +
    "<th>received*</th><th>used*</th><th>late*</th><th>dropped*</th></tr>" + s.edges.map((e) =>
    `<tr><td>${esc(e.src)} → ${esc(e.dst)}</td><td>${fmt(e.rate, 1)}</td><td>${fmt(e.rescue, 0)}</td><td>${fmt(e.residual, 3)}</td>` +
    `<td>${e.received}</td><td>${e.used}</td><td>${e.late}</td><td>${e.dropped}</td></tr>`).join("") +
    '<tr><td colspan="8" style="text-align:left">* the receiver\'s counters over all its peers: received = peer samples ' +
    "that reached its learner, used = those its objective read</td></tr>";
  $("residual-note").textContent = s.residual_note;
}

// --- MWRA: a row per worker, a coloured span per (role, model), the reason as the span's tooltip ---
function drawTimeline(s) {
  const svg = $("timeline"), workers = Object.keys(s.workers).sort(), models = Object.keys(s.models);
  const W = 940, L = 50, t0 = s.t0 || 0, t1 = Math.max(s.now, t0 + 1), X = (t) => L + (t - t0) / (t1 - t0) * (W - L - 10);
  svg.setAttribute("height", 24 + 20 * workers.length);
  let out = "";
  workers.forEach((w, i) => {
    const spans = s.workers[w], y = 8 + 20 * i;
    out += `<text x="4" y="${y + 12}" font-size="11">${esc(w)}</text>`;
    spans.forEach((sp, k) => {
      const a = X(Math.max(sp[0], t0)), b = X(k + 1 < spans.length ? spans[k + 1][0] : t1);
      const fill = sp[1] === "idle" ? "#ccc" : color(models, sp[2]), op = sp[1] === "learner" ? 0.45 : 0.9;
      out += `<g class="span"><rect x="${a}" y="${y}" width="${Math.max(b - a, 1)}" height="16" fill="${fill}" opacity="${op}">` +
        `<title>${esc(sp[1] + " " + sp[2] + ": " + sp[3])}</title></rect><text x="${a + 3}" y="${y + 12}" font-size="10">` +
        `${esc(sp[1][0] + ":" + sp[2])}</text></g>`;
    });
  });
  svg.innerHTML = out + `<text x="${L}" y="${20 * workers.length + 22}" font-size="10">g: generator (solid), l: learner (pale); ` +
    `hover a span for the controller's reason</text>`;
  $("moves").innerHTML = s.moves.slice(-8).map((m) => `<li>${fmt(m.time - t0, 1)} s: ${esc(m.reason)}</li>`).join("") ||
    `<li>no move yet (${s.decisions_without_move} controller decisions kept the allocation)</li>`;
}

// --- a prompt's story ---
function tokens(list, groups) {
  return list.map((t, i) => `<span class="tok" style="background:${GROUP_COLORS[(groups ? groups[i] : i) % GROUP_COLORS.length]}">` +
    `${esc(t)}</span>`).join("");
}

function drawStory(st) {
  if (st.error) { $("story").innerHTML = `<p class="note">${esc(st.error)}</p>`; return; }
  const cols = Object.entries(st.models).map(([m, samples]) => `<div class="story-model" data-model="${esc(m)}"><b>${esc(m)}</b>` +
    ` (${samples.length} samples)` + samples.map((x) => `<div class="sample">#${x.sample} reward ${fmt(x.reward, 2)} ` +
    `<span class="${x.verified ? "ok" : "bad"}">${x.verified ? "✓" : "✗"}</span> v${x.weight_version} staleness ${x.staleness} ` +
    `(${esc(x.generator)}, ${x.finish})<br>${tokens(x.tokens, Object.values(x.bridged)[0]?.src_group)}` +
    Object.entries(x.bridged).map(([d, b]) => b.error ? `<div class="bridged">→ ${esc(d)}: ${esc(b.error)}</div>` :
      `<div class="bridged">→ ${esc(d)}: ${tokens(b.tokens, b.group)} residual ${fmt(b.residual, 2)}</div>`).join("") +
    "</div>").join("") + "</div>").join("");
  $("story").innerHTML = `<p>prompt <b>${st.prompt_id}</b>: <code>${esc(st.prompt)}</code></p><div class="story-models">${cols}</div>` +
    `<p class="note">${esc(st.note)}</p>` + (st.missing.length ? `<p class="note">missing: ${esc(st.missing.join("; "))}</p>` : "");
}

async function loadStory(which) {
  if (storyBusy) return;
  storyBusy = true;
  try { const st = await (await fetch(`/story?prompt=${which}`)).json(); storyPrompt = st.prompt_id ?? storyPrompt; drawStory(st); }
  finally { storyBusy = false; lastStoryAt = Date.now(); }
}

function drawPrompts(s) {
  $("prompts").innerHTML = "recent prompts: " + s.prompts.slice(-20).reverse().map((p) =>
    `<a data-prompt="${p}" class="${p === storyPrompt ? "current" : ""}">${p}</a>`).join("");
  if ($("follow").checked && Date.now() - lastStoryAt > 3000 && s.prompts.length) loadStory("latest");
}

$("prompts").addEventListener("click", (ev) => {
  const p = ev.target.dataset.prompt;
  if (p !== undefined) { $("follow").checked = false; loadStory(p); }
});

function draw(s) {
  snap = s;
  $("run").textContent = `${s.run} (${s.mode}${s.ended ? ", ended" : ""})`;
  const cap = s.sample_cap ? ` (a monitor gets at most ${s.sample_cap} experiences/s; samples/s are the broker's)` : "";
  const missed = s.missed ? `<span class="warn">${s.missed} missed${cap}</span>` : "0 missed";
  $("status").innerHTML = `${s.received} experiences seen, ${missed}: showing ${fmt(100 * s.shown, 1)}% of the exchange` +
    (s.broker.accepted !== undefined ? ` · broker accepted ${s.broker.accepted}, dropped ${s.broker.dropped}` : "") +
    (s.events.length ? ` · ${esc(s.events[s.events.length - 1].text)}` : "");
  drawModels(s); drawExchange(s); drawTimeline(s); drawPrompts(s);
}

$("xaxis").addEventListener("change", () => snap && drawModels(snap));
const source = new EventSource("/events");
source.onmessage = (ev) => draw(JSON.parse(ev.data));
source.onerror = () => { $("status").textContent = "disconnected (the monitor stopped); reload to reconnect"; };
