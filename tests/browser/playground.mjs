// End-to-end test of the playground in headless Debian chromium (playwright-core).
// Usage: node playground.mjs BASE_URL ARTIFACT_DIR
// Needs a server whose /v1/models lists at least two names. Exits non-zero on failure and
// saves screenshots into ARTIFACT_DIR.

import assert from "node:assert/strict";
import { mkdirSync } from "node:fs";
import { chromium } from "playwright-core";

const [base, outDir] = process.argv.slice(2);
mkdirSync(outDir, { recursive: true });
const log = (...a) => console.log("[browser]", ...a);

async function metric(prefix) {
  const text = await (await fetch(`${base}/metrics`)).text();
  const line = text.split("\n").find((l) => l.startsWith(prefix));
  assert.ok(line, `metric ${prefix} present`);
  return Number(line.split(" ").pop());
}

async function metricReaches(prefix, want) {
  let v = await metric(prefix);
  for (let i = 0; i < 300 && v !== want; i++) {
    await new Promise((r) => setTimeout(r, 100));
    v = await metric(prefix);
  }
  assert.equal(v, want, `${prefix} reaches ${want}`);
}

const chunk = (o) => `data: ${JSON.stringify(o)}\n\n`;
/** A mocked chat stream that sends `text` one character per chunk. */
function mockedStream(model, text) {
  const c = (delta, finish = null) => chunk({ id: "x", object: "chat.completion.chunk", model, choices: [{ index: 0, delta, finish_reason: finish }] });
  return c({ role: "assistant", content: "" }) + [...text].map((ch) => c({ content: ch })).join("") + c({}, "stop") + "data: [DONE]\n\n";
}

