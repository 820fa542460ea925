/* Commands: follow a running process's output over /ws/v1/sandboxes/<id>/exec?process=<exec id>.
 *
 * Markup: <div class="cmd-run" data-process-id="…" data-ws="/ws/v1/sandboxes/…/exec?process=…">
 *           <pre class="output"></pre> <span class="cmd-exit"></span></div>
 * Server frames (JSON text): start, stdout / stderr {data}, skipped {bytes}, exit {exit_code,
 * signal, timed_out, error?}, error {message}; the server closes after exit.
 * Plain ES2017, no build step. */
(function () {
  "use strict";

  var MAX_CHARS = 2 * 1024 * 1024; // keep the page responsive under a flood of output
  var followers = new Map(); // element -> Follower

  function wsUrl(path) {
    if (/^wss?:\/\//.test(path)) return path;
    return (location.protocol === "https:" ? "wss://" : "ws://") + location.host + path;
  }

  function badge(text, kind) {
    var span = document.createElement("span");
    span.className = "badge " + kind;
    span.textContent = text;
    return span;
  }

  function exitBadge(msg) {
    if (msg.error && (msg.exit_code === null || msg.exit_code === undefined)) return badge("failed", "bad");
    if (msg.timed_out) return badge("timed out", "bad");
    if (msg.exit_code === 0) return badge("exit 0", "ok");
    if ((msg.exit_code === null || msg.exit_code === undefined) && msg.signal) return badge("signal " + msg.signal, "bad");
    return badge("exit " + (msg.exit_code === null || msg.exit_code === undefined ? "?" : msg.exit_code), "bad");
  }

  function Follower(el) {
    this.el = el;
    this.id = el.dataset.processId;
    this.url = wsUrl(el.dataset.ws);
    this.out = el.querySelector(".output");
    this.exitEl = el.querySelector(".cmd-exit");
    this.done = false;
    this.disposed = false;
    this.attempt = 0;
    this.chars = 0;
    this.last = null; // the span being appended to, while the stream does not change
    this.connect();
  }

  Follower.prototype.connect = function () {
    var self = this;
    if (this.disposed || this.done) return;
    if (!this.el.isConnected) {
      this.dispose();
      return;
    }
    // Attaching replays the output from its start: begin from an empty view.
    this.out.textContent = "";
    this.last = null;
    this.chars = 0;
    var ws = new WebSocket(this.url);
    this.ws = ws;
    ws.onopen = function () { self.attempt = 0; };
    ws.onmessage = function (evt) {
      if (ws !== self.ws) return;
      var msg;
      try {
        msg = JSON.parse(evt.data);
      } catch (e) {
        return;
      }
      self.message(msg);
    };
    ws.onclose = function (evt) {
      if (ws !== self.ws) return;
      self.ws = null;
      if (self.done || self.disposed) return;
      if (evt.code === 4401 || evt.code === 4404 || evt.code === 4400) {
        self.finish(badge(evt.code === 4401 ? "not signed in" : "not found", "bad"));
        return;
      }
      var delay = Math.min(15000, 500 * Math.pow(2, self.attempt++));
      self.setExit(badge("reconnecting…", "running"));
      self.retry = setTimeout(function () { self.connect(); }, delay);
    };
  };

  Follower.prototype.message = function (msg) {
    if (msg.type === "stdout" || msg.type === "stderr") {
      this.append(msg.type, msg.data || "");
    } else if (msg.type === "skipped") {
      this.append("note", "\n[" + msg.bytes + " bytes of output skipped]\n");
    } else if (msg.type === "exit") {
      if (msg.error) this.append("stderr", (this.chars ? "\n" : "") + msg.error + "\n");
      this.finish(exitBadge(msg), msg.duration_ms);
      this.updateHistory(msg);
    } else if (msg.type === "error") {
      this.append("stderr", msg.message || "error");
      this.finish(badge("error", "bad"));
    }
  };

  Follower.prototype.append = function (stream, text) {
    if (!text) return;
    var pre = this.out;
    var atBottom = pre.scrollTop + pre.clientHeight >= pre.scrollHeight - 24;
    if (!this.last || this.last.className !== stream) {
      this.last = document.createElement("span");
      this.last.className = stream;
      pre.appendChild(this.last);
    }
    this.last.appendChild(document.createTextNode(text));
    this.chars += text.length;
    while (this.chars > MAX_CHARS && pre.firstChild && pre.firstChild !== this.last) {
      this.chars -= pre.firstChild.textContent.length;
      pre.removeChild(pre.firstChild);
      this.trimmed = true;
    }
    if (this.trimmed && !this.el.querySelector(".trimmed-note")) {
      var note = document.createElement("div");
      note.className = "note trimmed-note";
      note.textContent = "Earlier output was dropped from this view; the end of it is kept in the history.";
      this.el.insertBefore(note, pre);
    }
    if (atBottom) pre.scrollTop = pre.scrollHeight;
  };

  Follower.prototype.setExit = function (node) {
    if (!this.exitEl) return;
    this.exitEl.textContent = "";
    this.exitEl.appendChild(node);
  };

  // As the server formats it (dashboard/pages/sandbox_tabs.py _duration): "850 ms", "12.3 s", "4 min 5 s".
  function formatDuration(ms) {
    if (ms === null || ms === undefined) return "";
    if (ms < 1000) return Math.round(ms) + " ms";
    if (ms < 60000) return (ms / 1000).toFixed(1) + " s";
    return Math.floor(ms / 60000) + " min " + Math.floor((ms % 60000) / 1000) + " s";
  }

  Follower.prototype.finish = function (node, durationMs) {
    this.done = true;
    this.setExit(node);
    if (durationMs !== undefined && this.exitEl) {
      var d = document.createElement("span");
      d.className = "muted";
      d.textContent = " " + formatDuration(durationMs);
      this.exitEl.appendChild(d);
    }
    this.el.dataset.state = "exited";
    if (!this.chars) this.append("note", "(no output)");
  };

  // The history row of this process shows its result without a reload.
  Follower.prototype.updateHistory = function (msg) {
    var row = document.getElementById("exec-" + this.id);
    if (!row) return;
    row.dataset.status = "exited";
    var cell = row.querySelector(".exit");
    if (cell) {
      cell.textContent = "";
      cell.appendChild(exitBadge(msg));
    }
    var duration = row.querySelector(".duration");
    if (duration && msg.duration_ms !== undefined) duration.textContent = formatDuration(msg.duration_ms);
  };

  Follower.prototype.dispose = function () {
    if (this.disposed) return;
    this.disposed = true;
    clearTimeout(this.retry);
    if (this.ws) {
      var ws = this.ws;
      this.ws = null;
      try { ws.close(1000); } catch (e) { /* closing */ }
    }
    followers.delete(this.el);
  };

  function init(root) {
    if (!root || !root.querySelectorAll) return;
    var found = Array.prototype.slice.call(root.querySelectorAll(".cmd-run[data-ws]"));
    if (root.matches && root.matches(".cmd-run[data-ws]")) found.push(root);
    found.forEach(function (el) {
      if (!followers.has(el)) followers.set(el, new Follower(el));
    });
  }

  document.addEventListener("htmx:beforeCleanupElement", function (evt) {
    followers.forEach(function (follower, el) {
      if (evt.target === el || evt.target.contains(el)) follower.dispose();
    });
  });
  document.addEventListener("htmx:load", function (evt) { init(evt.target); });
  document.addEventListener("DOMContentLoaded", function () { init(document.body); });

  window.hangarCommandsInit = init;
})();
