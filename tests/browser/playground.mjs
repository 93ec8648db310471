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

const browser = await chromium.launch({
  executablePath: process.env.CHROMIUM || "/usr/bin/chromium",
  args: ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
    "--disable-component-update", "--disable-sync"],
});
let failed = false;
try {
  const page = await browser.newPage({ viewport: { width: 1100, height: 800 } });
  page.on("pageerror", (e) => { log("page error:", e.message); failed = true; });
  await page.goto(`${base}/`);
  await page.waitForFunction(() => document.querySelector("#model").options.length >= 2);
  const models = await page.$$eval("#model option", (os) => os.map((o) => o.value));
  const labels = await page.$$eval("#model option", (os) => os.map((o) => o.textContent));
  log("models:", labels);
  const adapter = process.env.EXPECT_ADAPTER;
  if (adapter) {
    assert.ok(labels.includes(`${adapter} (adapter of ${models[0]})`), `the picker offers the adapter ${adapter}`);
  }

  const assistant = () => page.locator(".turn.assistant").last();

  async function setTransport(t) {
    await page.check(`input[name=transport][value=${t}]`);
  }

  /** Sends a message and records the distinct texts seen while it streams. */
  async function sendAndWatch(text) {
    const before = await page.locator(".turn.assistant").count();
    await page.fill("#input", text);
    await page.press("#input", "Enter");
    await page.waitForFunction((n) => document.querySelectorAll(".turn.assistant").length > n, before);
    const seen = new Set();
    for (let i = 0; i < 3000; i++) {
      const t = await assistant().locator(".body").innerText();
      if (t) seen.add(t);
      if ((await assistant().getAttribute("data-done")) === "true") break;
      await page.waitForTimeout(5);
    }
    return { seen, final: await assistant().locator(".body").innerText(), stats: await assistant().locator(".stats").innerText() };
  }

  // 1. Streaming over SSE and over WebSocket: text appears in more than one step.
  await page.click("#settings summary");
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

  // 2. Stop during a long answer: generation ends and the server's abort counter rises.
  await page.fill("#max_tokens", "1500");
  await page.fill("#temperature", "0.8");
  for (const [t, reason] of [["sse", "client_disconnected"], ["ws", "cancelled"]]) {
    await setTransport(t);
    const key = `actorllm:request_aborts_total{model_name="${models[0]}",reason="${reason}"}`;
    const abortsBefore = await metric(key);
    await page.fill("#input", "Write a very long story about a dragon who learns to cook. Make it at least two thousand words.");
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
    let after = abortsBefore;
    for (let i = 0; i < 50 && after <= abortsBefore; i++) {
      await page.waitForTimeout(100);
      after = await metric(key);
    }
    log(t, "stop: aborts", abortsBefore, "->", after);
    assert.ok(after > abortsBefore, `${t}: the server counted the abort (${reason})`);
    assert.equal(await metric(`vllm:num_requests_running{model_name="${models[0]}"}`), 0, "nothing left running");
  }

  // 3. The picker: another entry is used for the next message and shown on the answer.
  await page.fill("#max_tokens", "8");
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

  // 4. Errors in plain words: a context overflow, then a server that does not answer.
  await page.fill("#max_tokens", "99999");
  await page.fill("#input", "hello");
  await page.press("#input", "Enter");
  await page.waitForSelector(".turn.error");
  const err = await page.locator(".turn.error").last().innerText();
  log("error shown:", err);
  assert.match(err, /maximum context length/);
  await page.route("**/v1/chat/completions", (route) => route.abort("connectionrefused"));
  await page.fill("#max_tokens", "8");
  await page.fill("#input", "are you there?");
  await page.press("#input", "Enter");
  await page.waitForFunction(() => document.querySelectorAll(".turn.error").length >= 2);
  assert.match(await page.locator(".turn.error").last().innerText(), /not reachable/);
  await page.unroute("**/v1/chat/completions");

  // 5. Model output with HTML is shown as text; code blocks stay preformatted.
  const evil = "Here: <script>window.__xss = 1</script> and <img src=x onerror=\"window.__xss = 2\">\n```html\n<b>bold?</b>\n```\nend";
  const chunk = (o) => `data: ${JSON.stringify(o)}\n\n`;
  const body = chunk({ id: "x", object: "chat.completion.chunk", model: models[0], choices: [{ index: 0, delta: { role: "assistant", content: "" } }] })
    + [...evil].map((c) => chunk({ id: "x", object: "chat.completion.chunk", model: models[0], choices: [{ index: 0, delta: { content: c } }] })).join("")
    + chunk({ id: "x", object: "chat.completion.chunk", model: models[0], choices: [{ index: 0, delta: {}, finish_reason: "stop" }] })
    + "data: [DONE]\n\n";
  await page.route("**/v1/chat/completions", (route) => route.fulfill({ status: 200, contentType: "text/event-stream", body }));
  await setTransport("sse");
  await sendAndWatch("show me html");
  await page.unroute("**/v1/chat/completions");
  assert.equal(await page.evaluate(() => window.__xss), undefined, "no script from model output ran");
  assert.equal(await assistant().locator("img").count(), 0, "no element made from model output");
  assert.equal(await assistant().locator("script").count(), 0);
  assert.match(await assistant().locator(".body").innerText(), /<script>window.__xss = 1<\/script>/);
  assert.equal(await assistant().locator("pre code").innerText(), "<b>bold?</b>");

  // 6. The conversation survives a reload; Clear empties it.
  const turnsBefore = await page.locator(".turn").count();
  await page.reload();
  await page.waitForFunction(() => document.querySelector("#model").options.length >= 2);
  assert.equal(await page.locator(".turn").count(), turnsBefore, "conversation kept in localStorage");
  assert.equal(await page.evaluate(() => window.__xss), undefined, "stored output stays inert after reload");

  // 7. Phone width: nothing overflows sideways.
  await page.setViewportSize({ width: 390, height: 800 });
  const overflow = await page.evaluate(() => document.documentElement.scrollWidth - window.innerWidth);
  assert.ok(overflow <= 0, `no horizontal overflow on a phone (${overflow}px)`);
  await page.screenshot({ path: `${outDir}/playground-phone.png` });
  await page.click("#clear");
  assert.equal(await page.locator(".turn").count(), 0);
  await page.reload();
  assert.equal(await page.locator(".turn").count(), 0, "cleared for good");
  assert.ok(!failed, "no uncaught page errors");
  log("all checks passed");
} catch (e) {
  console.error("[browser] FAILED:", e);
  failed = true;
} finally {
  await browser.close();
}
process.exit(failed ? 1 : 0);
