//! Operations routes and middleware: `/health`, `/metrics` (Prometheus text), API-key
//! checking and one structured log line per request.

use std::time::{Duration, Instant};

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use actix_web::body::{BodySize, BoxBody, MessageBody};
use actix_web::dev::{ServiceRequest, ServiceResponse};
use actix_web::http::header;
use actix_web::middleware::Next;
use actix_web::web::Bytes;
use actix_web::{HttpResponse, ResponseError, web};

use super::AppState;
use super::errors::ApiError;
use crate::actors::lora_manager::GetLoraStats;

/// 200 while the step loop answers, no step has run longer than
/// `--engine-iteration-timeout` and no node of the tensor-parallel group is lost, else 503.
pub async fn health(state: web::Data<AppState>) -> HttpResponse {
    if !state.serving() {
        return ApiError::Unavailable("the server is shutting down".into()).error_response();
    }
    if let Some(why) = state.engine.failure() {
        return ApiError::Unavailable(format!("the engine has failed: {why}")).error_response();
    }
    let stuck = state.timeouts.engine_iteration;
    let stats = actix_rt::time::timeout(Duration::from_secs(2), state.engine.stats()).await;
    match stats {
        Ok(Ok((s, _))) if !(s.busy && s.last_step.is_some_and(|t| t.elapsed() > stuck)) => {
            HttpResponse::Ok().finish()
        }
        Ok(Ok(_)) => ApiError::Unavailable("the engine's step loop is stuck".into()).error_response(),
        _ => ApiError::Unavailable("the engine is not responding".into()).error_response(),
    }
}

