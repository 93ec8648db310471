// The playground in front of a server started with --api-key, in headless Debian chromium.
// Usage: node api_key.mjs BASE_URL KEY
// Without a key and with a wrong one the page says so and points at Settings; with the
// right one the model list loads and answers stream over SSE and the WebSocket; the key
// lives in sessionStorage, never in localStorage. Exits non-zero on failure.

import assert from "node:assert/strict";
import { chromium } from "playwright-core";

const [base, key] = process.argv.slice(2);
const log = (...a) => console.log("[api-key]", ...a);

const browser = await chromium.launch({
  executablePath: process.env.CHROMIUM || "/usr/bin/chromium",
  args: ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
    "--disable-component-update", "--disable-sync"],
});
let failed = false;
try {
  const page = await browser.newPage({ viewport: { width: 1100, height: 800 } });
  const lastError = () => page.locator(".turn.error").last().textContent();
  await page.goto(base);
  await page.locator(".turn.error").first().waitFor();
  assert.match(await lastError(), /needs an API key: enter it under Settings/);
  assert.equal(await page.locator("#settings").evaluate((d) => d.open), true, "Settings opened");

  await page.fill("#api_key", "wrong");
  await page.locator("#api_key").dispatchEvent("change");
  await page.waitForFunction(() => document.querySelectorAll(".turn.error").length >= 2);
  assert.match(await lastError(), /refused the API key/);

  await page.fill("#api_key", key);
  await page.locator("#api_key").dispatchEvent("change");
  await page.waitForFunction(() => document.querySelector("#model").options.length > 0);
  // Greedy, so that the tiny model's answer is the same every run (sampled, its first
  // token could be the end of the turn and leave the answer empty).
  await page.fill("#temperature", "0");
  for (const transport of ["sse", "ws"]) {
    await page.check(`input[name="transport"][value="${transport}"]`);
    const before = await page.locator('.turn.assistant[data-done="true"]').count();
    await page.fill("#input", "Say hi.");
    await page.press("#input", "Enter");
    await page.waitForFunction((n) => document.querySelectorAll('.turn.assistant[data-done="true"]').length > n, before);
    const answer = page.locator(".turn.assistant").last();
    assert.ok((await answer.locator(".body").textContent()).trim().length > 0, `${transport}: an answer`);
    assert.match(await answer.locator(".stats").textContent(), /finish: (stop|length)/, `${transport}: finished`);
    log(transport, "answered");
  }
  const stored = await page.evaluate(() => [sessionStorage.getItem("actorllm.api_key"), JSON.stringify(localStorage)]);
  assert.equal(stored[0], key, "the key is in sessionStorage");
  assert.ok(!stored[1].includes(key), "and nowhere in localStorage");
  log("all checks passed");
} catch (e) {
  failed = true;
  console.error(e);
} finally {
  await browser.close();
}
process.exit(failed ? 1 : 0);
