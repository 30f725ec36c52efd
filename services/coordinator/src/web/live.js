// Keeps a session's DAG and task table current: WatchSession's events arrive as server-sent
// events, and each burst of them refetches the live part of the page.
(function () {
  const live = document.getElementById("live");
  if (!live) return;
  const base = "/sessions/" + encodeURIComponent(live.dataset.session);
  let pending = null;
  function refresh() {
    pending = null;
    fetch(base + "/live", { credentials: "same-origin" })
      .then((response) => (response.ok ? response.text() : Promise.reject(response.status)))
      .then((html) => { live.innerHTML = html; })
      .catch(() => {});
  }
  function soon() {
    if (pending === null) pending = setTimeout(refresh, 200);
  }
  const events = new EventSource(base + "/events");
  events.addEventListener("task", soon);
  events.addEventListener("session", soon);
  events.addEventListener("progress", soon);
})();
