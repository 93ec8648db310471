//! The browser playground (static/), embedded in the binary so that the server needs no
//! files beside it: the page, its script and style, the icon, and the vendored libraries
//! it renders answers with (static/vendor/, see scripts/vendor_static.sh).

use actix_web::{HttpResponse, web};

use super::errors::ApiError;

const JS: &str = "text/javascript; charset=utf-8";
const SVG: &str = "image/svg+xml";

/// Every file under `/static/`: (path below it, contents, content type). Requests name a
/// file of this table or get a 404; no path reaches the file system.
const FILES: [(&str, &str, &str); 8] = [
    ("app.js", include_str!("../../static/app.js"), JS),
    ("render.js", include_str!("../../static/render.js"), JS),
    ("style.css", include_str!("../../static/style.css"), "text/css; charset=utf-8"),
    ("favicon.svg", FAVICON, SVG),
    ("vendor/marked.esm.js", include_str!("../../static/vendor/marked.esm.js"), JS),
    ("vendor/purify.es.mjs", include_str!("../../static/vendor/purify.es.mjs"), JS),
    ("vendor/highlight.min.js", include_str!("../../static/vendor/highlight.min.js"), JS),
    ("vendor/VERSIONS", include_str!("../../static/vendor/VERSIONS"), "text/plain; charset=utf-8"),
];
const INDEX: &str = include_str!("../../static/index.html");
const FAVICON: &str = include_str!("../../static/favicon.svg");

fn asset(body: &'static str, content_type: &str) -> HttpResponse {
    HttpResponse::Ok().content_type(content_type).insert_header(("Cache-Control", "no-cache")).body(body)
}

pub async fn index() -> HttpResponse {
    asset(INDEX, "text/html; charset=utf-8")
}

/// `/favicon.ico`, which browsers and tools ask for whatever the page links.
pub async fn favicon() -> HttpResponse {
    asset(FAVICON, SVG)
}

pub async fn file(path: web::Path<String>) -> Result<HttpResponse, ApiError> {
    FILES
        .iter()
        .find(|(name, ..)| *name == path.as_str())
        .map(|&(_, body, content_type)| asset(body, content_type))
        .ok_or_else(|| ApiError::NotFound(format!("no static file {}", path.as_str())))
}
