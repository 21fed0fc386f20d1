// slurm-finetune portal: small progressive enhancement. Every page works without it.
"use strict";

(function () {
  const SVG = "http://www.w3.org/2000/svg";

  // Timestamps arrive as ISO 8601 (UTC) in <time datetime>; show them in the viewer's zone.
  function localizeTimes(root) {
    const today = new Date().toDateString();
    root.querySelectorAll("time[datetime]").forEach(function (el) {
      const iso = el.getAttribute("datetime");
      const d = new Date(iso);
      if (!iso || isNaN(d)) return;
      el.title = iso.replace("+00:00", " UTC");
      const timeOnly = el.dataset.format === "time" && d.toDateString() === today;
      el.textContent = timeOnly
        ? d.toLocaleTimeString([], { hour: "2-digit", minute: "2-digit", second: "2-digit" })
        : d.toLocaleString([], { year: "numeric", month: "short", day: "numeric", hour: "2-digit", minute: "2-digit" });
    });
  }

  function showTimeZone() {
    const zone = Intl.DateTimeFormat().resolvedOptions().timeZone;
    document.querySelectorAll(".tzname").forEach(function (el) { el.textContent = zone ? " (" + zone + ")" : ""; });
  }

  // Dataset upload: the same form, sent by XHR so a progress bar can follow the bytes.
  function enhanceUpload() {
    const form = document.getElementById("upload-form");
    if (!form || !window.FormData) return;
    const wrap = document.getElementById("upload-progress");
    const bar = document.getElementById("upload-bar");
    const pct = document.getElementById("upload-pct");
    const err = document.getElementById("upload-error");
    form.addEventListener("submit", function (ev) {
      ev.preventDefault();
      const data = new FormData(form);
      const csrf = data.get("csrf");
      data.delete("csrf");
      const xhr = new XMLHttpRequest();
      xhr.open("POST", form.action);
      xhr.setRequestHeader("X-CSRF-Token", csrf);
      xhr.setRequestHeader("Accept", "application/json");
      err.hidden = true;
      wrap.hidden = false;
      form.querySelector("button[type=submit]").disabled = true;
      xhr.upload.addEventListener("progress", function (e) {
        if (!e.lengthComputable) return;
        const p = Math.round((100 * e.loaded) / e.total);
        bar.value = p;
        pct.textContent = p;
      });
      xhr.upload.addEventListener("load", function () { pct.textContent = "100"; bar.value = 100; });
      xhr.addEventListener("load", function () {
        let body = null;
        try { body = JSON.parse(xhr.responseText); } catch (e) { body = null; }
        if (xhr.status === 200 && body && body.url) { window.location.assign(body.url); return; }
        fail(body && body.error ? body.error.message : "The upload failed (HTTP " + xhr.status + ").");
      });
      xhr.addEventListener("error", function () { fail("The connection broke during the upload. Try again."); });
      function fail(message) {
        err.textContent = message;
        err.hidden = false;
        wrap.hidden = true;
        form.querySelector("button[type=submit]").disabled = false;
      }
      xhr.send(data);
    });
  }

  function enhanceConfirms() {
    document.querySelectorAll("form.js-confirm").forEach(function (form) {
      form.addEventListener("submit", function (ev) {
        if (!window.confirm(form.dataset.confirm || "Are you sure?")) ev.preventDefault();
      });
    });
  }

  // New-job form: the DPO beta field only for a DPO job.
  function enhanceMethod() {
    const method = document.getElementById("method");
    const beta = document.getElementById("beta-field");
    if (!method || !beta) return;
    function sync() { beta.hidden = method.value !== "dpo"; }
    method.addEventListener("change", sync);
    sync();
  }

  // New-job form: refresh the estimate (tokens, time, QOS tier) when the file or epochs change.
  function enhanceEstimate() {
    const box = document.getElementById("estimate");
    const form = document.getElementById("job-form");
    if (!box || !form) return;
    let timer = null;
    function refresh() {
      const file = form.elements.training_file.value;
      const epochs = form.elements.epochs.value;
      const range = form.elements.epochs;   // min and max: the contract's, rendered by the server
      if (!file || !(+epochs >= +range.min && +epochs <= +range.max)) return;
      const model = form.elements.model ? form.elements.model.value : "";
      const url = box.dataset.url + "?training_file=" + encodeURIComponent(file) + "&epochs=" + encodeURIComponent(epochs) +
        "&model=" + encodeURIComponent(model);
      fetch(url, { headers: { Accept: "application/json" }, credentials: "same-origin" })
        .then(function (r) { return r.ok ? r.json() : null; })
        .then(function (body) {
          const e = body && body.estimate;
          document.getElementById("est-tokens").textContent = e ? e.tokens.toLocaleString() : "–";
          document.getElementById("est-time").textContent = e ? e.minutes + " min" : "–";
          document.getElementById("est-qos").textContent = e && e.qos ? e.qos : "–";
          document.getElementById("est-over").hidden = !(e && e.over);
          document.getElementById("est-start").textContent =
            e && e.start_now ? "now" : e && e.start ? new Date(e.start * 1000).toLocaleString() : "–";
          const why = document.getElementById("est-why");
          why.hidden = !(e && e.start_reason);
          why.textContent = e && e.start_reason ? "Later because " + e.start_reason + "." : "";
        })
        .catch(function () { /* keep the last estimate */ });
    }
    ["training_file", "epochs", "model"].forEach(function (name) {
      if (!form.elements[name]) return;
      form.elements[name].addEventListener("input", function () { clearTimeout(timer); timer = setTimeout(refresh, 250); });
    });
  }

  function el(name, attrs, text) {
    const node = document.createElementNS(SVG, name);
    Object.keys(attrs).forEach(function (k) { node.setAttribute(k, attrs[k]); });
    if (text !== undefined) node.textContent = text;
    return node;
  }

  function niceTicks(lo, hi, n) {
    const span = hi - lo || 1;
    const step0 = span / n;
    const mag = Math.pow(10, Math.floor(Math.log10(step0)));
    const step = [1, 2, 2.5, 5, 10].map(function (m) { return m * mag; }).find(function (s) { return s >= step0; });
    const out = [];
    for (let v = Math.ceil(lo / step) * step; v <= hi + 1e-9; v += step) out.push(+v.toFixed(6));
    return out;
  }

  // The loss chart: training loss as a line, evaluation loss as dots (joined by a dashed line from three on).
  // The drawing uses the element's own pixel width so labels keep their size on a phone.
  function drawChart(svg, series) {
    while (svg.firstChild) svg.removeChild(svg.firstChild);
    const all = series.train.concat(series.eval);
    document.getElementById("loss-empty").hidden = all.length > 0;
    svg.style.display = all.length ? "" : "none";
    if (!all.length) return;
    const W = Math.max(300, Math.round(svg.clientWidth || svg.parentNode.clientWidth || 640));
    const H = W < 500 ? 220 : 280, L = 52, R = 14, T = 12, B = 38;
    svg.setAttribute("viewBox", "0 0 " + W + " " + H);
    const xs = all.map(function (p) { return p[0]; });
    const ys = all.map(function (p) { return p[1]; });
    const x0 = Math.min(0, Math.min.apply(null, xs)), x1 = Math.max(1, Math.max.apply(null, xs));
    let y0 = Math.min.apply(null, ys), y1 = Math.max.apply(null, ys);
    const pad = (y1 - y0) * 0.08 || Math.abs(y1) * 0.1 || 1;
    y0 = Math.max(0, y0 - pad); y1 = y1 + pad;
    const sx = function (v) { return L + ((v - x0) / (x1 - x0)) * (W - L - R); };
    const sy = function (v) { return T + (1 - (v - y0) / (y1 - y0)) * (H - T - B); };
    niceTicks(y0, y1, 4).forEach(function (v) {
      svg.appendChild(el("line", { x1: L, x2: W - R, y1: sy(v), y2: sy(v), class: "grid" }));
      svg.appendChild(el("text", { x: L - 6, y: sy(v) + 4, "text-anchor": "end", class: "tick" }, String(v)));
    });
    niceTicks(x0, x1, W < 500 ? 4 : 8).filter(function (v) { return Number.isInteger(v); }).forEach(function (v) {
      svg.appendChild(el("text", { x: sx(v), y: H - B + 16, "text-anchor": "middle", class: "tick" }, String(v)));
    });
    svg.appendChild(el("line", { x1: L, x2: W - R, y1: H - B, y2: H - B, class: "axis" }));
    svg.appendChild(el("line", { x1: L, x2: L, y1: T, y2: H - B, class: "axis" }));
    svg.appendChild(el("text", { x: (L + W - R) / 2, y: H - 4, "text-anchor": "middle", class: "label" }, "step"));
    svg.appendChild(el("text", { x: 12, y: (T + H - B) / 2, "text-anchor": "middle", class: "label",
      transform: "rotate(-90 12 " + (T + H - B) / 2 + ")" }, "loss"));
    [["train", series.train], ["eval", series.eval]].forEach(function (pair) {
      const pts = pair[1];
      if (!pts.length) return;
      // two evaluations (before and after) are two measurements, not a trend: dots, no line between them
      if (pair[0] !== "eval" || pts.length > 2) {
        svg.appendChild(el("polyline", { class: "line " + pair[0],
          points: pts.map(function (p) { return sx(p[0]).toFixed(1) + "," + sy(p[1]).toFixed(1); }).join(" ") }));
      }
      if (pair[0] === "eval" || pts.length === 1) {
        pts.forEach(function (p) {
          const dot = el("circle", { cx: sx(p[0]), cy: sy(p[1]), r: 3.5, class: "dot " + pair[0] });
          dot.appendChild(el("title", {}, pair[0] + " loss " + p[1].toFixed(4) + " at step " + p[0]));
          svg.appendChild(dot);
        });
      }
    });
  }

  function setupJob() {
    const root = document.getElementById("job");
    if (!root) return;
    const fig = document.getElementById("loss-chart");
    const svg = document.getElementById("loss-svg");
    const summary = document.getElementById("loss-summary");
    const parts = { head: document.getElementById("job-head"), live: document.getElementById("job-live") };
    let series = JSON.parse(fig.dataset.series || '{"train":[],"eval":[]}');
    drawChart(svg, series);
    let resizeTimer = null;
    window.addEventListener("resize", function () {
      clearTimeout(resizeTimer);
      resizeTimer = setTimeout(function () { drawChart(svg, series); }, 150);
    });
    const last = {};
    function poll() {
      fetch(root.dataset.live, { headers: { Accept: "application/json" }, credentials: "same-origin" })
        .then(function (r) { return r.ok ? r.json() : Promise.reject(r.status); })
        .then(function (body) {
          Object.keys(parts).forEach(function (name) {
            if (body[name] === last[name]) return;
            const focused = document.activeElement && document.activeElement.id;
            parts[name].innerHTML = body[name];
            localizeTimes(parts[name]);
            last[name] = body[name];
            if (focused && document.getElementById(focused)) document.getElementById(focused).focus();
          });
          series = body.series;
          drawChart(svg, series);
          fig.dataset.points = String(series.train.length);
          summary.textContent = series.train.length + " training points, " + series.eval.length + " evaluations";
          if (!body.done) setTimeout(poll, 2000);
        })
        .catch(function () { setTimeout(poll, 5000); });
    }
    setTimeout(poll, 1000);
  }

  document.addEventListener("DOMContentLoaded", function () {
    localizeTimes(document);
    showTimeZone();
    enhanceUpload();
    enhanceConfirms();
    enhanceEstimate();
    enhanceMethod();
    setupJob();
  });
})();
