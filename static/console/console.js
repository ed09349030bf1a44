// Progressive enhancement: every console page works without JavaScript; this keeps pages live.
(function () {
  var dashboard = document.getElementById("dashboard");
  if (dashboard) {
    var every = 1000 * parseInt(dashboard.getAttribute("data-refresh-seconds") || "5", 10);
    setInterval(function () {
      fetch(dashboard.getAttribute("data-refresh-url"), { credentials: "same-origin" })
        .then(function (r) { return r.ok ? r.text() : null; })
        .then(function (html) {
          if (!html) return;
          var doc = new DOMParser().parseFromString(html, "text/html");
          var body = doc.querySelector("#content-main") || doc.querySelector("#content") || doc.body;
          dashboard.innerHTML = body.innerHTML;
          if (window.sluiceTimes) window.sluiceTimes();
        })
        .catch(function () {});
    }, every);
  }
  var progress = document.getElementById("bulk-progress");
  if (progress) {
    var timer = setInterval(function () {
      fetch(progress.getAttribute("data-status-url"), { credentials: "same-origin" })
        .then(function (r) { return r.json(); })
        .then(function (s) {
          ["status", "done", "skipped", "total"].forEach(function (k) {
            var el = progress.querySelector("[data-field=" + k + "]");
            if (el) el.textContent = s[k];
          });
          progress.querySelector("[data-field=bar]").value = s.progress_pct;
          var reasons = progress.querySelector("[data-field=reasons]");
          reasons.innerHTML = "";
          Object.keys(s.skipped_reasons || {}).forEach(function (reason) {
            var li = document.createElement("li");
            li.textContent = s.skipped_reasons[reason] + " — " + reason;
            reasons.appendChild(li);
          });
          if (["done", "cancelled", "failed"].indexOf(s.status) >= 0) {
            clearInterval(timer);
            var cancel = progress.querySelector("[data-action=cancel-bulk]");
            if (cancel) cancel.closest("form").remove();
          }
        })
        .catch(function () {});
    }, 1000);
  }
  // Irreversible actions ask first, saying what will happen (the button's data-confirm).
  document.addEventListener("submit", function (event) {
    var button = event.submitter || event.target.querySelector("[data-confirm]");
    var message = button && button.getAttribute("data-confirm");
    if (message && !window.confirm(message)) event.preventDefault();
  }, true);
  var run = document.querySelector("[data-reload]");
  if (run) setTimeout(function () { window.location.reload(); }, 1000 * parseInt(run.getAttribute("data-reload"), 10));
})();
