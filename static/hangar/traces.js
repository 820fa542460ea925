// A trace's waterfall: collapse a span's subtree (its toggle), keep the picked row marked.
(function () {
  "use strict";
  function rowsAfter(row) {
    const depth = Number(row.dataset.depth);
    const out = [];
    for (let r = row.nextElementSibling; r && Number(r.dataset.depth) > depth; r = r.nextElementSibling) out.push(r);
    return out;
  }
  document.addEventListener("click", function (ev) {
    const toggle = ev.target.closest(".wf-toggle");
    if (toggle) {
      ev.stopPropagation();
      ev.preventDefault();
      const row = toggle.closest(".wf-row");
      const open = toggle.getAttribute("aria-expanded") === "true";
      toggle.setAttribute("aria-expanded", open ? "false" : "true");
      toggle.textContent = open ? "▸" : "▾";
      for (const r of rowsAfter(row)) {
        if (open) r.hidden = true;
        else {
          r.hidden = false;
          const inner = r.querySelector(".wf-toggle");
          if (inner) { inner.setAttribute("aria-expanded", "true"); inner.textContent = "▾"; }
        }
      }
      return;
    }
    const row = ev.target.closest(".wf-row");
    if (row) {
      document.querySelectorAll(".wf-row.picked").forEach(function (r) { r.classList.remove("picked"); });
      row.classList.add("picked");
    }
  }, true);
})();

// Live growth: a trace's last page takes the spans stored after it was rendered, from its socket
// (/ws/ui/traces/{id}, see dashboard/websockets/trace_live.py), each in its place in the tree;
// the bars are laid out again over the trace's new extent. Times are nanoseconds as BigInt:
// a Number loses them.
(function () {
  "use strict";
  const wf = document.getElementById("waterfall");
  if (!wf || !wf.dataset.live) return;
  const rowsEl = wf.querySelector(".wf-rows");
  let after = wf.dataset.after || "0";
  let base = BigInt(wf.dataset.start);
  let end = BigInt(wf.dataset.end);
  let retry = 1000;

  function note(text) {
    const el = document.getElementById("trace-live-note");
    if (el) { el.textContent = text; el.hidden = !text; }
  }

  function plural(n, word) { return n + " " + word + (n === 1 ? "" : "s"); }

  function summary(t) {
    base = BigInt(t.start_ns);
    end = BigInt(t.end_ns);
    const count = document.getElementById("trace-span-count");
    if (count) count.textContent = plural(t.span_count, "span");
    const dur = document.getElementById("trace-duration");
    if (dur) dur.textContent = t.duration_ms.toFixed(1) + " ms";
    const errors = document.getElementById("trace-errors");
    if (errors && t.error_count) {
      errors.textContent = "";
      const badge = document.createElement("span");
      badge.className = "badge bad";
      badge.textContent = plural(t.error_count, "error");
      errors.append(badge, " · ");
    }
    const h1 = document.querySelector(".page-head h1");
    if (h1 && t.root_name) h1.textContent = t.root_name;
  }

  // Rows in tree order (children under their parent, by start), depth and toggles set, bars
  // placed; a collapsed subtree stays collapsed, with its new rows in it.
  function relayout() {
    const rows = Array.from(rowsEl.children);
    const byId = new Map(rows.map(function (r) { return [r.dataset.span, r]; }));
    const kids = new Map();
    const roots = [];
    for (const r of rows) {
      const p = r.dataset.parent;
      if (p && p !== r.dataset.span && byId.has(p)) {
        if (!kids.has(p)) kids.set(p, []);
        kids.get(p).push(r);
      } else roots.push(r);
    }
    const byStart = function (a, b) {
      const d = BigInt(a.dataset.start) - BigInt(b.dataset.start);
      return d < 0n ? -1 : d > 0n ? 1 : 0;
    };
    const total = Number(end - base) || 1;
    const seen = new Set();
    const order = [];
    const stack = roots.sort(byStart).reverse().map(function (r) { return [r, 0]; });
    while (stack.length) {
      const [r, depth] = stack.pop();
      if (seen.has(r)) continue;
      seen.add(r);
      order.push(r);
      r.dataset.depth = String(depth);
      r.querySelector(".wf-name").style.paddingLeft = Math.min(depth, 30) + "em";
      const children = (kids.get(r.dataset.span) || []).sort(byStart);
      if (children.length && !r.querySelector(".wf-toggle")) {
        const leaf = r.querySelector(".wf-leaf");
        const toggle = document.createElement("button");
        toggle.type = "button";
        toggle.className = "wf-toggle";
        toggle.setAttribute("aria-label", "collapse");
        toggle.setAttribute("aria-expanded", "true");
        toggle.textContent = "▾";
        if (leaf) leaf.replaceWith(toggle);
      }
      const start = BigInt(r.dataset.start);
      const bar = r.querySelector(".wf-bar");
      bar.style.left = (100 * Number(start - base) / total).toFixed(3) + "%";
      bar.style.width = Math.max(100 * Number(BigInt(r.dataset.end) - start) / total, 0.3).toFixed(3) + "%";
      for (let i = children.length - 1; i >= 0; i--) stack.push([children[i], depth + 1]);
    }
    for (const r of order) { rowsEl.appendChild(r); r.hidden = false; }
    for (const r of order) {
      const toggle = r.querySelector(".wf-toggle");
      if (toggle && toggle.getAttribute("aria-expanded") === "false") {
        const depth = Number(r.dataset.depth);
        for (let n = r.nextElementSibling; n && Number(n.dataset.depth) > depth; n = n.nextElementSibling) n.hidden = true;
      }
    }
  }

  function add(msg) {
    for (const row of msg.rows) {
      const tpl = document.createElement("template");
      tpl.innerHTML = row.html.trim();
      const el = tpl.content.firstElementChild;
      rowsEl.appendChild(el);
      if (window.htmx) window.htmx.process(el);
      if (BigInt(row.id) > BigInt(after)) after = String(row.id);
    }
    summary(msg.trace);
    relayout();
  }

  function connect() {
    const scheme = location.protocol === "https:" ? "wss:" : "ws:";
    const ws = new WebSocket(scheme + "//" + location.host + wf.dataset.live + "?after=" + after);
    ws.onopen = function () { retry = 1000; note(""); };
    ws.onmessage = function (ev) {
      const msg = JSON.parse(ev.data);
      if (msg.type === "spans") add(msg);
      else if (msg.type === "more") note("More spans arrived than this page holds: reload to see them.");
    };
    ws.onclose = function (ev) {
      if (ev.code >= 4000 || ev.code === 1000) return;  // refused, or the page is full: no retry
      note("Live updates lost; reconnecting…");
      setTimeout(connect, retry);
      retry = Math.min(retry * 2, 30000);
    };
  }
  connect();
})();
