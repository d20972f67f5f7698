// Refresh the page's main part in place every few seconds (no full reload). Skipped while
// the tab is hidden, a form inside it has the focus (someone is typing) or the previous
// refresh has not answered yet; off on a page that shows a one-off result (data-live="off").
(function () {
  var live = document.getElementById("live");
  if (!live || live.getAttribute("data-live") === "off") { return; }
  var pending = false;
  var every = parseInt(live.getAttribute("data-refresh-ms"), 10) || 5000;
  function busy() {
    var a = document.activeElement;
    return a && a.closest && a.closest("#live form") !== null;
  }
  function tick() {
    if (document.hidden || busy() || pending) { return; }
    pending = true;
    fetch(window.location.href, {headers: {"X-RB-Live": "1"}, credentials: "same-origin"})
      .then(function (r) { return r.ok ? r.text() : null; })
      .then(function (html) {
        if (html !== null && !busy()) {
          live.innerHTML = html;
          live.setAttribute("data-refreshed", String(Date.now()));
        }
      })
      .catch(function () { /* the next tick tries again */ })
      .then(function () { pending = false; });
  }
  window.setInterval(tick, every);
})();