const browser = await chromium.launch({
  executablePath: process.env.CHROMIUM || "/usr/bin/chromium",
  args: ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
    "--disable-component-update", "--disable-sync"],
});
let failed = false;
try {
  const page = await browser.newPage({ viewport: { width: 1100, height: 800 } });
  // Console errors and failed loads: none may happen but where a step provokes them.
  let consoleErrors = [];
  page.on("pageerror", (e) => consoleErrors.push(`page error: ${e.message}`));
  page.on("console", (m) => { if (m.type() === "error") consoleErrors.push(m.text()); });
  page.on("response", (r) => {
    if (r.status() >= 400 && !r.url().includes("/v1/")) consoleErrors.push(`${r.status()} for ${r.url()}`);
  });
  const noConsoleErrors = (where) => {
    assert.deepEqual(consoleErrors, [], `no console errors ${where}`);
  };

  // Every chat request the page makes, over SSE and the WebSocket, is recorded; the test
  // can have the server ignore EOS (so that an answer is long enough to stop), refuse the
  // connection, or answer in the server's place: `net.mock` is sent whole over SSE, and
  // over the WebSocket line by line, `net.mockDelay` ms apart, until done or cancelled.
  const net = { ignoreEos: false, mock: null, mockDelay: 10, refuse: false, sent: [] };
  await page.route("**/v1/chat/completions", async (route) => {
    const body = JSON.parse(route.request().postData() || "{}");
    net.sent.push(body);
    if (net.refuse) return route.abort("connectionrefused");
    if (net.mock) return route.fulfill({ status: 200, contentType: "text/event-stream", body: mockedStream(body.model, net.mock) });
    if (net.ignoreEos) body.ignore_eos = true;
    return route.continue({ postData: JSON.stringify(body) });
  });
  const mocked = new Map(); // id → cancel() of a mocked WebSocket generation
  function mockGeneration(ws, frame) {
    const send = (o) => ws.send(JSON.stringify({ id: frame.id, ...o }));
    const pieces = net.mock.split(/(?<=\n)/);
    send({ type: "started", request_id: "mock", model: frame.request.model });
    let i = 0;
    let cancelled = false;
    const timer = setInterval(() => {
      if (cancelled || i >= pieces.length) {
        clearInterval(timer);
        mocked.delete(frame.id);
        send({ type: "done", finish_reason: cancelled ? "abort" : "stop", choices: [], usage: null });
      } else {
        send({ type: "delta", index: 0, text: pieces[i++], token_ids: [0] });
      }
    }, net.mockDelay);
    mocked.set(frame.id, () => { cancelled = true; });
  }
  await page.routeWebSocket(/\/v1\/ws$/, (ws) => {
    const server = ws.connectToServer();
    ws.onMessage((m) => {
      const frame = JSON.parse(m);
      if (frame.type === "generate") {
        net.sent.push(frame.request);
        if (net.mock) return mockGeneration(ws, frame);
        if (net.ignoreEos) frame.request.ignore_eos = true;
      }
      if (frame.type === "cancel" && mocked.has(frame.id)) return mocked.get(frame.id)();
      server.send(JSON.stringify(frame));
    });
  });

  await page.goto(`${base}/`);
  await page.waitForFunction(() => document.querySelector("#model").options.length >= 2);
  const models = await page.$$eval("#model option", (os) => os.map((o) => o.value));
  const labels = await page.$$eval("#model option", (os) => os.map((o) => o.textContent));
  log("models:", labels);
  const adapter = process.env.EXPECT_ADAPTER;
  if (adapter) {
    assert.ok(labels.includes(`${adapter} (adapter of ${models[0]})`), `the picker offers the adapter ${adapter}`);
  }
  const favicon = await fetch(`${base}/favicon.ico`);
  assert.equal(favicon.status, 200, "/favicon.ico is served");

  // 0. The empty page says what to do, and its examples send.
  assert.ok(await page.locator("#empty").isVisible(), "the empty page shows its hint");
  assert.match(await page.locator("#empty").innerText(), /Enter/);
  await page.screenshot({ path: `${outDir}/playground-empty.png` });
  const assistant = () => page.locator(".turn.assistant").last();
  const userTurn = () => page.locator(".turn.user").last();
  await page.click("#settings summary");
  await page.fill("#max_tokens", "12");
  await page.locator("button.example").first().click();
  await page.waitForFunction(() => [...document.querySelectorAll(".turn.assistant")].pop()?.dataset.done === "true");
  assert.equal(await userTurn().innerText(), await page.locator("button.example").first().innerText());
  assert.ok(!(await page.locator("#empty").isVisible()), "the hint goes once there is a conversation");
  noConsoleErrors("on load and the first answer");

  async function setTransport(t) {
    await page.check(`input[name=transport][value=${t}]`);
  }

  /** Sends a message and records the distinct texts seen while it streams, and whether
   * the message list was scrolled to its bottom at each of them. The page records them
   * itself at each render (a MutationObserver), so that a test process slowed by a busy
   * machine misses none. */
  async function sendAndWatch(text) {
    const before = await page.locator(".turn.assistant").count();
    await page.evaluate((before) => {
      const conv = document.querySelector("#conversation");
      const watch = { seen: [], atBottom: [] };
      window.__watch?.observer.disconnect();
      watch.observer = new MutationObserver(() => {
        const bodies = conv.querySelectorAll(".turn.assistant .body");
        if (bodies.length <= before) return;
        const t = bodies[bodies.length - 1].innerText;
        if (t && !watch.seen.includes(t)) {
          watch.seen.push(t);
          watch.atBottom.push(conv.scrollHeight - conv.scrollTop - conv.clientHeight <= 48);
        }
      });
      watch.observer.observe(conv, { childList: true, subtree: true, characterData: true });
      window.__watch = watch;
    }, before);
    await page.fill("#input", text);
    await page.press("#input", "Enter");
    await page.waitForFunction((n) => document.querySelectorAll(".turn.assistant").length > n, before);
    await page.waitForFunction(() => {
      const turns = document.querySelectorAll(".turn.assistant");
      return turns[turns.length - 1].getAttribute("data-done") === "true";
    }, null, { timeout: 60000 });
    const { seen, atBottom } = await page.evaluate(() => {
      window.__watch.observer.disconnect();
      return { seen: window.__watch.seen, atBottom: window.__watch.atBottom };
    });
    return { seen: new Set(seen), atBottom, final: await assistant().locator(".body").innerText(), stats: await assistant().locator(".stats").innerText() };
  }

  // 1. Streaming over SSE and over WebSocket: text appears in more than one step.
  await page.fill("#max_tokens", "40");
  await page.fill("#temperature", "0");
  for (const t of ["sse", "ws"]) {
    await setTransport(t);
    const r = await sendAndWatch("Tell me three facts about the ocean.");
    log(t, "steps:", r.seen.size, "stats:", r.stats);
    assert.ok(r.final.length > 0, `${t}: an answer`);
    assert.ok(r.seen.size >= 3, `${t}: streamed in more than one step (${r.seen.size})`);
    assert.match(r.stats, /TTFT \d+ ms · [\d.–]+ tok\/s · \d+ tokens · finish: (stop|length)/);
    assert.equal(await assistant().getAttribute("data-transport"), t);
  }

  // 2. Stop during a long answer (the server told to ignore EOS, so that it cannot end on
  //    its own first): generation ends and the server's abort counter rises.
  await page.fill("#max_tokens", "1500");
  net.ignoreEos = true;
  for (const [t, reason] of [["sse", "client_disconnected"], ["ws", "cancelled"]]) {
    await setTransport(t);
    const key = `actorllm:request_aborts_total{model_name="${models[0]}",reason="${reason}"}`;
    const abortsBefore = await metric(key);
    await page.fill("#input", "Write a very long story about a dragon who learns to cook.");
    await page.press("#input", "Enter");
    await page.waitForFunction(() => {
      const a = [...document.querySelectorAll(".turn.assistant .body")].pop();
      return a && a.innerText.length > 20;
    });
    assert.equal(await page.locator("#send").innerText(), "Stop");
    await page.click("#send");
    await page.waitForFunction(() => [...document.querySelectorAll(".turn.assistant")].pop().dataset.done === "true");
    assert.equal(await page.locator("#send").innerText(), "Send");
    assert.match(await assistant().locator(".stats").innerText(), /finish: stopped/);
    await metricReaches(key, abortsBefore + 1);
    await metricReaches(`vllm:num_requests_running{model_name="${models[0]}"}`, 0);
    log(t, "stopped during the answer");
  }

  // 3. Stop before the first token (a long system prompt keeps the server in prefill for
  //    seconds): no empty answer stays, the question is marked and later turns leave it out.
  await page.fill("#system", "You are a helpful assistant. ".repeat(120));
  for (const t of ["sse", "ws"]) {
    await setTransport(t);
    const answers = await page.locator(".turn.assistant").count();
    const question = `Unanswered question over ${t}?`;
    await page.fill("#input", question);
    await page.press("#input", "Enter");
    await page.waitForFunction(() => document.querySelector("#send").innerText === "Stop");
    await page.click("#send");
    await page.waitForFunction(() => document.querySelector("#send").innerText === "Send");
    assert.equal(await page.locator(".turn.assistant").count(), answers, `${t}: no empty answer card`);
    assert.equal(await userTurn().locator(".body").innerText(), question);
    assert.ok(await userTurn().evaluate((e) => e.classList.contains("unanswered")), `${t}: the question is marked`);
    assert.match(await userTurn().locator(".stats").innerText(), /Stopped before an answer/);
    await metricReaches(`vllm:num_requests_running{model_name="${models[0]}"}`, 0);
  }
  await page.fill("#system", "");
  net.ignoreEos = false;
  await page.fill("#max_tokens", "8");
  net.sent = [];
  await sendAndWatch("And now?");
  const carried = net.sent[0].messages.map((m) => m.content);
  log("next request carries", carried.length, "messages");
  assert.ok(!carried.some((c) => c.startsWith("Unanswered question")), "stopped questions are not sent again");
  assert.equal(carried[carried.length - 1], "And now?");
  noConsoleErrors("while stopping");

  // 4. The picker: another entry is used for the next message and shown on the answer.
  await page.selectOption("#model", models[1]);
  for (const t of ["sse", "ws"]) {
    await setTransport(t);
    await sendAndWatch("Hi!");
    assert.equal(await assistant().locator(".who").innerText(), models[1], `${t}: the answer names ${models[1]}`);
  }
  if (adapter) {
    await page.selectOption("#model", adapter);
    await setTransport("ws");
    await sendAndWatch("Hi from the adapter!");
    assert.equal(await assistant().locator(".who").innerText(), adapter, "the adapter answers");
  }
  await page.selectOption("#model", models[0]);
  await setTransport("sse");
  await sendAndWatch("Hi again!");
  assert.equal(await assistant().locator(".who").innerText(), models[0]);
  await page.screenshot({ path: `${outDir}/playground.png`, fullPage: true });

  // 4b. JSON mode and tools: the answer is JSON; a forced tool call shows as a call (name
  //     and arguments), over both transports, and goes back with the next message.
  await page.fill("#max_tokens", "60");
  await page.fill("#temperature", "0");
  await page.check("#json_mode");
  net.sent = [];
  await sendAndWatch("Describe a cat as JSON.");
  assert.deepEqual(net.sent[0].response_format, { type: "json_object" }, "JSON mode asks for a JSON object");
  assert.match(await assistant().locator(".body").innerText(), /^\s*\{/, "the answer is JSON");
  await page.uncheck("#json_mode");
  const weather = [{ type: "function", function: { name: "get_weather", description: "The weather in a city",
    parameters: { type: "object", properties: { city: { type: "string", maxLength: 20 } }, required: ["city"],
      additionalProperties: false } } }];
  await page.fill("#tools", JSON.stringify(weather));
  await page.selectOption("#tool_choice", "required");
  for (const t of ["sse", "ws"]) {
    await setTransport(t);
    await sendAndWatch("What is the weather in Paris?");
    const call = assistant().locator(".tool-call");
    assert.equal(await call.count(), 1, `${t}: one tool call shown`);
    assert.equal(await call.locator(".tool-name").innerText(), "Calls get_weather", `${t}: the call names its tool`);
    const args = JSON.parse(await call.locator(".tool-arguments").innerText());
    assert.equal(typeof args.city, "string", `${t}: the arguments are the function's`);
    assert.ok(!(await assistant().locator(".body").innerText()).includes("get_weather"), `${t}: no raw call text`);
  }
  net.sent = [];
  await page.fill("#tools", "");
  await sendAndWatch("Thanks!");
  const back = net.sent[0].messages.filter((m) => m.tool_calls);
  assert.equal(back.length, 2, "the calls go back with the conversation");
  assert.equal(back[0].tool_calls[0].function.name, "get_weather");
  await page.fill("#tools", "[not json");
  await page.fill("#input", "hello");
  await page.press("#input", "Enter");
  await page.waitForFunction(() => /not valid JSON/.test(document.body.innerText));
  assert.equal(await page.inputValue("#input"), "hello", "a bad tools list keeps the message");
  await page.fill("#tools", "");
  await page.fill("#input", "");
  await setTransport("sse");
  consoleErrors = [];

  // 5. Errors in plain words: a context overflow, then a server that does not answer.
  await page.fill("#max_tokens", "99999");
  await page.fill("#input", "hello");
  const errorsBefore = await page.locator(".turn.error").count();
  await page.press("#input", "Enter");
  await page.waitForFunction((n) => document.querySelectorAll(".turn.error").length > n, errorsBefore);
  const err = await page.locator(".turn.error").last().innerText();
  log("error shown:", err);
  assert.match(err, /maximum context length/);
  net.refuse = true;
  await page.fill("#max_tokens", "8");
  await page.fill("#input", "are you there?");
  await page.press("#input", "Enter");
  await page.waitForFunction((n) => document.querySelectorAll(".turn.error").length > n + 1, errorsBefore);
  assert.match(await page.locator(".turn.error").last().innerText(), /not reachable/);
  net.refuse = false;
  assert.match(await userTurn().locator(".stats").innerText(), /No answer/, "a refused question is marked too");
  consoleErrors = []; // the refused and the failed requests above log as errors, as they should

  // 6. Markdown: headings, lists, a table, highlighted code, emphasis and links; a
  //    javascript: link loses its target.
  net.mock = [
    "# Title", "", "## Section", "", "- one", "- two", "", "1. first", "2. second", "",
    "| a | b |", "|---|---|", "| 1 | 2 |", "",
    "```python", "def f(x):", "    return x  # square", "```", "",
    "Inline `code`, **bold** and [a link](https://example.com) and [bad](javascript:alert(1)).",
  ].join("\n");
  await sendAndWatch("show me markdown");
  const md = assistant().locator(".body");
  assert.equal(await md.locator("h1").innerText(), "Title");
  assert.equal(await md.locator("h2").innerText(), "Section");
  assert.equal(await md.locator("ul > li").count(), 2);
  assert.equal(await md.locator("ol > li").count(), 2);
  assert.deepEqual(await md.locator("table th").allInnerTexts(), ["a", "b"]);
  assert.deepEqual(await md.locator("table td").allInnerTexts(), ["1", "2"]);
  assert.equal(await md.locator("pre code").innerText(), "def f(x):\n    return x  # square");
  assert.equal(await md.locator("pre code .hljs-keyword").first().innerText(), "def", "code is highlighted");
  assert.equal(await md.locator("strong").innerText(), "bold");
  assert.equal(await md.locator("p code").innerText(), "code");
  const link = md.locator("a", { hasText: "a link" });
  assert.equal(await link.getAttribute("href"), "https://example.com");
  assert.equal(await link.getAttribute("rel"), "noopener noreferrer");
  const bad = await md.locator("a", { hasText: "bad" }).getAttribute("href");
  assert.ok(!bad || !bad.startsWith("javascript:"), `javascript: link neutralised (${bad})`);

  // 7. Model output with HTML is shown as text; code blocks stay preformatted text.
  net.mock = "Here: <script>window.__xss = 1</script> and <img src=x onerror=\"window.__xss = 2\">\n```html\n<b>bold?</b>\n```\nend";
  await sendAndWatch("show me html");
  assert.equal(await page.evaluate(() => window.__xss), undefined, "no script from model output ran");
  assert.equal(await assistant().locator("img").count(), 0, "no element made from model output");
  assert.equal(await assistant().locator("script").count(), 0);
  assert.equal(await assistant().locator("b").count(), 0);
  assert.match(await assistant().locator(".body").innerText(), /<script>window.__xss = 1<\/script>/);
  assert.equal(await assistant().locator("pre code").innerText(), "<b>bold?</b>");

  // 8. A conversation taller than the window: the page itself never scrolls, the composer
  //    and Stop stay in view, and the message list follows a streaming answer unless the
  //    reader scrolled up. (Answers mocked: the model's prefill of so long a conversation
  //    would take the CPU seconds.)
  net.mock = Array.from({ length: 40 }, (_, i) => `Line ${i + 1} of a long mocked answer.\n`).join("\n");
  for (let i = 0; i < 3; i++) await sendAndWatch(`long answer ${i}`);
  const layout = () => page.evaluate(() => {
    const box = (id) => document.getElementById(id).getBoundingClientRect();
    const c = document.getElementById("conversation");
    return {
      pageScrolls: document.scrollingElement.scrollHeight > window.innerHeight + 1,
      listScrolls: c.scrollHeight > c.clientHeight,
      inputVisible: box("input").bottom <= window.innerHeight && box("input").top >= 0,
      sendVisible: box("send").bottom <= window.innerHeight && box("send").top >= 0,
    };
  });
  assert.deepEqual(await layout(), { pageScrolls: false, listScrolls: true, inputVisible: true, sendVisible: true });
  await setTransport("ws");
  const r = await sendAndWatch("A streamed answer, line by line.");
  log("long conversation: stream seen at", r.atBottom.length, "points");
  assert.ok(r.atBottom.length >= 10 && r.atBottom.every(Boolean), `the list follows the stream (${r.atBottom})`);
  assert.deepEqual(await layout(), { pageScrolls: false, listScrolls: true, inputVisible: true, sendVisible: true });
  await page.screenshot({ path: `${outDir}/playground-long.png` });
  // A reader who scrolls up mid-stream is left there; Stop is in view and works.
  net.mock = Array.from({ length: 400 }, (_, i) => `Slow line ${i + 1}.\n`).join("\n");
  net.mockDelay = 25;
  await page.fill("#input", "Once more, slowly.");
  await page.press("#input", "Enter");
  await page.waitForFunction(() => ([...document.querySelectorAll(".turn.assistant .body")].pop()?.innerText.length || 0) > 10);
  await page.$eval("#conversation", (c) => { c.scrollTop = 0; });
  for (let i = 0; i < 20; i++) {
    await page.waitForTimeout(25);
    assert.equal(await page.$eval("#conversation", (c) => c.scrollTop), 0, "the view stays where the reader put it");
  }
  assert.ok((await layout()).sendVisible, "Stop is in view");
  await page.click("#send");
  await page.waitForFunction(() => [...document.querySelectorAll(".turn.assistant")].pop().dataset.done === "true");
  assert.match(await assistant().locator(".stats").innerText(), /finish: stopped/);
  net.mock = null;
  net.mockDelay = 10;
  await setTransport("sse");

  // 9. Light and dark themes: the picker switches, the choice survives a reload, and Auto
  //    follows the system's scheme.
  const background = () => page.evaluate(() => getComputedStyle(document.body).backgroundColor);
  const dark = (rgb) => rgb.match(/\d+/g).slice(0, 3).map(Number).reduce((a, b) => a + b) < 3 * 96;
  await page.selectOption("#theme", "dark");
  assert.ok(dark(await background()), `dark theme (${await background()})`);
  await page.screenshot({ path: `${outDir}/playground-dark.png` });
  await page.selectOption("#theme", "light");
  assert.ok(!dark(await background()), "light theme");
  await page.selectOption("#theme", "dark");

  // 10. The conversation and the theme survive a reload; Clear empties the conversation.
  const turnsBefore = await page.locator(".turn").count();
  await page.reload();
  await page.waitForFunction(() => document.querySelector("#model").options.length >= 2);
  assert.equal(await page.locator(".turn").count(), turnsBefore, "conversation kept in localStorage");
  assert.equal(await page.locator(".turn.user.unanswered").count(), 4, "unanswered questions stay marked");
  assert.equal(await page.evaluate(() => window.__xss), undefined, "stored output stays inert after reload");
  assert.ok(dark(await background()), "the theme is kept");
  await page.selectOption("#theme", "auto");
  await page.emulateMedia({ colorScheme: "dark" });
  assert.ok(dark(await background()), "Auto follows a dark system");
  await page.emulateMedia({ colorScheme: "light" });
  assert.ok(!dark(await background()), "Auto follows a light system");

  // 11. Phone width: nothing overflows sideways.
  await page.setViewportSize({ width: 390, height: 800 });
  const overflow = await page.evaluate(() => document.documentElement.scrollWidth - window.innerWidth);
  assert.ok(overflow <= 0, `no horizontal overflow on a phone (${overflow}px)`);
  assert.deepEqual((await layout()).inputVisible, true, "the composer is in view on a phone");
  await page.screenshot({ path: `${outDir}/playground-phone.png` });
  await page.click("#clear");
  assert.equal(await page.locator(".turn").count(), 0);
  assert.ok(await page.locator("#empty").isVisible(), "the hint is back");
  await page.reload();
  assert.equal(await page.locator(".turn").count(), 0, "cleared for good");
  noConsoleErrors("through the end");
  log("all checks passed");
} catch (e) {
  console.error("[browser] FAILED:", e);
  failed = true;
} finally {
  await browser.close();
}
process.exit(failed ? 1 : 0);
