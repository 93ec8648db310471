// Pages of other origins against the server, in headless Debian chromium (playwright-core).
// Usage: node cross_origin.mjs BASE_URL ALLOWED_ORIGIN
// The server must list ALLOWED_ORIGIN in --allowed-origins. A page of that origin opens the
// WebSocket and reads a completion; a page of any other origin can do neither, and its
// requests never reach the engine. Exits non-zero on failure.

import assert from "node:assert/strict";
import { chromium } from "playwright-core";

const [base, allowed] = process.argv.slice(2);
const log = (...a) => console.log("[cross-origin]", ...a);

async function prompts() {
  const text = await (await fetch(`${base}/metrics`)).text();
  const line = text.split("\n").find((l) => l.startsWith("vllm:prompt_tokens_total"));
  assert.ok(line, "vllm:prompt_tokens_total present");
  return Number(line.split(" ").pop());
}

const browser = await chromium.launch({
  executablePath: process.env.CHROMIUM || "/usr/bin/chromium",
  args: ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
    "--disable-component-update", "--disable-sync",
    // Chromium's own guard against public pages calling loopback would refuse every page
    // here, the listed one too: off, so that what is refused is refused by the server.
    "--disable-features=LocalNetworkAccessChecks,BlockInsecurePrivateNetworkRequests,PrivateNetworkAccessSendPreflights,PrivateNetworkAccessRespectPreflightResults"],
});
let failed = false;
try {
  // What a page of `origin` manages: the WebSocket opened or not, and the status of a JSON
  // completion request (or "blocked" when the browser refused to hand over the answer).
  async function tryFrom(origin) {
    const page = await browser.newPage();
    await page.route(`${origin}/`, (r) => r.fulfill({ status: 200, contentType: "text/html", body: "<title>page</title>" }));
    await page.goto(`${origin}/`);
    const got = await page.evaluate(async (base) => {
      const ws = await new Promise((res) => {
        const w = new WebSocket(base.replace(/^http/, "ws") + "/v1/ws");
        w.onopen = () => { w.close(); res("open"); };
        w.onerror = () => res("refused");
      });
      let json;
      try {
        const r = await fetch(`${base}/v1/completions`, {
          method: "POST", headers: { "content-type": "application/json" },
          body: JSON.stringify({ prompt: "Hi", max_tokens: 2, temperature: 0 }),
        });
        json = r.status;
      } catch { json = "blocked"; }
      // A "simple" request needs no preflight: the browser sends it whatever the answer.
      await fetch(`${base}/v1/completions`, { method: "POST", mode: "no-cors", headers: { "content-type": "text/plain" },
        body: JSON.stringify({ prompt: "Hi", max_tokens: 2 }) }).catch(() => {});
      return { ws, json };
    }, base);
    await page.close();
    return got;
  }

  const before = await prompts();
  const evil = await tryFrom("http://evil.example");
  log("other origin:", JSON.stringify(evil));
  assert.deepEqual(evil, { ws: "refused", json: "blocked" }, "a page of another origin gets nothing");
  assert.equal(await prompts(), before, "no request from the other origin reached the engine");

  const friend = await tryFrom(allowed);
  log("listed origin:", JSON.stringify(friend));
  assert.deepEqual(friend, { ws: "open", json: 200 }, "a page of a listed origin uses the server");
  assert.ok(await prompts() > before, "the listed origin's requests ran");
  log("all checks passed");
} catch (e) {
  failed = true;
  console.error(e);
} finally {
  await browser.close();
}
process.exit(failed ? 1 : 0);
