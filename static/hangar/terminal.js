/* Terminals: an xterm.js view of a sandbox terminal over /ws/v1/terminals/<id>?flow=1.
 *
 * Markup: <div class="term" data-terminal-id="tm…" data-ws="/ws/v1/terminals/tm…?flow=1"
 *         [data-readonly="1"]></div>, and optionally an element with data-status-for="tm…"
 *         that shows connected / reconnecting / exited.
 * Wire:   binary frames both ways are terminal bytes; text frames are JSON control messages.
 *         The client acknowledges the bytes xterm has rendered (after its write callback), in
 *         batches, so the server holds the shell back instead of flooding the browser.
 * window.hangarTerminals maps terminal id -> xterm Terminal (for tests and the console).
 * Plain ES2017, no build step. */
(function () {
  "use strict";

  var ACK_EVERY = 16 * 1024; // acknowledge at least this often (bytes rendered)
  var PING_EVERY_MS = 20000; // a silent dead connection is noticed within two of these
  var MAX_BACKOFF_MS = 15000;

  var terminals = (window.hangarTerminals = window.hangarTerminals || {});
  var sessions = new Map(); // element -> Session
  var encoder = new TextEncoder();

  function wsUrl(path) {
    if (/^wss?:\/\//.test(path)) return path;
    return (location.protocol === "https:" ? "wss://" : "ws://") + location.host + path;
  }

  function Session(el) {
    var self = this;
    this.el = el;
    this.id = el.dataset.terminalId;
    this.url = wsUrl(el.dataset.ws);
    this.readonly = el.dataset.readonly === "1";
    this.ws = null;
    this.gen = 0; // bumps with every socket; callbacks of an older socket are ignored
    this.attempt = 0;
    this.connectedOnce = false;
    this.exited = false;
    this.disposed = false;
    this.retryTimer = null;
    this.pingTimer = null;
    this.lastPong = 0;
    this.pendingWrites = 0;
    this.unacked = 0;

    this.term = new Terminal({
      cursorBlink: !this.readonly,
      disableStdin: this.readonly,
      fontFamily: 'ui-monospace, "SFMono-Regular", "JetBrains Mono", Menlo, Consolas, monospace',
      fontSize: 13,
      lineHeight: 1.15,
      scrollback: 5000,
      allowProposedApi: false,
      theme: {
        background: "#10131a",
        foreground: "#d7dce5",
        cursor: "#8fb3ff",
        selectionBackground: "#33415e",
      },
    });
    this.fit = new FitAddon.FitAddon();
    this.term.loadAddon(this.fit);
    el.textContent = "";
    this.term.open(el);
    this.fitNow();
    terminals[this.id] = this.term;

    this.term.onData(function (data) {
      self.sendBytes(encoder.encode(data));
    });
    this.term.onBinary(function (data) {
      var bytes = new Uint8Array(data.length);
      for (var i = 0; i < data.length; i++) bytes[i] = data.charCodeAt(i) & 255;
      self.sendBytes(bytes);
    });
    this.term.onResize(function (size) {
      self.sendJson({ type: "resize", rows: size.rows, cols: size.cols });
    });

    // The panel follows the window (its height is a calc of the viewport); refit on any change.
    this.fitQueued = false;
    this.observer = new ResizeObserver(function () { self.queueFit(); });
    this.observer.observe(el);
    this.onOnline = function () { if (self.retryTimer) self.retryNow(); };
    window.addEventListener("online", this.onOnline);

    this.connect();
    if (!this.readonly) this.term.focus();
  }

  Session.prototype.fitNow = function () {
    if (!this.el.isConnected || this.el.offsetWidth === 0 || this.el.offsetHeight === 0) return;
    try {
      this.fit.fit();
    } catch (e) {
      /* not laid out yet */
    }
  };

  Session.prototype.queueFit = function () {
    var self = this;
    if (this.fitQueued) return;
    this.fitQueued = true;
    requestAnimationFrame(function () {
      self.fitQueued = false;
      if (!self.disposed) self.fitNow();
    });
  };

  Session.prototype.setStatus = function (state, text) {
    this.el.dataset.state = state;
    var label = document.querySelector('[data-status-for="' + this.id + '"]');
    if (label) {
      label.dataset.state = state;
      label.textContent = text || state;
    }
  };

  Session.prototype.connect = function () {
    if (this.disposed || this.exited) return;
    if (!this.el.isConnected) {
      this.dispose();
      return;
    }
    var self = this;
    var gen = ++this.gen;
    var ws = new WebSocket(this.url);
    ws.binaryType = "arraybuffer";
    this.ws = ws;
    this.pendingWrites = 0;
    this.unacked = 0;
    this.setStatus(this.attempt ? "reconnecting" : "connecting", this.attempt ? "reconnecting…" : "connecting…");

    ws.onopen = function () {
      if (gen !== self.gen) return;
      self.attempt = 0;
      if (self.connectedOnce) {
        // The server replays the recent screen on every connect: start from a clean slate
        // (written, not called, so it lands after anything still queued from the old socket).
        self.term.write("\x1bc");
      }
      self.connectedOnce = true;
      self.setStatus("connected", self.readonly ? "connected (read-only)" : "connected");
      self.fitNow();
      self.sendJson({ type: "resize", rows: self.term.rows, cols: self.term.cols });
      self.lastPong = Date.now();
      self.startPing(gen);
    };
    ws.onmessage = function (evt) {
      if (gen !== self.gen) return;
      if (typeof evt.data === "string") self.control(evt.data);
      else self.output(new Uint8Array(evt.data), gen);
    };
    ws.onclose = function (evt) {
      if (gen !== self.gen) return;
      self.closed(evt.code, evt.reason);
    };
  };

  Session.prototype.closed = function (code, reason) {
    this.stopPing();
    this.ws = null;
    if (this.disposed || this.exited) return;
    if (code === 4401) {
      this.setStatus("error", "not signed in: reload the page");
      return;
    }
    if (code === 4404) {
      this.setStatus("error", "this terminal no longer exists");
      return;
    }
    this.scheduleReconnect();
  };

  Session.prototype.scheduleReconnect = function () {
    var self = this;
    var base = Math.min(MAX_BACKOFF_MS, 500 * Math.pow(2, this.attempt));
    var delay = Math.round(base / 2 + (Math.random() * base) / 2);
    this.attempt += 1;
    this.setStatus("reconnecting", "connection lost; reconnecting in " + Math.ceil(delay / 1000) + " s…");
    clearTimeout(this.retryTimer);
    this.retryTimer = setTimeout(function () {
      self.retryTimer = null;
      self.connect();
    }, delay);
  };

  Session.prototype.retryNow = function () {
    clearTimeout(this.retryTimer);
    this.retryTimer = null;
    this.connect();
  };

  Session.prototype.startPing = function (gen) {
    var self = this;
    this.stopPing();
    this.pingTimer = setInterval(function () {
      if (gen !== self.gen || !self.ws) return;
      if (Date.now() - self.lastPong > 2 * PING_EVERY_MS + 5000) {
        // No answer for too long: the connection is dead even if the browser has not noticed.
        var ws = self.ws;
        self.gen++;
        try { ws.close(); } catch (e) { /* already closing */ }
        self.closed(1006, "ping timeout");
        return;
      }
      self.sendJson({ type: "ping" });
    }, PING_EVERY_MS);
  };

  Session.prototype.stopPing = function () {
    clearInterval(this.pingTimer);
    this.pingTimer = null;
  };

  Session.prototype.control = function (text) {
    var msg;
    try {
      msg = JSON.parse(text);
    } catch (e) {
      return;
    }
    this.lastPong = Date.now();
    if (msg.type === "skipped") {
      this.term.write("\r\n\x1b[2m[" + msg.bytes + " bytes of output skipped]\x1b[0m\r\n");
    } else if (msg.type === "exit") {
      this.exited = true;
      var how = msg.exit_code !== null && msg.exit_code !== undefined ? "exited with code " + msg.exit_code
        : msg.signal ? "killed by signal " + msg.signal : "ended";
      if (msg.error) how += " (" + msg.error + ")";
      this.term.write("\r\n\x1b[2m[" + how + "]\x1b[0m\r\n");
      this.setStatus("exited", how);
      this.el.dataset.exitCode = msg.exit_code === null || msg.exit_code === undefined ? "" : String(msg.exit_code);
    } else if (msg.type === "error" && /^input refused/.test(msg.message || "") && window.hangarToast) {
      // The terminal lives on (the shell left too much unread): say so without marking it dead.
      window.hangarToast(msg.message);
    } else if (msg.type === "error") {
      this.setStatus("error", msg.message || "error");
    }
  };

  Session.prototype.output = function (bytes, gen) {
    var self = this;
    this.lastPong = Date.now();
    this.pendingWrites += 1;
    this.term.write(bytes, function () {
      if (gen !== self.gen) return;
      self.pendingWrites -= 1;
      self.unacked += bytes.length;
      if (self.unacked >= ACK_EVERY || self.pendingWrites === 0) self.ack();
    });
  };

  Session.prototype.ack = function () {
    if (this.unacked > 0 && this.sendJson({ type: "ack", bytes: this.unacked })) this.unacked = 0;
  };

  Session.prototype.sendJson = function (obj) {
    if (!this.ws || this.ws.readyState !== WebSocket.OPEN) return false;
    this.ws.send(JSON.stringify(obj));
    return true;
  };

  Session.prototype.sendBytes = function (bytes) {
    if (this.readonly || this.exited || !this.ws || this.ws.readyState !== WebSocket.OPEN) return;
    this.ws.send(bytes);
  };

  Session.prototype.dispose = function () {
    if (this.disposed) return;
    this.disposed = true;
    this.gen++;
    this.stopPing();
    clearTimeout(this.retryTimer);
    window.removeEventListener("online", this.onOnline);
    this.observer.disconnect();
    if (this.ws) {
      try { this.ws.close(1000); } catch (e) { /* closing */ }
    }
    this.ws = null;
    if (terminals[this.id] === this.term) delete terminals[this.id];
    this.term.dispose();
    sessions.delete(this.el);
  };

  function init(root) {
    if (typeof Terminal === "undefined" || !root || !root.querySelectorAll) return;
    var found = Array.prototype.slice.call(root.querySelectorAll("[data-terminal-id][data-ws]"));
    if (root.matches && root.matches("[data-terminal-id][data-ws]")) found.push(root);
    found.forEach(function (el) {
      if (!sessions.has(el)) sessions.set(el, new Session(el));
    });
  }

  // Content swapped out by htmx (another tab, another terminal) takes its socket with it.
  document.addEventListener("htmx:beforeCleanupElement", function (evt) {
    sessions.forEach(function (session, el) {
      if (evt.target === el || evt.target.contains(el)) session.dispose();
    });
  });
  document.addEventListener("htmx:load", function (evt) { init(evt.target); });
  document.addEventListener("DOMContentLoaded", function () { init(document.body); });
  window.addEventListener("pagehide", function () {
    sessions.forEach(function (session) { session.dispose(); });
  });
  // Back from the browser's page cache with its sockets closed: draw the page afresh.
  window.addEventListener("pageshow", function (evt) {
    if (evt.persisted && document.querySelector("[data-terminal-id][data-ws]")) location.reload();
  });

  window.hangarTerminalInit = init;
})();
