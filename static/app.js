// The actorllm chat playground: streams over SSE (fetch + ReadableStream) or the
// WebSocket protocol, stops for real (aborted fetch / cancel frame), renders answers as
// Markdown, keeps the conversation in localStorage. No build step, no CDN.

import { renderMarkdown } from "./render.js";

const STORE = "actorllm.conversation.v1";
const THEME = "actorllm.theme";
const KEY = "actorllm.api_key";
const $ = (id) => document.getElementById(id);
const els = {
  conversation: $("conversation"),
  empty: $("empty"),
  theme: $("theme"),
  form: $("composer"),
  input: $("input"),
  send: $("send"),
  clear: $("clear"),
  model: $("model"),
  system: $("system"),
  temperature: $("temperature"),
  top_p: $("top_p"),
  max_tokens: $("max_tokens"),
  jsonMode: $("json_mode"),
  tools: $("tools"),
  toolChoice: $("tool_choice"),
  apiKey: $("api_key"),
  settings: $("settings"),
};

/** The API key typed in Settings: sent as a bearer token, and as ?api_key= on the
 * WebSocket (browsers cannot set its headers). Kept in sessionStorage only. */
function apiKey() {
  return els.apiKey.value.trim();
}

function authHeaders(extra = {}) {
  const key = apiKey();
  return key ? { ...extra, Authorization: `Bearer ${key}` } : extra;
}

/** A user turn that got no answer (stopped before its first token, or refused) is
 * `unanswered`: shown, but left out of the conversation sent with later messages.
 * @type {{role: string, content: string, model?: string, stats?: string, error?: boolean, unanswered?: string}[]} */
let turns = loadTurns();
let current = null; // the generation in flight: {stop(), turn, el}

function loadTurns() {
  try {
    const v = JSON.parse(localStorage.getItem(STORE) || "[]");
    return Array.isArray(v) ? v : [];
  } catch {
    return [];
  }
}

function saveTurns() {
  localStorage.setItem(STORE, JSON.stringify(turns));
}

function turnElement(turn) {
  const el = document.createElement("div");
  el.className = `turn ${turn.error ? "error" : turn.role}`;
  el.classList.toggle("unanswered", Boolean(turn.unanswered));
  if (turn.role === "assistant" && !turn.error) {
    const who = document.createElement("div");
    who.className = "who";
    who.textContent = turn.model || "";
    el.appendChild(who);
  }
  const body = document.createElement("div");
  body.className = "body";
  el.appendChild(body);
  const stats = document.createElement("div");
  stats.className = "stats";
  el.appendChild(stats);
  fill(el, turn);
  return el;
}

function fill(el, turn) {
  const body = el.querySelector(".body");
  if (turn.role === "assistant" && !turn.error) renderMarkdown(body, turn.content);
  else body.textContent = turn.content;
  fillExtras(el, turn);
  el.querySelector(".stats").textContent = turn.unanswered || turn.stats || "";
}

/** An answer's reasoning (folded, before the answer) and its tool calls (after it), each
 * shown as what it is; model output goes in as text only. */
function fillExtras(el, turn) {
  const body = el.querySelector(".body");
  let thinking = el.querySelector(".reasoning");
  if (turn.reasoning) {
    if (!thinking) {
      thinking = document.createElement("details");
      thinking.className = "reasoning";
      const summary = document.createElement("summary");
      summary.textContent = "Thinking";
      thinking.append(summary, document.createElement("div"));
      el.insertBefore(thinking, body);
    }
    thinking.lastChild.textContent = turn.reasoning;
  } else if (thinking) thinking.remove();
  el.querySelector(".tool-calls")?.remove();
  if (turn.toolCalls?.length) {
    const box = document.createElement("div");
    box.className = "tool-calls";
    for (const call of turn.toolCalls) {
      const item = document.createElement("div");
      item.className = "tool-call";
      const name = document.createElement("div");
      name.className = "tool-name";
      name.textContent = `Calls ${call.name}`;
      const args = document.createElement("pre");
      args.className = "tool-arguments";
      let text = call.arguments;
      try {
        text = JSON.stringify(JSON.parse(call.arguments), null, 2);
      } catch {
        /* still streaming, or not JSON: shown as it is */
      }
      args.textContent = text;
      item.append(name, args);
      box.appendChild(item);
    }
    body.after(box);
  }
}

