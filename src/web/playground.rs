//! The browser playground (static/), embedded in the binary so that the server needs no
//! files beside it.

use actix_web::{HttpResponse, web};

use super::errors::ApiError;

const INDEX: &str = include_str!("../../static/index.html");
const APP_JS: &str = include_str!("../../static/app.js");
const RENDER_JS: &str = include_str!("../../static/render.js");
const STYLE: &str = include_str!("../../static/style.css");

fn asset(body: &'static str, content_type: &str) -> HttpResponse {
    HttpResponse::Ok().content_type(content_type).insert_header(("Cache-Control", "no-cache")).body(body)
}

pub async fn index() -> HttpResponse {
    asset(INDEX, "text/html; charset=utf-8")
}

pub async fn file(name: web::Path<String>) -> Result<HttpResponse, ApiError> {
    match name.as_str() {
        "app.js" => Ok(asset(APP_JS, "text/javascript; charset=utf-8")),
        "render.js" => Ok(asset(RENDER_JS, "text/javascript; charset=utf-8")),
        "style.css" => Ok(asset(STYLE, "text/css; charset=utf-8")),
        other => Err(ApiError::NotFound(format!("no static file {other}"))),
    }
}
