// The kimi-mlx chat page: conversations in localStorage, replies streamed from
// /v1/chat/completions, model output rendered as sanitized markdown (marked + DOMPurify),
// code highlighted (highlight.js). No build step, no network but this server.
"use strict";

const LS = {conversations: "kimi-mlx.conversations", current: "kimi-mlx.current",
            key: "kimi-mlx.api-key", settings: "kimi-mlx.settings"};
const $ = (id) => document.getElementById(id);

// ------------------------------------------------------------------ markdown

DOMPurify.addHook("afterSanitizeAttributes", (node) => {
  if (node.tagName === "A") {  // links open elsewhere, never with access to this page
    node.setAttribute("target", "_blank");
    node.setAttribute("rel", "noopener noreferrer");
  }
});

/** Model text (untrusted) -> sanitized HTML: markdown by marked, then DOMPurify, which
 *  drops event-handler attributes, scripts and javascript: URLs. */
function renderMarkdown(md) {
  return DOMPurify.sanitize(marked.parse(md || "", {gfm: true}), {USE_PROFILES: {html: true}});
}

/** Put rendered markdown into `el`: highlighted code blocks, each with a copy button. */
function fillMarkdown(el, md) {
  el.innerHTML = renderMarkdown(md);
  for (const code of el.querySelectorAll("pre > code")) {
    if (window.hljs) hljs.highlightElement(code);
    const b = document.createElement("button");
    b.className = "copy";
    b.type = "button";
    b.textContent = "copy";
    b.addEventListener("click", async () => {
      try { await navigator.clipboard.writeText(code.textContent); b.textContent = "copied"; }
      catch (e) { b.textContent = "copy failed"; }
      setTimeout(() => { b.textContent = "copy"; }, 1500);
    });
    code.parentElement.appendChild(b);
  }
}

// ------------------------------------------------------------------ storage

function load(key, fallback) {
  try { const v = localStorage.getItem(key); return v === null ? fallback : JSON.parse(v); }
  catch (e) { return fallback; }
}
function save(key, value) {
  try { localStorage.setItem(key, JSON.stringify(value)); }
  catch (e) { showError(`not saved in this browser (${e.name}): images take room; delete old conversations`); }
}

const state = {
  conversations: load(LS.conversations, []),
  current: load(LS.current, null),
  model: null,
  controller: null,   // AbortController of the reply in flight
  attachments: [],    // images for the next message: {name, url (a data: URL)}
};

const IMAGE_TYPES = ["image/png", "image/jpeg", "image/webp", "image/gif"];

function apiKey() { return sessionStorage.getItem(LS.key) || localStorage.getItem(LS.key) || ""; }
function setApiKey(key, remember) {
  sessionStorage.removeItem(LS.key);
  localStorage.removeItem(LS.key);
  (remember ? localStorage : sessionStorage).setItem(LS.key, key);
}

function persist() {
  save(LS.conversations, state.conversations);
  save(LS.current, state.current);
}

function conversation() {
  let c = state.conversations.find((x) => x.id === state.current);
  if (!c) {
    c = {id: "c" + Date.now().toString(36) + Math.random().toString(36).slice(2, 6),
         title: "New conversation", created: Date.now(), messages: []};
    state.conversations.unshift(c);
    state.current = c.id;
    persist();
  }
  return c;
}

// ------------------------------------------------------------------ settings

function readSettings() {
  const s = load(LS.settings, {});
  if (s.effort) $("effort").value = s.effort;
  if (s.temperature !== undefined) $("temperature").value = s.temperature;
  if (s.maxTokens !== undefined) $("max-tokens").value = s.maxTokens;
}
function writeSettings() {
  save(LS.settings, {effort: $("effort").value, temperature: $("temperature").value,
                     maxTokens: $("max-tokens").value});
}

// ------------------------------------------------------------------ rendering

function renderList() {
  const ul = $("conversations");
  ul.textContent = "";
  for (const c of state.conversations) {
    const li = document.createElement("li");
    li.textContent = c.title;
    li.dataset.id = c.id;
    if (c.id === state.current) li.className = "current";
    li.addEventListener("click", () => { if (!state.controller) { state.current = c.id; persist(); renderAll(); } });
    ul.appendChild(li);
  }
}

function statsText(st) {
  if (!st) return "";
  const parts = [];
  if (st.tokens !== undefined) parts.push(`${st.tokens} tokens`);
  if (st.tps) parts.push(`${st.tps.toFixed(1)} tok/s`);
  if (st.cached !== undefined) parts.push(`${st.cached} cached prompt tokens`);
  if (st.ttft !== undefined) parts.push(`TTFT ${Math.round(st.ttft)} ms`);
  if (st.finish) parts.push(st.finish);
  return parts.join(" · ");
}

