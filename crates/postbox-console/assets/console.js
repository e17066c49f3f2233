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

  // "Select all" checkboxes (delegated: rows are replaced by live updates).
  document.addEventListener("change", function (e) {
    var all = e.target;
    var name = all.getAttribute && all.getAttribute("data-select-all");
    if (!name) { return; }
    document.querySelectorAll('input[type=checkbox][name="' + name + '"]').forEach(function (c) {
      c.checked = all.checked;
    });
  });

  // How many rows are selected, beside the bulk actions at the top.
  var counted = function () {
    document.querySelectorAll("[data-of]").forEach(function (out) {
      var n = document.querySelectorAll('input[type=checkbox][name="' + out.getAttribute("data-of") + '"]:checked').length;
      out.textContent = n ? "· " + n + " selected" : "";
    });
  };
  document.addEventListener("change", counted);

  // Live pages: every few seconds, fetch this same address and swap each
  // [data-live] part (counters, table bodies) in place, so the scroll
  // position, the page and the filters stay. While the operator has rows
  // selected, or is typing in a form, updates pause (the rows under their
  // selection do not move); they resume when the selection is cleared.
  var live = document.getElementById("live-status");
  if (live && window.fetch && window.DOMParser) {
    var every = Math.max(500, parseInt(live.getAttribute("data-refresh-ms"), 10) || 5000);
    var clock = function () { return new Date().toISOString().slice(11, 19) + " UTC"; };
    var busy = function () {
      if (document.querySelector("main input[type=checkbox]:checked")) { return "rows are selected"; }
      var f = document.activeElement;
      if (f && f.closest && f.closest("main form") && /^(INPUT|SELECT|TEXTAREA)$/.test(f.tagName) && f.type !== "checkbox") {
        return "a form is in use";
      }
      var typed = Array.prototype.some.call(document.querySelectorAll("main form[method=post] input[type=text]"), function (i) { return i.value !== ""; });
      return typed ? "a form is filled in" : null;
    };
    // A row's identity across updates: its first link or checkbox.
    var rowKey = function (tr) {
      var k = tr.querySelector("a[href], input[value]");
      return k ? (k.getAttribute("href") || k.value) : null;
    };
    var rows = function () { return document.querySelectorAll("[data-live] tr"); };
    var swap = function (doc) {
      // Keep the first row on screen where it is, whatever comes in above it.
      var anchor = null;
      Array.prototype.some.call(rows(), function (tr) {
        var r = tr.getBoundingClientRect();
        if (r.bottom > 0 && rowKey(tr)) { anchor = { key: rowKey(tr), top: r.top }; return true; }
        return false;
      });
      replace(doc);
      if (anchor) {
        Array.prototype.some.call(rows(), function (tr) {
          if (rowKey(tr) !== anchor.key) { return false; }
          window.scrollBy(0, tr.getBoundingClientRect().top - anchor.top);
          return true;
        });
      }
    };
    var replace = function (doc) {
      var fresh = doc.querySelectorAll("[data-live]");
      var here = document.querySelectorAll("[data-live]");
      var same = fresh.length === here.length && Array.prototype.every.call(fresh, function (n, i) { return n.id && n.id === here[i].id; });
      if (same) {
        fresh.forEach(function (n) {
          var old = document.getElementById(n.id);
          if (old.innerHTML !== n.innerHTML) { old.innerHTML = n.innerHTML; }
        });
      } else {
        // The page's shape changed (a list appeared or emptied): take its main part.
        var main = doc.querySelector("main");
        if (main) { document.querySelector("main").innerHTML = main.innerHTML; }
        live = document.getElementById("live-status");
      }
    };
    var tick = function () {
      var why = busy();
      if (why) {
        live.textContent = "Updates paused at " + clock() + ": " + why + ".";
        live.setAttribute("data-state", "paused");
        window.setTimeout(tick, every);
        return;
      }
      fetch(window.location.href, { credentials: "same-origin", headers: { Accept: "text/html" } })
        .then(function (r) {
          if (r.redirected) { throw { stop: "signed out" }; }
          if (!r.ok) { return Promise.reject(r.status); }
          return r.text();
        })
        .then(function (html) {
          var doc = new DOMParser().parseFromString(html, "text/html");
          if (!doc.getElementById("live-status")) { throw { stop: "not this page" }; }
          if (busy()) { window.setTimeout(tick, every); return; }
          swap(doc);
          live.textContent = "Updated at " + clock() + "; updates every " + Math.round(every / 1000) + " s.";
          live.setAttribute("data-state", "live");
          window.setTimeout(tick, every);
        })
        .catch(function (why) {
          if (why && why.stop) {
            // Signed out (or the page is gone): stop, and say so.
            live.textContent = "Updates stopped at " + clock() + ": signed out? Reload the page.";
            live.setAttribute("data-state", "stopped");
            return;
          }
          // The console or its database did not answer: keep trying, less often.
          live.textContent = "Could not update at " + clock() + "; trying again.";
          live.setAttribute("data-state", "retrying");
          window.setTimeout(tick, Math.min(every * 4, 30000));
        });
    };
    window.setTimeout(tick, every);
  }

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