/** Re-renders a streaming answer at most once a frame, keeping the view at the bottom
 * when it was there (a reader who scrolled up is left where they are). */
function fillSoon(el, turn) {
  if (el.pendingFill) return;
  el.pendingFill = requestAnimationFrame(() => {
    el.pendingFill = 0;
    const follow = atBottom();
    fill(el, turn);
    if (follow) scrollDown();
  });
}

function fillNow(el, turn) {
  cancelAnimationFrame(el.pendingFill || 0);
  el.pendingFill = 0;
  const follow = atBottom();
  fill(el, turn);
  if (follow) scrollDown();
}

function renderAll() {
  els.conversation.replaceChildren(els.empty, ...turns.map(turnElement));
  els.empty.hidden = turns.length > 0;
  scrollDown();
}

function atBottom() {
  const c = els.conversation;
  return c.scrollHeight - c.scrollTop - c.clientHeight <= 48;
}

function scrollDown() {
  els.conversation.scrollTop = els.conversation.scrollHeight;
}

function addTurn(turn) {
  turns.push(turn);
  els.empty.hidden = true;
  const el = turnElement(turn);
  els.conversation.appendChild(el);
  scrollDown();
  return el;
}

/** Leaves `turn` (a question) out of later requests, saying why on its card. */
function markUnanswered(turn, el, why) {
  turn.unanswered = why;
  el.classList.add("unanswered");
  fill(el, turn);
}

function showError(message) {
  addTurn({ role: "system", content: message, error: true });
  saveTurns();
}

function setBusy(busy) {
  els.send.textContent = busy ? "Stop" : "Send";
  els.send.classList.toggle("stop", busy);
}

/** Plain words for a failed response. */
async function describeHttpError(resp) {
  let detail = "";
  try {
    const body = await resp.json();
    detail = body?.error?.message || "";
  } catch {
    /* not JSON */
  }
  if (resp.status === 401) {
    els.settings.open = true;
    return apiKey()
      ? "The server refused the API key: check it under Settings."
      : "The server needs an API key: enter it under Settings.";
  }
  if (resp.status === 404) return detail || "The server does not know this model.";
  if (detail) return `The server refused the request: ${detail}`;
  return `The server answered with an error (HTTP ${resp.status}).`;
}

async function loadModels() {
  try {
    const resp = await fetch("v1/models", { headers: authHeaders() });
    if (!resp.ok) throw new Error(await describeHttpError(resp));
    const list = await resp.json();
    const previous = els.model.value;
    els.model.replaceChildren(
      ...list.data.map((m) => {
        const o = document.createElement("option");
        o.value = m.id;
        o.textContent = m.parent ? `${m.id} (adapter of ${m.parent})` : m.id;
        return o;
      }),
    );
    if (previous) els.model.value = previous;
  } catch (e) {
    showError(`Cannot load the model list: ${e.message || "the server is not reachable."}`);
  }
}

function requestBody() {
  const messages = [];
  const system = els.system.value.trim();
  if (system) messages.push({ role: "system", content: system });
  for (const t of turns) {
    if (t.error || t.unanswered || !(t.content || t.toolCalls?.length)) continue;
    if (t.role === "user") messages.push({ role: "user", content: t.content });
    if (t.role === "assistant") {
      const m = { role: "assistant", content: t.content || null };
      if (t.toolCalls?.length) {
        m.tool_calls = t.toolCalls.map((c) => ({ id: c.id, type: "function", function: { name: c.name, arguments: c.arguments } }));
      }
      messages.push(m);
    }
  }
  const body = {
    model: els.model.value || undefined,
    messages,
    temperature: Number(els.temperature.value),
    top_p: Number(els.top_p.value),
    max_tokens: Number(els.max_tokens.value),
    stream: true,
    stream_options: { include_usage: true },
  };
  if (els.jsonMode.checked) body.response_format = { type: "json_object" };
  const tools = els.tools.value.trim();
  if (tools) {
    try {
      body.tools = JSON.parse(tools);
    } catch (e) {
      throw new Error(`The tools are not valid JSON: ${e.message}`);
    }
    body.tool_choice = els.toolChoice.value;
  }
  return body;
}

