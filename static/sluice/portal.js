// Progressive enhancement only: every page works without JavaScript.
(function () {
  // Upload with a progress bar; the plain form post remains the fallback.
  document.querySelectorAll("form[data-upload-progress]").forEach(function (form) {
    form.addEventListener("submit", function (event) {
      if (!window.FormData || !window.XMLHttpRequest) return;
      event.preventDefault();
      var bar = form.querySelector("progress"), text = form.querySelector(".progress-text");
      var button = form.querySelector("button[type=submit]");
      form.querySelectorAll(".error[data-error-for]").forEach(function (e) { e.remove(); });
      bar.hidden = false; text.hidden = false; button.disabled = true;
      var xhr = new XMLHttpRequest();
      xhr.open("POST", form.action || window.location.href);
      xhr.setRequestHeader("X-Requested-With", "XMLHttpRequest");
      xhr.upload.onprogress = function (e) {
        if (e.lengthComputable) {
          bar.value = Math.round((e.loaded / e.total) * 100);
          text.textContent = "Uploading… " + bar.value + "%";
        }
      };
      xhr.onload = function () {
        button.disabled = false;
        var data = {};
        try { data = JSON.parse(xhr.responseText); } catch (e) {}
        if (xhr.status === 202 && data.url) { window.location = data.url; return; }
        text.textContent = "Not accepted: see the messages next to the fields.";
        var errors = data.errors || {};
        Object.keys(errors).forEach(function (name) {
          var input = form.querySelector("[name=" + name + "]") || form.querySelector("[name=file]");
          errors[name].forEach(function (message) {
            var p = document.createElement("p");
            p.className = "error"; p.setAttribute("data-error-for", name); p.textContent = message;
            input.parentNode.appendChild(p);
          });
        });
      };
      xhr.onerror = function () { button.disabled = false; text.textContent = "Upload failed: the connection broke. Try again."; };
      xhr.send(new FormData(form));
    });
  });

  // Live state refresh on the task list.
  var table = document.querySelector("table[data-live-states]");
  if (table) {
    var refresh = function () {
      var rows = table.querySelectorAll("tr[data-task]");
      var ids = Array.prototype.map.call(rows, function (r) { return r.getAttribute("data-task"); });
      if (!ids.length) return;
      fetch(table.getAttribute("data-live-states") + "?ids=" + ids.join(","), { credentials: "same-origin" })
        .then(function (r) { return r.json(); })
        .then(function (data) {
          rows.forEach(function (row) {
            var info = data.tasks[row.getAttribute("data-task")];
            if (!info) return;
            var state = row.querySelector("[data-field=state]");
            state.textContent = info.state;
            state.className = "state state-" + info.state.toLowerCase();
            row.querySelector("[data-field=waiting_reason]").textContent = info.waiting_reason || "";
          });
        })
        .catch(function () {});
    };
    refresh();
    setInterval(refresh, 3000);
  }

  // A task page that is not finished reloads itself to show progress.
  var badge = document.querySelector("[data-refresh]");
  if (badge) setTimeout(function () { window.location.reload(); }, 1000 * parseInt(badge.getAttribute("data-refresh"), 10));
})();
