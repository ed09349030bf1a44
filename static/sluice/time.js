// Times that read: every <time data-when> (written in UTC by the server) is shown in the viewer's
// time zone, relative ("3 min ago") with the absolute local time and its zone on hover.
(function () {
  function pad(n) { return (n < 10 ? "0" : "") + n; }
  function zone(d) {
    try {
      var part = new Intl.DateTimeFormat(undefined, { timeZoneName: "short" }).formatToParts(d)
        .filter(function (p) { return p.type === "timeZoneName"; })[0];
      if (part) return part.value;
    } catch (e) {}
    var off = -d.getTimezoneOffset();
    return "UTC" + (off >= 0 ? "+" : "-") + pad(Math.floor(Math.abs(off) / 60)) + ":" + pad(Math.abs(off) % 60);
  }
  function absolute(d, exact) {
    var ms = exact ? "." + ("00" + d.getMilliseconds()).slice(-3) : "";
    return d.getFullYear() + "-" + pad(d.getMonth() + 1) + "-" + pad(d.getDate()) + " " +
      pad(d.getHours()) + ":" + pad(d.getMinutes()) + ":" + pad(d.getSeconds()) + ms + " " + zone(d);
  }
  function relative(d, now) {
    var s = Math.round((now - d) / 1000), future = s < 0;
    s = Math.abs(s);
    var text = s < 45 ? s + " s" : s < 3600 ? Math.round(s / 60) + " min" : s < 86400 ? Math.round(s / 3600) + " h" :
      Math.round(s / 86400) + " d";
    if (s < 5) return "just now";
    return future ? "in " + text : text + " ago";
  }
  function render() {
    var now = Date.now();
    document.querySelectorAll("time[data-when]").forEach(function (el) {
      var d = new Date(el.getAttribute("datetime"));
      if (isNaN(d)) return;
      if (el.getAttribute("data-when") === "absolute") {  // timelines: the exact time, relative on hover
        el.textContent = absolute(d, true);
        el.title = relative(d, now);
      } else {
        el.title = absolute(d);
        el.textContent = relative(d, now);
      }
    });
  }
  function renderAxes() {  // chart axes: hours and minutes in the viewer's zone
    document.querySelectorAll("[data-when-hm]").forEach(function (el) {
      var d = new Date(el.getAttribute("data-when-hm"));
      if (!isNaN(d)) el.textContent = pad(d.getHours()) + ":" + pad(d.getMinutes());
    });
  }
  var renderAll = function () { render(); renderAxes(); };
  window.sluiceTimes = renderAll;
  renderAxes();
  render();
  setInterval(render, 15000);
})();
