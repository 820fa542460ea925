/* Hangar pages: live updates pushed over the page websockets, TTL countdowns, small helpers.
   Plain ES2017, no build step. */
(function () {
  "use strict";

  // -- live pushes ---------------------------------------------------------------------------
  // The page sockets (/ws/ui/...) send out-of-band fragments, each element inside its own
  // <template> so that table rows parse on their own. The websocket extension swaps only the
  // top-level elements of a message, so the message goes through htmx.swap instead, which also
  // swaps the out-of-band elements found inside templates.
  document.addEventListener("htmx:wsBeforeMessage", function (evt) {
    var elt = evt.target;
    if (!elt.hasAttribute("ws-connect") || typeof evt.detail.message !== "string") return;
    evt.preventDefault();
    htmx.swap(elt, evt.detail.message, { swapStyle: "none", ignoreTitle: true });
    afterLivePush();
  });

  function afterLivePush() {
    followJobLog();
    offerBuiltImage();
    dedupeEvents();
    refreshTabIfStale();
    tickCountdowns();
  }

  // An image job's log is redrawn on each push: keep showing its end, and stop listening once
  // the job is over (the server closes the socket then too).
  function followJobLog() {
    var log = document.getElementById("job-log");
    if (log) log.scrollTop = log.scrollHeight;
  }

  // The image a harness needs, built while its form is open: offer it there at once, chosen.
  function offerBuiltImage() {
    var job = document.querySelector("#harness-image-job [data-status='succeeded'][data-image]");
    var select = document.getElementById("h-image");
    if (!job || !select) return;
    var name = job.getAttribute("data-image");
    Array.prototype.slice.call(select.options).forEach(function (o) {
      if (o.value === "") o.remove(); // the "not built yet" placeholder
    });
    var have = Array.prototype.some.call(select.options, function (o) { return o.value === name; });
    if (!have) select.add(new Option(name, name));
    select.value = name;
    var missing = document.getElementById("image-missing");
    if (missing) missing.hidden = true;
  }

  // A socket that reconnects asks again for events after the id it was opened with.
  function dedupeEvents() {
    var body = document.getElementById("events-body");
    if (!body) return;
    var seen = {};
    Array.prototype.slice.call(body.querySelectorAll("tr[id]")).forEach(function (tr) {
      if (seen[tr.id]) tr.remove();
      seen[tr.id] = true;
    });
  }

  // The tabs were drawn for the status the sandbox had then (e.g. "starting…"): redraw them
  // once it has moved on. The Events tab grows by itself.
  function refreshTabIfStale() {
    var header = document.getElementById("sb-header");
    var tabs = document.getElementById("tabs");
    if (!header || !tabs || header.dataset.status === tabs.dataset.status) return;
    if (tabs.dataset.tab === "events") {
      tabs.dataset.status = header.dataset.status;
      return;
    }
    tabs.dataset.status = header.dataset.status; // one refresh per change
    htmx.ajax("GET", location.pathname + location.search, { target: "#tabs", swap: "outerHTML" });
  }

  // A row pushed for a sandbox that is not on the page: a new one appears at the top of the
  // first page, if it fits the filter. Older ones belong to other pages and are left out.
  document.addEventListener("htmx:oobErrorNoTarget", function (evt) {
    var row = evt.detail.content;
    var body = document.getElementById("sandbox-rows");
    if (!body || !row || row.tagName !== "TR" || row.id.indexOf("sb-") !== 0) return;
    if (body.dataset.page !== "1") return;
    var filter = body.dataset.filter;
    var status = row.dataset.status;
    if (filter === "active" ? status === "deleted" : filter !== status) return;
    var newest = body.querySelector("tr[data-created]");
    if (newest && Number(row.dataset.created) < Number(newest.dataset.created)) return;
    var empty = body.querySelector("tr.empty-row");
    if (empty) empty.remove();
    body.insertBefore(row, body.firstChild);
    row.classList.add("fresh");
    htmx.process(row);
    tickCountdowns();
  });

  // -- TTL countdowns --------------------------------------------------------------------------
  function formatLeft(ms) {
    if (ms <= 0) return "expired";
    var s = Math.floor(ms / 1000);
    var d = Math.floor(s / 86400);
    var h = Math.floor((s % 86400) / 3600);
    var m = Math.floor((s % 3600) / 60);
    if (d) return d + "d " + h + "h";
    if (h) return h + "h " + m + "m";
    if (m) return m + "m " + (s % 60) + "s";
    return s + "s";
  }

  function tickCountdowns() {
    var now = Date.now();
    var nodes = document.querySelectorAll("[data-expires]");
    for (var i = 0; i < nodes.length; i++) {
      var at = Date.parse(nodes[i].dataset.expires);
      if (isNaN(at)) continue;
      var left = at - now;
      nodes[i].textContent = formatLeft(left);
      nodes[i].classList.toggle("soon", left > 0 && left < 5 * 60 * 1000);
      nodes[i].classList.toggle("expired", left <= 0);
    }
  }
  setInterval(tickCountdowns, 1000);

  // -- small helpers ---------------------------------------------------------------------------
  document.addEventListener("change", function (evt) {
    var el = evt.target;
    if (el.hasAttribute && el.hasAttribute("data-autosubmit") && el.form) el.form.submit();
  });

  document.addEventListener("click", function (evt) {
    var opener = evt.target.closest && evt.target.closest("[data-open]");
    if (opener) {
      var panel = document.querySelector(opener.getAttribute("data-open"));
      if (panel) {
        evt.preventDefault();
        panel.open = true;
        panel.scrollIntoView({ block: "nearest" });
        var first = panel.querySelector("select, input, textarea");
        if (first) first.focus();
      }
    }
    // Close the user menu when clicking elsewhere.
    document.querySelectorAll("details.user-menu[open]").forEach(function (menu) {
      if (!menu.contains(evt.target)) menu.open = false;
    });
  });

  // "Copy" next to a value shown once (a new token, an invitation link).
  document.addEventListener("click", function (evt) {
    var btn = evt.target.closest ? evt.target.closest("[data-copy]") : null;
    if (!btn) return;
    var field = document.querySelector(btn.getAttribute("data-copy"));
    if (!field) return;
    field.select();
    var done = function () { btn.textContent = "Copied"; };
    if (navigator.clipboard && window.isSecureContext) {
      navigator.clipboard.writeText(field.value).then(done, function () { document.execCommand("copy"); done(); });
    } else {
      document.execCommand("copy");
      done();
    }
  });

  // Forms that work without htmx still ask before deleting.
  document.addEventListener("submit", function (evt) {
    var form = evt.target;
    if (form.hasAttribute("data-confirm") && !form.hasAttribute("hx-post") && !confirm(form.getAttribute("data-confirm"))) {
      evt.preventDefault();
    }
  });

  // Errors of htmx requests (403 for viewers, 5xx, network) as a toast instead of silence.
  function toast(text, kind) {
    var box = document.getElementById("toasts");
    if (!box) return;
    var el = document.createElement("div");
    el.className = "toast " + (kind || "error");
    el.setAttribute("role", "alert");
    el.textContent = text;
    box.appendChild(el);
    setTimeout(function () { el.classList.add("gone"); }, 6000);
    setTimeout(function () { el.remove(); }, 6600);
  }
  window.hangarToast = toast;

  document.addEventListener("htmx:responseError", function (evt) {
    var xhr = evt.detail.xhr;
    var text = "";
    if ((xhr.getResponseHeader("Content-Type") || "").indexOf("text/plain") === 0 || xhr.responseText.length < 300) {
      text = xhr.responseText.replace(/<[^>]*>/g, " ").replace(/\s+/g, " ").trim();
    }
    toast(text || "The server answered " + xhr.status + " " + xhr.statusText + ".");
  });
  document.addEventListener("htmx:sendError", function () {
    toast("The server could not be reached. Check your connection and try again.");
  });

  document.addEventListener("DOMContentLoaded", tickCountdowns);
})();