pub async fn metrics(state: web::Data<AppState>) -> Result<HttpResponse, ApiError> {
    let (s, b) = state.engine.stats().await?;
    let model_name = state.served_model_names.first().map_or("", String::as_str);
    let model = crate::metrics::label(model_name);
    let mut out = String::new();
    let gauge = |out: &mut String, name: &str, help: &str, v: f64| {
        out.push_str(&format!(
            "# HELP {name} {help}\n# TYPE {name} gauge\n{name}{{model_name=\"{model}\"}} {v}\n"
        ));
    };
    gauge(&mut out, "vllm:num_requests_running", "Sequences in the running batch.", s.num_running as f64);
    gauge(&mut out, "vllm:num_requests_waiting", "Sequences waiting to be scheduled.", s.num_waiting as f64);
    let usage = b.usage();
    gauge(&mut out, "vllm:kv_cache_usage_perc", "Fraction of KV cache blocks in use (0 to 1).", usage);
    gauge(&mut out, "actorllm:kv_cache_blocks_total", "KV cache blocks in the pool.", b.num_total as f64);
    gauge(&mut out, "actorllm:kv_cache_blocks_free", "KV cache blocks free.", b.num_free as f64);
    gauge(
        &mut out,
        "actorllm:lora_slots_used",
        "Adapter slots holding an adapter.",
        s.lora_slots_used as f64,
    );
    if let Some(m) = state.engine.lora_manager() {
        let l =
            m.send(GetLoraStats).await.map_err(|_| ApiError::Unavailable("LoRA manager stopped".into()))?;
        gauge(
            &mut out,
            "actorllm:lora_adapters_registered",
            "LoRA adapters registered.",
            l.registered as f64,
        );
        gauge(
            &mut out,
            "actorllm:lora_adapters_loaded",
            "LoRA adapters loaded in host memory.",
            l.loaded as f64,
        );
        // vLLM's info gauge, read by the Gateway API Inference Extension's endpoint picker:
        // one series whose labels name the adapters of the running and waiting requests and
        // the adapter slots, valued at the time of the reading.
        let names = |ids: &[u64]| {
            let names: Vec<&str> = ids.iter().filter_map(|id| l.names.get(id).map(String::as_str)).collect();
            crate::metrics::label(&names.join(","))
        };
        let max_lora = state.engine.config().lora.as_ref().map_or(0, |c| c.max_loras);
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        out.push_str(&format!(
            "# HELP vllm:lora_requests_info Running stats on lora requests.\n# TYPE vllm:lora_requests_info gauge\n\
             vllm:lora_requests_info{{max_lora=\"{max_lora}\",waiting_lora_adapters=\"{}\",running_lora_adapters=\"{}\"}} {}\n",
            names(&s.waiting_loras),
            names(&s.running_loras),
            now.as_secs_f64()
        ));
        out.push_str("# HELP actorllm:lora_requests_total Requests per LoRA adapter.\n# TYPE actorllm:lora_requests_total counter\n");
        for (name, n) in &l.requests {
            out.push_str(&format!(
                "actorllm:lora_requests_total{{model_name=\"{model}\",lora_name=\"{}\"}} {n}\n",
                crate::metrics::label(name)
            ));
        }
    }
    state.engine.metrics().render(model_name, &mut out);
    Ok(HttpResponse::Ok().content_type("text/plain; version=0.0.4").body(out))
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Routes open without a key: health and the playground's page, icon and static files.
fn is_public(path: &str) -> bool {
    matches!(path, "/health" | "/" | "/favicon.ico") || path.starts_with("/static/")
}

fn authorized(req: &ServiceRequest, key: &str) -> bool {
    let header = req.headers().get("authorization").and_then(|h| h.to_str().ok());
    if let Some(token) = header.and_then(|h| h.strip_prefix("Bearer ")) {
        return constant_time_eq(token.as_bytes(), key.as_bytes());
    }
    // Browsers cannot set headers on a WebSocket handshake: /v1/ws also takes ?api_key=.
    if req.path() == "/v1/ws" {
        let q = web::Query::<std::collections::HashMap<String, String>>::from_query(req.query_string());
        if let Some(k) = q.ok().and_then(|q| q.get("api_key").cloned()) {
            return constant_time_eq(k.as_bytes(), key.as_bytes());
        }
    }
    false
}

/// Checks the request's Host and Origin (answering CORS preflights) and the API key (when
/// configured), then logs each request once its response has been sent in full (a
/// stream's line comes when it ends, with its whole duration).
pub async fn auth_and_log(
    req: ServiceRequest,
    next: Next<impl MessageBody + 'static>,
) -> Result<ServiceResponse<impl MessageBody>, actix_web::Error> {
    let start = Instant::now();
    let (method, path) = (req.method().to_string(), req.path().to_string());
    let state = req.app_data::<web::Data<AppState>>().cloned();
    let origin = req.headers().get(header::ORIGIN).and_then(|o| o.to_str().ok()).map(str::to_string);
    let refused = |req: ServiceRequest, e: ApiError| {
        tracing::info!(%method, %path, status = e.status_code().as_u16(), "request refused: {e}");
        req.into_response(e.error_response())
    };
    let mut res = match state.as_ref().map(|s| s.access.admit(&req)) {
        Some(Err(e)) => refused(req, e),
        Some(Ok(Some(preflight))) => req.into_response(preflight),
        _ => match state.as_ref().and_then(|s| s.api_key.as_deref()) {
            Some(key) if !is_public(&path) && !authorized(&req, key) => refused(req, ApiError::Unauthorized),
            _ => {
                let mut req = req;
                if let Some(s) = &state
                    && !req.headers().contains_key(header::UPGRADE)
                {
                    let body = actix_web::HttpMessage::take_payload(&mut req);
                    let payload = Box::pin(BodyDeadline::new(body, s.timeouts.body));
                    req.set_payload(actix_web::dev::Payload::Stream { payload });
                }
                next.call(req).await?.map_into_boxed_body()
            }
        },
    };
    if let (Some(origin), Some(state)) = (&origin, &state)
        && res.status() != actix_web::http::StatusCode::FORBIDDEN
    {
        state.access.decorate(origin, res.headers_mut());
    }
    let request_id =
        res.headers().get("x-request-id").and_then(|v| v.to_str().ok()).unwrap_or("-").to_string();
    let line = HttpLine {
        enabled: state.as_ref().is_none_or(|s| s.access_log),
        method: method.clone(),
        path: path.clone(),
        status: res.status().as_u16(),
        request_id,
        start,
        bytes: 0,
    };
    Ok(res.map_body(move |_, body| LoggedBody { body, line }))
}

/// A request body that fails with a timeout when it has not arrived in full within
/// `--request-body-timeout`, so that a client that stops sending does not hold its
/// handler forever.
struct BodyDeadline {
    body: actix_web::dev::Payload,
    limit: Duration,
    deadline: Pin<Box<actix_rt::time::Sleep>>,
}

impl BodyDeadline {
    fn new(body: actix_web::dev::Payload, limit: Duration) -> Self {
        Self { body, limit, deadline: Box::pin(actix_rt::time::sleep(limit)) }
    }
}

impl futures::Stream for BodyDeadline {
    type Item = Result<Bytes, actix_web::error::PayloadError>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        if let Poll::Ready(item) = Pin::new(&mut self.body).poll_next(cx) {
            return Poll::Ready(item);
        }
        match self.deadline.as_mut().poll(cx) {
            Poll::Ready(()) => {
                Poll::Ready(Some(Err(actix_web::error::PayloadError::Io(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!("the request body did not arrive within {} s", self.limit.as_secs_f64()),
                )))))
            }
            Poll::Pending => Poll::Pending,
        }
    }
}