/** Adds a streamed tool-call delta to the turn's calls (by index, as OpenAI streams them). */
function addToolCallDelta(turn, d) {
  turn.toolCalls = turn.toolCalls || [];
  const call = (turn.toolCalls[d.index] = turn.toolCalls[d.index] || { id: "", name: "", arguments: "" });
  if (d.id) call.id = d.id;
  if (d.function?.name) call.name = d.function.name;
  if (d.function?.arguments) call.arguments += d.function.arguments;
}

/** Tracks time to first token, tokens/s and the finish reason of one answer. */
class Meter {
  constructor() {
    this.start = performance.now();
    this.first = null;
    this.last = null;
    this.tokens = 0;
  }
  token(n = 1) {
    const now = performance.now();
    if (this.first === null) this.first = now;
    this.last = now;
    this.tokens += n;
  }
  line(finish) {
    if (this.first === null) return `finish: ${finish}`;
    const ttft = this.first - this.start;
    const span = (this.last - this.first) / 1000;
    const rate = this.tokens > 1 && span > 0 ? ((this.tokens - 1) / span).toFixed(1) : "–";
    return `TTFT ${ttft.toFixed(0)} ms · ${rate} tok/s · ${this.tokens} tokens · finish: ${finish}`;
  }
}

async function streamSse(body, turn, el, meter, signal) {
  let resp;
  try {
    resp = await fetch("v1/chat/completions", {
      method: "POST",
      headers: authHeaders({ "Content-Type": "application/json" }),
      body: JSON.stringify(body),
      signal,
    });
  } catch (e) {
    if (signal.aborted) return "stopped";
    throw new Error("The server is not reachable. Is actorllm running?");
  }
  if (!resp.ok) throw new Error(await describeHttpError(resp));
  const reader = resp.body.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  let finish = "unknown";
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buf.indexOf("\n\n")) >= 0) {
        const event = buf.slice(0, cut);
        buf = buf.slice(cut + 2);
        if (!event.startsWith("data: ")) continue;
        const data = event.slice(6);
        if (data === "[DONE]") return finish;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new Error(`The server failed while answering: ${chunk.error.message}`);
        if (chunk.model && turn.model !== chunk.model) {
          turn.model = chunk.model;
          el.querySelector(".who").textContent = chunk.model;
        }
        for (const c of chunk.choices || []) {
          const d = c.delta || {};
          if (d.content || d.reasoning_content || d.tool_calls) {
            meter.token();
            turn.content += d.content || "";
            if (d.reasoning_content) turn.reasoning = (turn.reasoning || "") + d.reasoning_content;
            for (const call of d.tool_calls || []) addToolCallDelta(turn, call);
            fillSoon(el, turn);
          }
          if (c.finish_reason) finish = c.finish_reason;
        }
      }
    }
  } catch (e) {
    if (signal.aborted) return "stopped";
    throw e;
  }
  return finish;
}

let socket = null;
const wsHandlers = new Map();

function openSocket() {
  if (socket && socket.readyState <= WebSocket.OPEN) return Promise.resolve(socket);
  return new Promise((resolve, reject) => {
    // Relative to the page, so that the playground works under a --root-path prefix.
    const url = new URL("v1/ws", document.baseURI);
    url.protocol = location.protocol === "https:" ? "wss:" : "ws:";
    const key = apiKey();
    if (key) url.searchParams.set("api_key", key);
    const ws = new WebSocket(url);
    ws.onopen = () => {
      socket = ws;
      resolve(ws);
    };
    // The browser hides the refused upgrade's status: ask the models route why.
    ws.onerror = async () => {
      let why = "The WebSocket connection failed. Is actorllm running?";
      try {
        const resp = await fetch("v1/models", { headers: authHeaders() });
        if (resp.status === 401) why = await describeHttpError(resp);
      } catch {
        /* not reachable: the first message stands */
      }
      reject(new Error(why));
    };
    ws.onclose = () => {
      socket = null;
      for (const h of wsHandlers.values()) h({ type: "error", error: { message: "The WebSocket connection closed." } });
      wsHandlers.clear();
    };
    ws.onmessage = (ev) => {
      const msg = JSON.parse(ev.data);
      const h = wsHandlers.get(msg.id);
      if (h) h(msg);
    };
  });
}

let wsSeq = 0;

