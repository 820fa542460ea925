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