/// `--root-path`: a request under the prefix is routed as the same request without it
/// (a proxy that passes the prefix on), and the prefix alone is redirected to the
/// playground at `<prefix>/`, whose relative links then stay under it.
pub async fn root_path(
    mut req: ServiceRequest,
    next: Next<impl MessageBody + 'static>,
) -> Result<ServiceResponse<impl MessageBody>, actix_web::Error> {
    let root = req.app_data::<web::Data<AppState>>().map(|s| s.root_path.clone()).unwrap_or_default();
    if !root.is_empty() {
        let path = req.path();
        if path == root {
            let res = HttpResponse::PermanentRedirect()
                .insert_header((header::LOCATION, format!("{root}/")))
                .finish();
            return Ok(req.into_response(res).map_into_right_body());
        }
        if let Some(rest) = path.strip_prefix(root.as_str()).filter(|r| r.starts_with('/')) {
            let query = req.uri().query().map_or(String::new(), |q| format!("?{q}"));
            if let Ok(uri) = format!("{rest}{query}").parse::<actix_web::http::Uri>() {
                req.match_info_mut().get_mut().update(&uri);
                req.head_mut().uri = uri;
            }
        }
    }
    Ok(next.call(req).await?.map_into_left_body())
}

/// What the request's log line says.
struct HttpLine {
    /// Not `--disable-uvicorn-access-log`.
    enabled: bool,
    method: String,
    path: String,
    status: u16,
    request_id: String,
    start: Instant,
    bytes: usize,
}

/// A response body that logs its request's line when it is dropped: after its last byte
/// went out, or when the client left before that.
struct LoggedBody {
    body: BoxBody,
    line: HttpLine,
}

impl MessageBody for LoggedBody {
    type Error = Box<dyn std::error::Error>;

    fn size(&self) -> BodySize {
        self.body.size()
    }

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Bytes, Self::Error>>> {
        let next = Pin::new(&mut self.body).poll_next(cx);
        if let Poll::Ready(Some(Ok(chunk))) = &next {
            self.line.bytes += chunk.len();
        }
        next
    }
}

impl Drop for LoggedBody {
    fn drop(&mut self) {
        let l = &self.line;
        if !l.enabled {
            return;
        }
        tracing::info!(
            method = %l.method,
            path = %l.path,
            status = l.status,
            ms = l.start.elapsed().as_millis() as u64,
            bytes = l.bytes,
            request_id = %l.request_id,
            "http"
        );
    }
}