/** Tool calls (and their arguments so far) as text; a tool message shows its result. */
function fillCalls(el, calls) {
  el.textContent = "";
  for (const c of calls || []) {
    const t = document.createElement("div");
    t.className = "tool-call";
    t.textContent = `${c.function.name}(${c.function.arguments})  [${c.id}]`;
    el.appendChild(t);
  }
}

/** The element of one message (assistant: reasoning apart, collapsed unless streaming). */
function messageView(m, streaming) {
  const div = document.createElement("div");
  div.className = "msg " + m.role;
  if (!streaming) div.dataset.done = "1";
  const role = document.createElement("div");
  role.className = "role";
  role.textContent = m.role;
  div.appendChild(role);
  if (m.role !== "assistant") {
    const parts = Array.isArray(m.content) ? m.content : [{type: "text", text: m.content || ""}];
    const images = document.createElement("div");
    images.className = "images";
    for (const p of parts) {
      const url = p.type === "image_url" && p.image_url && p.image_url.url;
      if (typeof url === "string" && url.startsWith("data:image/")) {
        images.appendChild(Object.assign(document.createElement("img"), {src: url, alt: "image"}));
      }
    }
    if (images.childElementCount) div.appendChild(images);
    const body = document.createElement("div");
    body.className = "content";
    // the user's own text, shown as typed
    body.textContent = parts.filter((p) => p.type === "text").map((p) => p.text).join("");
    div.appendChild(body);
    return div;
  }
  const det = document.createElement("details");
  det.className = "reasoning";
  det.open = !!streaming;
  det.hidden = !m.reasoning_content;
  const sum = document.createElement("summary");
  sum.textContent = streaming ? "Thinking…" : "Reasoning";
  const rt = document.createElement("div");
  rt.className = "reasoning-text";
  rt.textContent = m.reasoning_content || "";
  det.append(sum, rt);
  const body = document.createElement("div");
  body.className = "content";
  fillMarkdown(body, m.content);
  const calls = document.createElement("div");
  calls.className = "tool-calls";
  fillCalls(calls, m.tool_calls);
  const stats = document.createElement("div");
  stats.className = "stats";
  stats.textContent = statsText(m.stats);
  div.append(det, body, calls, stats);
  return div;
}

function renderMessages() {
  const box = $("messages");
  box.textContent = "";
  for (const m of conversation().messages) box.appendChild(messageView(m, false));
  box.scrollTop = box.scrollHeight;
}

function renderAll() { renderList(); renderMessages(); }

function showError(text) {
  const e = $("error");
  e.textContent = text || "";
  e.hidden = !text;
}

function busy(on) {
  $("send").disabled = on;
  $("stop").disabled = !on;
}

// ------------------------------------------------------------------ the API

class HttpError extends Error {
  constructor(status, message) { super(message); this.status = status; }
}

function headers() {
  const h = {"Content-Type": "application/json"};
  const key = apiKey();
  if (key) h["Authorization"] = "Bearer " + key;  // a header, never the URL
  return h;
}

/** POST a streamed chat completion; calls onChunk(obj) per SSE data object. */
async function streamChat(body, signal, onChunk) {
  const r = await fetch("v1/chat/completions", {method: "POST", headers: headers(),
                                                body: JSON.stringify(body), signal});
  if (!r.ok) {
    let msg = r.statusText;
    try { msg = (await r.json()).error.message; } catch (e) { /* not JSON */ }
    throw new HttpError(r.status, msg);
  }
  const reader = r.body.getReader();
  const dec = new TextDecoder();
  let buf = "";
  for (;;) {
    const {value, done} = await reader.read();
    if (done) return;
    buf += dec.decode(value, {stream: true});
    let i;
    while ((i = buf.indexOf("\n\n")) >= 0) {
      const block = buf.slice(0, i);
      buf = buf.slice(i + 2);
      for (const line of block.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") return;
        const obj = JSON.parse(data);
        if (obj.error) throw new HttpError(500, obj.error.message);
        onChunk(obj);
      }
    }
  }
}

/** What the server gets back of a stored message: the whole assistant turn (content,
 *  reasoning, tool calls), never the page's own fields. */
function wireMessage(m) {
  const out = {role: m.role, content: m.content || ""};
  if (m.reasoning_content) out.reasoning_content = m.reasoning_content;
  if (m.tool_calls && m.tool_calls.length) out.tool_calls = m.tool_calls;
  if (m.tool_call_id) out.tool_call_id = m.tool_call_id;
  if (m.name) out.name = m.name;
  return out;
}

