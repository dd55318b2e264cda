// Loraplex console: a little script for what plain forms cannot do (live refresh, streaming,
// upload progress, copy buttons). The page works without it apart from those.
(function () {
  "use strict";

  const csrf = () => (document.querySelector('meta[name="csrf-token"]') || {}).content || "";
  const $ = (sel, root) => (root || document).querySelector(sel);

  function toLogin() {
    window.location.href = "/console/login?next=" + encodeURIComponent(location.pathname + location.search);
  }

  // ---- live fragments: <div data-refresh="/url" data-interval="2000"> ---------------------------
  function startRefresh(el) {
    const url = el.dataset.refresh;
    const every = Math.max(500, parseInt(el.dataset.interval || "2000", 10));
    const indicator = $("#live-indicator");
    let busy = false;
    async function tick() {
      if (busy || document.hidden) return;
      busy = true;
      try {
        const r = await fetch(url, { headers: { "x-console-fetch": "1" }, credentials: "same-origin", cache: "no-store" });
        if (r.status === 401) return toLogin();
        if (!r.ok) throw new Error("HTTP " + r.status);
        el.innerHTML = await r.text(); // server-rendered, escaped by the template engine
        el.dataset.updated = String(Date.now());
        if (indicator) indicator.classList.remove("stale");
      } catch (e) {
        if (indicator) indicator.classList.add("stale");
      } finally {
        busy = false;
      }
    }
    setInterval(tick, every);
  }

  // ---- confirmations and copy buttons ------------------------------------------------------------
  document.addEventListener("submit", (ev) => {
    const form = ev.target;
    if (form.dataset && form.dataset.confirm && !window.confirm(form.dataset.confirm)) ev.preventDefault();
  });
  document.addEventListener("click", (ev) => {
    const btn = ev.target.closest && ev.target.closest("[data-copy]");
    if (!btn) return;
    const src = $(btn.dataset.copy);
    if (!src) return;
    const done = () => { btn.textContent = "Copied"; setTimeout(() => (btn.textContent = "Copy"), 1500); };
    if (navigator.clipboard && window.isSecureContext) {
      navigator.clipboard.writeText(src.textContent.trim()).then(done, () => selectText(src));
    } else {
      selectText(src);
      try { document.execCommand("copy"); done(); } catch (e) { /* the text stays selected */ }
    }
  });
  function selectText(node) {
    const range = document.createRange();
    range.selectNodeContents(node);
    const sel = window.getSelection();
    sel.removeAllRanges();
    sel.addRange(range);
  }

  // an API refusal as an Error: its message, and the request field it is about (error.param) where it names one
  async function apiError(response) {
    const err = new Error("HTTP " + response.status);
    try {
      const body = await response.json();
      if (body && body.error && body.error.message) {
        err.message = body.error.message;
        err.param = body.error.param || null;
      }
    } catch (e) { /* not JSON */ }
    return err;
  }

  // ---- a refusal about one field: that field marked and the message beside it, as the server-rendered forms do --
  function clearFieldErrors(form) {
    form.querySelectorAll(".field-error.from-client").forEach((p) => p.remove());
    form.querySelectorAll("[aria-invalid]").forEach((el) => {
      el.removeAttribute("aria-invalid");
      el.removeAttribute("aria-describedby");
    });
  }

  function markField(form, param, message) {
    const el = param ? form.elements.namedItem(param) : null;
    if (!el || !el.id) return false; // a field this form does not have: the status line alone tells it
    const p = document.createElement("p");
    p.id = el.id + "-error";
    p.className = "field-error from-client";
    p.textContent = message;
    el.setAttribute("aria-invalid", "true");
    el.setAttribute("aria-describedby", p.id);
    el.insertAdjacentElement("afterend", p);
    el.focus();
    return true;
  }

  // ---- playground: POST with stream=true, read the SSE body as it arrives -------------------------
  function startPlayground(form) {
    const out = $("#pg-text"), echo = $("#pg-echo"), caret = $("#pg-caret"), status = $("#pg-status");
    const run = $("#pg-run"), stop = $("#pg-stop");
    let controller = null;

    function setStatus(text, cls) {
      status.textContent = text;
      status.className = "fine" + (cls ? " " + cls : "");
    }

    stop.addEventListener("click", () => controller && controller.abort());
    form.addEventListener("submit", async (ev) => {
      ev.preventDefault();
      clearFieldErrors(form);
      const data = new FormData(form);
      const maxText = String(data.get("max_tokens") || "").trim();
      if (!/^[0-9]+$/.test(maxText) || parseInt(maxText, 10) < 1) {
        // not silently 16: the same rule as every number field (ASCII digits, at least 1)
        const message = "Max tokens must be a whole number of at least 1, got '" + maxText + "'.";
        markField(form, "max_tokens", message);
        return setStatus(message, "err-text");
      }
      const body = {
        model: data.get("model"), prompt: data.get("prompt"),
        max_tokens: parseInt(maxText, 10),
        temperature: parseFloat(data.get("temperature") || "0.7"),
        stream: true, stream_options: { include_usage: true },
      };
      out.textContent = "";
      echo.textContent = body.prompt;
      $("#pg-usage").hidden = true;
      caret.hidden = false;
      run.disabled = true; stop.disabled = false;
      setStatus("Waiting for the first token…");
      controller = new AbortController();
      const t0 = performance.now();
      let ttft = null;
      try {
        const r = await fetch(form.dataset.endpoint, {
          method: "POST", credentials: "same-origin", signal: controller.signal,
          headers: { "content-type": "application/json", "x-csrf-token": csrf(), accept: "text/event-stream" },
          body: JSON.stringify(body),
        });
        if (r.status === 401) return toLogin();
        if (!r.ok) throw await apiError(r);
        const reader = r.body.getReader();
        const decoder = new TextDecoder();
        let buffer = "", finished = false;
        while (!finished) {
          const { value, done } = await reader.read();
          if (done) break;
          buffer += decoder.decode(value, { stream: true });
          let cut;
          while ((cut = buffer.indexOf("\n\n")) >= 0) {
            const event = buffer.slice(0, cut);
            buffer = buffer.slice(cut + 2);
            for (const line of event.split("\n")) {
              if (!line.startsWith("data:")) continue;
              const payload = line.slice(5).trim();
              if (payload === "[DONE]") { finished = true; break; }
              const msg = JSON.parse(payload);
              if (msg.error) throw new Error(msg.error.message);
              for (const choice of msg.choices || []) {
                if (choice.text) {
                  if (ttft === null) { ttft = performance.now() - t0; setStatus("Streaming…"); }
                  out.textContent += choice.text;
                }
              }
              if (msg.usage) {
                $("#pg-prompt-tokens").textContent = msg.usage.prompt_tokens;
                $("#pg-completion-tokens").textContent = msg.usage.completion_tokens;
              }
            }
          }
        }
        const total = performance.now() - t0;
        $("#pg-ttft").textContent = ttft === null ? "—" : (ttft / 1000).toFixed(2) + " s";
        $("#pg-total").textContent = (total / 1000).toFixed(2) + " s";
        $("#pg-usage").hidden = false;
        setStatus("Done", "ok-text");
      } catch (e) {
        if (e.param) markField(form, e.param, e.message);
        setStatus(e.name === "AbortError" ? "Stopped" : "Error: " + e.message, e.name === "AbortError" ? "" : "err-text");
      } finally {
        caret.hidden = true;
        run.disabled = false; stop.disabled = true;
        controller = null;
      }
    });
  }

  // ---- adapter upload with a progress bar (XHR: fetch has no upload progress) --------------------
  function startUpload(form) {
    const bar = $("#up-progress"), note = $("#up-note"), button = $("button[type=submit]", form);
    const shared = $("#up-shared"), visibility = $("#up-vis");
    if (shared && visibility) {
      // names to share with make the adapter shared (private with names is refused: it would share nothing)
      shared.addEventListener("input", () => {
        if (shared.value.trim() && visibility.value === "private") visibility.value = "shared";
      });
    }
    form.addEventListener("submit", (ev) => {
      ev.preventDefault();
      clearFieldErrors(form);
      const data = new FormData(form);
      for (const [key, value] of Array.from(data.entries())) {
        if (value instanceof File && !value.name) data.delete(key); // unchosen file inputs
      }
      // the API's rule (one archive, or config + weights), told in the form's words before anything is sent
      const files = data.has("archive") ? (data.has("config") || data.has("weights") ? "both" : "ok")
        : (data.has("config") && data.has("weights") ? "ok" : "missing");
      if (files !== "ok") {
        note.className = "err-text";
        note.textContent = files === "both"
          ? "Choose either one archive, or adapter_config.json + adapter_model.safetensors, not both."
          : "Choose adapter_config.json and adapter_model.safetensors, or one archive (.tar.gz, .zip).";
        return;
      }
      const xhr = new XMLHttpRequest();
      xhr.open("POST", form.dataset.endpoint);
      xhr.setRequestHeader("x-csrf-token", csrf());
      xhr.responseType = "json";
      bar.value = 0; bar.hidden = false;
      button.disabled = true;
      note.className = "fine";
      note.textContent = "Uploading…";
      xhr.upload.addEventListener("progress", (e) => {
        if (e.lengthComputable) {
          bar.value = Math.round((100 * e.loaded) / e.total);
          note.textContent = e.loaded < e.total ? "Uploading… " + bar.value + "%" : "Validating…";
        }
      });
      xhr.addEventListener("load", () => {
        button.disabled = false;
        if (xhr.status === 401) return toLogin();
        const body = xhr.response || {};
        if (xhr.status >= 200 && xhr.status < 300) {
          bar.value = 100;
          note.textContent = "Uploaded.";
          window.location.href = form.dataset.next + (body.id ? "?uploaded=" + encodeURIComponent(body.id) : "");
        } else {
          note.className = "err-text";
          note.textContent = (body.error && body.error.message) || "Upload failed (HTTP " + xhr.status + ").";
          if (body.error && body.error.param) markField(form, body.error.param, body.error.message);
        }
      });
      xhr.addEventListener("error", () => {
        button.disabled = false;
        note.className = "err-text";
        note.textContent = "The upload was interrupted (network error or the file is over the size limit).";
      });
      xhr.send(data);
    });
  }

  document.addEventListener("DOMContentLoaded", () => {
    document.querySelectorAll("[data-refresh]").forEach(startRefresh);
    const pg = $("#playground-form");
    if (pg) startPlayground(pg);
    const up = $("#upload-form");
    if (up) startUpload(up);
  });
})();
