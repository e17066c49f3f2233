// postbox console: small progressive enhancements. Every page works without it.
(function () {
  "use strict";

  // Ask before bulk actions that name many events.
  document.addEventListener("click", function (e) {
    var b = e.target.closest ? e.target.closest("[data-confirm]") : null;
    if (b && !window.confirm(b.getAttribute("data-confirm"))) {
      e.preventDefault();
    }
  });

  // "Select all" checkboxes.
  document.querySelectorAll("[data-select-all]").forEach(function (all) {
    var name = all.getAttribute("data-select-all");
    all.addEventListener("change", function () {
      document.querySelectorAll('input[type=checkbox][name="' + name + '"]').forEach(function (c) {
        c.checked = all.checked;
      });
    });
  });

  // Bulk action progress: poll until the action ends, then reload once.
  var job = document.getElementById("job");
  if (job && job.getAttribute("data-state") === "running") {
    var url = job.getAttribute("data-progress-url");
    var bar = document.getElementById("job-progress");
    var done = document.getElementById("job-done");
    var total = document.getElementById("job-total");
    var state = document.getElementById("job-state");
    document.querySelectorAll(".noscript-refresh").forEach(function (a) { a.hidden = true; });
    var poll = function () {
      fetch(url, { credentials: "same-origin", headers: { Accept: "application/json" } })
        .then(function (r) { return r.ok ? r.json() : null; })
        .then(function (p) {
          if (!p) { return; }
          bar.max = Math.max(p.total, 1);
          bar.value = p.done;
          done.textContent = p.done;
          total.textContent = p.total;
          state.textContent = p.state;
          if (p.finished) { window.location.reload(); } else { window.setTimeout(poll, 700); }
        })
        .catch(function () { window.setTimeout(poll, 2000); });
    };
    window.setTimeout(poll, 300);
  }
})();