function requestBody(conv) {
  const body = {model: state.model || "default", stream: true,
                stream_options: {include_usage: true},
                messages: conv.messages.map(wireMessage),
                reasoning_effort: $("effort").value};
  const t = $("temperature").value;
  if (t !== "") body.temperature = Number(t);
  const n = $("max-tokens").value;
  if (n !== "") body.max_tokens = Number(n);
  return body;
}

/** Generate the assistant reply to the conversation's last message. */
async function generate() {
  if (!state.model) await refreshStatus();  // the model id comes from /health
  const conv = conversation();
  const m = {role: "assistant", content: "", reasoning_content: "", tool_calls: [], stats: {}};
  const view = messageView(m, true);
  $("messages").appendChild(view);
  const det = view.querySelector("details.reasoning");
  const rt = view.querySelector(".reasoning-text");
  const body = view.querySelector(".content");
  const stats = view.querySelector(".stats");
  const calls = view.querySelector(".tool-calls");
  const controller = new AbortController();
  state.controller = controller;
  busy(true);
  showError("");
  const t0 = performance.now();
  let tFirst = null, usage = null, finish = null, pending = false;
  const paint = () => {
    pending = false;
    det.hidden = !m.reasoning_content;
    rt.textContent = m.reasoning_content;
    fillMarkdown(body, m.content);
    fillCalls(calls, m.tool_calls);
    if (m.content && det.open && det.dataset.userOpened !== "1") det.open = false;
    $("messages").scrollTop = $("messages").scrollHeight;
  };
  det.addEventListener("toggle", () => { if (det.open && m.content) det.dataset.userOpened = "1"; });
  try {
    await streamChat(requestBody(conv), controller.signal, (obj) => {
      if (obj.usage) usage = obj.usage;
      const ch = (obj.choices || [])[0];
      if (!ch) return;
      if (ch.finish_reason) finish = ch.finish_reason;
      const d = ch.delta || {};
      if ((d.reasoning_content || d.content) && tFirst === null) tFirst = performance.now();
      if (d.reasoning_content) m.reasoning_content += d.reasoning_content;
      if (d.content) m.content += d.content;
      for (const tc of d.tool_calls || []) {
        if (!m.tool_calls[tc.index]) {
          m.tool_calls[tc.index] = {id: tc.id, type: "function",
                                    function: {name: tc.function.name, arguments: ""}};
        }
        m.tool_calls[tc.index].function.arguments += tc.function.arguments || "";
      }
      if (!pending) { pending = true; requestAnimationFrame(paint); }
    });
  } catch (e) {
    if (e.name === "AbortError") {
      finish = "stopped";
    } else {
      view.remove();
      state.controller = null;
      busy(false);
      if (e.status === 401) {
        showError(`401: ${e.message}`);
        askKey(e.message);
      } else {
        showError(e.status ? `${e.status}: ${e.message}` : `request failed: ${e.message}`);
      }
      return;
    }
  }
  const tEnd = performance.now();
  paint();
  m.stats = {finish};
  if (tFirst !== null) m.stats.ttft = tFirst - t0;
  if (usage) {
    m.stats.tokens = usage.completion_tokens;
    m.stats.cached = (usage.prompt_tokens_details || {}).cached_tokens || 0;
    if (tFirst !== null && tEnd > tFirst && usage.completion_tokens > 1) {
      m.stats.tps = (usage.completion_tokens - 1) / ((tEnd - tFirst) / 1000);
    }
  }
  if (!m.tool_calls.length) delete m.tool_calls;
  conv.messages.push(m);
  persist();
  det.open = false;
  det.querySelector("summary").textContent = "Reasoning";
  stats.textContent = statsText(m.stats);
  state.controller = null;
  busy(false);
  view.dataset.done = "1";
}

async function send() {
  if (state.controller) return;
  const text = $("prompt").value;
  const images = state.attachments;
  if (!text.trim() && !images.length) return;
  const conv = conversation();
  // images first, then the text (as `kimi-mlx generate --image` builds the prompt)
  const content = images.length
    ? [...images.map((a) => ({type: "image_url", image_url: {url: a.url}})), {type: "text", text}]
    : text;
  conv.messages.push({role: "user", content});
  if (conv.title === "New conversation") conv.title = (text.trim() || images[0].name).slice(0, 40);
  persist();
  $("prompt").value = "";
  state.attachments = [];
  renderAttachments();
  renderAll();
  await generate();
}

// ------------------------------------------------------------------ images

