// Progressive enhancement only: every page works without JavaScript.
(function () {
  // Irreversible actions ask first (the button's data-confirm says what will happen).
  document.addEventListener("submit", function (event) {
    var button = event.submitter || event.target.querySelector("[data-confirm]");
    var message = button && button.getAttribute("data-confirm");
    if (message && !window.confirm(message)) { event.preventDefault(); event.stopImmediatePropagation(); }
  }, true);

  // Only the formats the chosen kind allows are offered (the server checks again).
  document.querySelectorAll("select[data-formats]").forEach(function (kind) {
    var formats = JSON.parse(kind.getAttribute("data-formats"));
    var target = kind.form.querySelector("select[name=target_format]");
    var all = Array.prototype.map.call(target.options, function (o) { return [o.value, o.textContent]; });
    var offer = function () {
      var allowed = formats[kind.value] || [], keep = target.value;
      target.innerHTML = "";
      all.forEach(function (pair) {
        if (allowed.indexOf(pair[0]) < 0) return;
        var option = document.createElement("option");
        option.value = pair[0]; option.textContent = pair[1];
        target.appendChild(option);
      });
      target.value = allowed.indexOf(keep) >= 0 ? keep : allowed[0];
    };
    kind.addEventListener("change", offer);
    offer();
  });

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
        bar.value = 0; bar.hidden = true;
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
      xhr.onerror = function () {
        button.disabled = false; bar.value = 0; bar.hidden = true;
        text.textContent = "Upload failed: the connection broke. Try again.";
      };
      xhr.send(new FormData(form));
    });
  });

  // Live state refresh on the task list.
  var table = document.querySelector("table[data-live-states]");
  if (table) {
    var since = table.getAttribute("data-since") || "1970-01-01T00:00:00+00:00";
    var cell = function (text, cls) {
      var td = document.createElement("td");
      if (cls) td.className = cls;
      if (text !== undefined) td.textContent = text;
      return td;
    };
    var newRow = function (info) {
      var row = document.createElement("tr");
      row.setAttribute("data-task", info.id);
      var first = cell(), link = document.createElement("a"), small = document.createElement("small");
      link.href = info.url; link.textContent = info.name || "(no name)"; link.setAttribute("data-field", "name");
      small.className = "narrow-only"; small.textContent = " " + info.kind + " → " + info.target_format;
      first.appendChild(link); first.appendChild(small); row.appendChild(first);
      var created = cell(undefined, "wide"); created.innerHTML = info.created; row.appendChild(created);
      row.appendChild(cell(info.kind + " → " + info.target_format, "wide"));
      var stateCell = cell(), badge = document.createElement("span");
      badge.setAttribute("data-field", "state"); stateCell.appendChild(badge); row.appendChild(stateCell);
      var waiting = cell("", "wide"); waiting.setAttribute("data-field", "waiting_reason"); row.appendChild(waiting);
      return row;
    };
    var show = function (row, info) {
      var state = row.querySelector("[data-field=state]");
      state.textContent = info.state;
      state.className = "state state-" + info.state.toLowerCase();
      row.querySelector("[data-field=waiting_reason]").textContent = info.waiting_reason || info.outcome || "";
    };
    var refresh = function () {
      var rows = table.querySelectorAll("tr[data-task]");
      var ids = Array.prototype.map.call(rows, function (r) { return r.getAttribute("data-task"); });
      var url = table.getAttribute("data-live-states") + "?ids=" + ids.join(",");
      if (table.hasAttribute("data-live-new")) {
        url += "&since=" + encodeURIComponent(since) + "&state=" + encodeURIComponent(table.getAttribute("data-state") || "");
      }
      fetch(url, { credentials: "same-origin" })
        .then(function (r) { return r.json(); })
        .then(function (data) {
          rows.forEach(function (row) {
            var info = data.tasks[row.getAttribute("data-task")];
            if (info) show(row, info);
          });
          var body = table.querySelector("tbody"), empty = body.querySelector("tr.empty");
          (data["new"] || []).slice().reverse().forEach(function (info) {
            if (body.querySelector('tr[data-task="' + info.id + '"]')) return;
            if (empty) { empty.remove(); empty = null; }
            var row = newRow(info);
            body.insertBefore(row, body.firstChild);
            show(row, info);
            if (info.created_at > since) since = info.created_at;
          });
          if (window.sluiceTimes) window.sluiceTimes();
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
