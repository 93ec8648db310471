#!/usr/bin/env bash
# Copies the playground's third-party libraries from the npm registry into static/vendor/
# (committed: the server embeds static/ in its binary and fetches nothing at run time):
# marked (Markdown to HTML), DOMPurify (sanitises that HTML) and highlight.js (code
# highlighting, its common languages), each as an ES module with its licence. Run it to
# move to other versions; the versions are pinned here.
set -euo pipefail
cd "$(dirname "$0")/.."
MARKED=marked@18.3.0
DOMPURIFY=dompurify@3.5.0
HLJS=@highlightjs/cdn-assets@11.11.1
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
(cd "$tmp" && npm pack --silent "$MARKED" "$DOMPURIFY" "$HLJS" >/dev/null)
for t in "$tmp"/*.tgz; do
  mkdir -p "${t%.tgz}" && tar xzf "$t" -C "${t%.tgz}"
done
out=static/vendor
rm -rf "$out" && mkdir -p "$out"
# Source-map comments name files that are not shipped.
copy() { grep -v '^//# sourceMappingURL=' "$1" > "$2"; }
copy "$tmp"/marked-*/package/lib/marked.esm.js "$out/marked.esm.js"
cp "$tmp"/marked-*/package/LICENSE "$out/marked.LICENSE"
copy "$tmp"/dompurify-*/package/dist/purify.es.mjs "$out/purify.es.mjs"
cp "$tmp"/dompurify-*/package/LICENSE "$out/purify.LICENSE"
copy "$tmp"/highlightjs-cdn-assets-*/package/es/highlight.min.js "$out/highlight.min.js"
cp "$tmp"/highlightjs-cdn-assets-*/package/LICENSE "$out/highlight.LICENSE"
printf '%s\n' "$MARKED" "$DOMPURIFY" "$HLJS" > "$out/VERSIONS"
ls -l "$out"
