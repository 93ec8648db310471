// Safe rendering of model output: text becomes text nodes (never HTML), fenced code
// blocks (```lang ... ```) become <pre><code> with textContent. Model output containing
// <script> or <img onerror> is therefore shown as the characters it is.

/** Splits text into [{kind: "text"|"code", body, lang}] on ``` fences (an unclosed fence
 * while streaming still renders as code). */
export function splitFences(text) {
  const parts = [];
  let rest = text;
  while (rest.length > 0) {
    const open = rest.indexOf("```");
    if (open < 0) {
      parts.push({ kind: "text", body: rest });
      break;
    }
    if (open > 0) parts.push({ kind: "text", body: rest.slice(0, open) });
    const afterOpen = rest.slice(open + 3);
    const nl = afterOpen.indexOf("\n");
    const lang = nl >= 0 ? afterOpen.slice(0, nl).trim() : "";
    const bodyStart = nl >= 0 ? nl + 1 : afterOpen.length;
    const close = afterOpen.indexOf("```", bodyStart);
    if (close < 0) {
      parts.push({ kind: "code", body: afterOpen.slice(bodyStart), lang });
      break;
    }
    parts.push({ kind: "code", body: afterOpen.slice(bodyStart, close).replace(/\n$/, ""), lang });
    rest = afterOpen.slice(close + 3);
  }
  return parts;
}

/** Replaces the children of `el` with the safe rendering of `text`. */
export function renderText(el, text) {
  const frag = document.createDocumentFragment();
  for (const part of splitFences(text)) {
    if (part.kind === "code") {
      const pre = document.createElement("pre");
      const code = document.createElement("code");
      if (part.lang) code.dataset.lang = part.lang;
      code.textContent = part.body;
      pre.appendChild(code);
      frag.appendChild(pre);
    } else {
      const span = document.createElement("span");
      span.className = "text";
      span.textContent = part.body;
      frag.appendChild(span);
    }
  }
  el.replaceChildren(frag);
}