async function streamWs(body, turn, el, meter, stopSignal) {
  const ws = await openSocket();
  const id = `g${Date.now().toString(36)}-${wsSeq++}`;
  return new Promise((resolve, reject) => {
    const onStop = () => ws.send(JSON.stringify({ type: "cancel", id }));
    stopSignal.addEventListener("abort", onStop, { once: true });
    wsHandlers.set(id, (msg) => {
      if (msg.type === "started") {
        turn.model = msg.model || turn.model;
        el.querySelector(".who").textContent = turn.model;
      } else if (msg.type === "delta") {
        meter.token();
        turn.content += msg.text;
        fillSoon(el, turn);
      } else if (msg.type === "done") {
        // A request read for tool calls or reasoning gets its message whole at the end.
        const message = msg.choices?.[0]?.message;
        if (message) {
          turn.content = message.content || "";
          turn.reasoning = message.reasoning_content || "";
          turn.toolCalls = (message.tool_calls || []).map((c) => ({ id: c.id, name: c.function.name, arguments: c.function.arguments }));
          fillNow(el, turn);
        }
        wsHandlers.delete(id);
        stopSignal.removeEventListener("abort", onStop);
        resolve(stopSignal.aborted && msg.finish_reason === "abort" ? "stopped" : msg.finish_reason || "unknown");
      } else if (msg.type === "error") {
        wsHandlers.delete(id);
        stopSignal.removeEventListener("abort", onStop);
        reject(new Error(`The server refused the request: ${msg.error?.message || "unknown error"}`));
      }
    });
    ws.send(JSON.stringify({ type: "generate", id, endpoint: "chat", request: body }));
  });
}

async function send(text = els.input.value.trim()) {
  if (!text || current) return;
  let body;
  try {
    body = requestBody();
    body.messages.push({ role: "user", content: text });
  } catch (e) {
    showError(e.message);
    return;
  }
  els.input.value = "";
  const question = { role: "user", content: text };
  const questionEl = addTurn(question);
  const model = body.model || els.model.options[0]?.value || "";
  // The label shows the picker's choice until the server names the model that answers.
  const turn = { role: "assistant", content: "", model, stats: "" };
  const el = addTurn(turn);
  el.dataset.transport = transport();
  const meter = new Meter();
  const controller = new AbortController();
  current = { stop: () => controller.abort() };
  setBusy(true);
  // Nothing was answered: the empty card goes, and the question stays out of later turns.
  const dropAnswer = (why) => {
    turns.splice(turns.indexOf(turn), 1);
    el.remove();
    markUnanswered(question, questionEl, why);
  };
  try {
    const run = transport() === "ws" ? streamWs : streamSse;
    const finish = await run(body, turn, el, meter, controller.signal);
    if (!turn.content && !turn.toolCalls?.length && finish === "stopped") {
      dropAnswer("Stopped before an answer; left out of the conversation.");
    } else {
      turn.stats = meter.line(finish);
      fillNow(el, turn);
    }
  } catch (e) {
    if (!turn.content && !turn.toolCalls?.length) {
      dropAnswer("No answer; left out of the conversation.");
    } else {
      turn.stats = meter.line("error");
      fillNow(el, turn);
    }
    showError(e.message || String(e));
  } finally {
    el.dataset.done = "true";
    questionEl.dataset.done = "true";
    current = null;
    setBusy(false);
    saveTurns();
  }
}

function transport() {
  return document.querySelector('input[name="transport"]:checked').value;
}

els.form.addEventListener("submit", (e) => {
  e.preventDefault();
  if (current) current.stop();
  else send();
});

els.input.addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
    e.preventDefault();
    if (!current) send();
  }
});

els.clear.addEventListener("click", () => {
  if (current) current.stop();
  turns = [];
  saveTurns();
  renderAll();
});

for (const b of els.empty.querySelectorAll("button.example")) {
  b.addEventListener("click", () => send(b.textContent));
}

function applyTheme(theme) {
  if (theme === "light" || theme === "dark") document.documentElement.dataset.theme = theme;
  else delete document.documentElement.dataset.theme;
}

els.theme.value = localStorage.getItem(THEME) || "auto";
els.theme.addEventListener("change", () => {
  localStorage.setItem(THEME, els.theme.value);
  applyTheme(els.theme.value);
});

els.apiKey.value = sessionStorage.getItem(KEY) || "";
els.apiKey.addEventListener("change", () => {
  sessionStorage.setItem(KEY, apiKey());
  if (socket) socket.close();
  loadModels();
});

renderAll();
loadModels();
