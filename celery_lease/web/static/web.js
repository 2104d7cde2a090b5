// celery_lease web: the overview refreshes itself, lease bars count down between refreshes,
// and a checkbox selects every dead letter shown. No framework, no build step.
(function () {
  "use strict";
  var REFRESH_MS = 3000, TICK_MS = 250;
  var offset = 0; // the store's clock minus this browser's, in seconds

  function syncClock(root) {
    var el = root.querySelector("[data-now]");
    if (el) { offset = parseFloat(el.getAttribute("data-now")) - Date.now() / 1000; }
  }

  function age(s) { // as the CLI writes durations: 0.4s, 12.3s, 5m03s, 2h04m, 3d02h
    if (s < 60) { return s.toFixed(1) + "s"; }
    var pad = function (n) { return (n < 10 ? "0" : "") + n; };
    if (s < 3600) { return Math.floor(s / 60) + "m" + pad(Math.floor(s % 60)) + "s"; }
    if (s < 86400) { return Math.floor(s / 3600) + "h" + pad(Math.floor(s % 3600 / 60)) + "m"; }
    return Math.floor(s / 86400) + "d" + pad(Math.floor(s % 86400 / 3600)) + "h";
  }

  function tick() {
    var now = Date.now() / 1000 + offset;
    document.querySelectorAll(".bar[data-expires]").forEach(function (bar) {
      var left = parseFloat(bar.getAttribute("data-expires")) - now;
      var full = parseFloat(bar.getAttribute("data-duration")) || 0;
      var pct = full > 0 ? Math.max(0, Math.min(100, 100 * left / full)) : (left > 0 ? 100 : 0);
      if (bar.firstElementChild) { bar.firstElementChild.style.width = pct + "%"; }
      bar.classList.toggle("expired", left < 0);
    });
    document.querySelectorAll(".left[data-expires]").forEach(function (el) {
      var left = parseFloat(el.getAttribute("data-expires")) - now;
      el.textContent = left >= 0 ? "expires in " + age(left) : "EXPIRED " + age(-left) + " ago";
    });
  }

  function refresh(live) {
    if (document.hidden) { return; }
    fetch(live.getAttribute("data-live"), {credentials: "same-origin", headers: {"Accept": "text/html"}})
      .then(function (r) { return r.ok ? r.text() : Promise.reject(r.status); })
      .then(function (html) {
        live.innerHTML = html;
        live.classList.remove("stale");
        syncClock(live);
        tick();
      })
      .catch(function () { live.classList.add("stale"); });
  }

  function start() {
    syncClock(document);
    tick();
    setInterval(tick, TICK_MS);
    var live = document.getElementById("live");
    if (live) { setInterval(function () { refresh(live); }, REFRESH_MS); }
    document.querySelectorAll("input.select-all").forEach(function (all) {
      all.addEventListener("change", function () {
        all.closest("form").querySelectorAll("input[name=job]").forEach(function (box) {
          box.checked = all.checked;
        });
      });
    });
  }

  if (document.readyState === "loading") { document.addEventListener("DOMContentLoaded", start); } else { start(); }
}());