function renderAttachments() {
  const box = $("attachments");
  box.textContent = "";
  box.hidden = !state.attachments.length;
  state.attachments.forEach((a, i) => {
    const d = document.createElement("div");
    d.className = "attachment";
    d.title = a.name;
    const rm = Object.assign(document.createElement("button"), {type: "button", textContent: "×",
                                                               title: `remove ${a.name}`});
    rm.addEventListener("click", () => { state.attachments.splice(i, 1); renderAttachments(); });
    d.append(Object.assign(document.createElement("img"), {src: a.url, alt: a.name}), rm);
    box.appendChild(d);
  });
}

function readDataUrl(file) {
  return new Promise((resolve, reject) => {
    const r = new FileReader();
    r.onload = () => resolve(r.result);
    r.onerror = () => reject(r.error);
    r.readAsDataURL(file);
  });
}

/** Files from the picker -> attachments (data URLs, sent as `image_url` parts). */
async function attachFiles(files) {
  showError("");
  for (const f of files) {
    if (!IMAGE_TYPES.includes(f.type)) {
      showError(`${f.name}: not a PNG, JPEG, WebP or GIF image`);
      continue;
    }
    try { state.attachments.push({name: f.name, url: await readDataUrl(f)}); }
    catch (e) { showError(`${f.name}: cannot be read (${e && e.message})`); }
  }
  renderAttachments();
}

// ------------------------------------------------------------------ API key

function askKey(reason) {
  $("key-reason").textContent = `This server needs an API key (${reason}).`;
  $("api-key").value = "";
  $("key-dialog").showModal();
}

$("key-dialog").addEventListener("close", () => {
  if ($("key-dialog").returnValue !== "save") return;
  setApiKey($("api-key").value.trim(), $("key-remember").checked);
  const conv = conversation();
  const last = conv.messages[conv.messages.length - 1];
  if (last && last.role === "user") generate();  // retry the turn that was refused
});

// ------------------------------------------------------------------ status strip

async function refreshStatus() {
  const el = $("status");
  let h;
  try {
    const r = await fetch("health");
    h = await r.json();
  } catch (e) {
    el.innerHTML = "";
    el.append(Object.assign(document.createElement("span"), {className: "bad", textContent: "● server unreachable"}));
    return;
  }
  if (h.model) state.model = h.model;
  el.textContent = "";
  const main = document.createElement("span");
  main.className = h.status === "ok" ? "ok" : "bad";
  main.textContent = h.status === "ok" ? `● ready · ${h.model}` : `● ${h.reason || h.status}`;
  el.appendChild(main);
  for (const s of h.stages || []) {
    const st = document.createElement("span");
    st.className = "stage " + (s.ok ? "ok" : "bad");
    st.textContent = `stage ${s.index} · ${s.node} · layers ${s.layers[0]}–${s.layers[1]} ${s.ok ? "✓" : "✗ " + (s.reason || "")}`;
    el.appendChild(st);
  }
}

// ------------------------------------------------------------------ wiring

$("composer").addEventListener("submit", (e) => { e.preventDefault(); send(); });
$("prompt").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); send(); }
});
$("stop").addEventListener("click", () => { if (state.controller) state.controller.abort(); });
$("attach").addEventListener("click", () => $("image-file").click());
$("image-file").addEventListener("change", async (e) => {
  await attachFiles(Array.from(e.target.files || []));
  e.target.value = "";  // the same file can be picked again
});
$("new-chat").addEventListener("click", () => {
  if (state.controller) return;
  state.current = null;
  conversation();
  renderAll();
});
$("rename-chat").addEventListener("click", () => {
  const c = conversation();
  const t = prompt("Rename conversation", c.title);
  if (t !== null && t.trim()) { c.title = t.trim(); persist(); renderList(); }
});
$("delete-chat").addEventListener("click", () => {
  if (state.controller) return;
  const c = conversation();
  if (!confirm(`Delete "${c.title}"?`)) return;
  state.conversations = state.conversations.filter((x) => x.id !== c.id);
  state.current = state.conversations.length ? state.conversations[0].id : null;
  persist();
  renderAll();
});
$("export-chat").addEventListener("click", () => {
  const c = conversation();
  const blob = new Blob([JSON.stringify(c, null, 2)], {type: "application/json"});
  const a = document.createElement("a");
  a.href = URL.createObjectURL(blob);
  a.download = `${c.title.replace(/[^\w.-]+/g, "_") || "conversation"}.json`;
  a.click();
  setTimeout(() => URL.revokeObjectURL(a.href), 1000);
});
for (const id of ["effort", "temperature", "max-tokens"]) {
  $(id).addEventListener("change", writeSettings);
  $(id).addEventListener("input", writeSettings);
}

readSettings();
conversation();
renderAll();
refreshStatus();
setInterval(refreshStatus, 5000);

window.kimiChat = {renderMarkdown, fillMarkdown, state};  // for tests and the console
