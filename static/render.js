// Rendering of model output as Markdown (headings, lists, tables, code with highlighting).
// Model output is untrusted: marked turns it into HTML with any raw HTML the model wrote
// escaped (shown as the characters it is, never as markup), DOMPurify then removes
// whatever could still act (scripts, event handlers, javascript: links), and highlight.js
// colours code from its text. The libraries are vendored in static/vendor/
// (scripts/vendor_static.sh); nothing is fetched from elsewhere.

import { Marked } from "./vendor/marked.esm.js";
import DOMPurify from "./vendor/purify.es.mjs";
import hljs from "./vendor/highlight.min.js";

const ESCAPES = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };
const escapeHtml = (s) => s.replace(/[&<>"']/g, (c) => ESCAPES[c]);

const markdown = new Marked({
  gfm: true,
  // Chat models end lines with single newlines and mean them.
  breaks: true,
  renderer: {
    html({ text }) {
      return escapeHtml(text);
    },
  },
});

// Links the model writes open in a new tab and give the page no handle on it.
DOMPurify.addHook("afterSanitizeAttributes", (node) => {
  if (node.tagName === "A") {
    node.setAttribute("target", "_blank");
    node.setAttribute("rel", "noopener noreferrer");
  }
});

/** The sanitised HTML of `text` read as Markdown. */
export function markdownHtml(text) {
  return DOMPurify.sanitize(markdown.parse(text), { USE_PROFILES: { html: true } });
}

/** Colours a code element from its text (its `language-x` class, else a guess). */
function highlight(code) {
  const lang = [...code.classList].find((c) => c.startsWith("language-"))?.slice(9);
  // marked ends a block's text with its closing newline; the block ends with its last line.
  const text = code.textContent.replace(/\n$/, "");
  const result = lang && hljs.getLanguage(lang) ? hljs.highlight(text, { language: lang }) : hljs.highlightAuto(text);
  // highlight.js escapes the text it wraps in its spans.
  code.innerHTML = result.value;
  code.classList.add("hljs");
}

/** Replaces the children of `el` with the rendering of `text`. */
export function renderMarkdown(el, text) {
  el.innerHTML = markdownHtml(text);
  for (const code of el.querySelectorAll("pre code")) highlight(code);
}
