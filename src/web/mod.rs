//! The HTTP and WebSocket server (actix-web): OpenAI-compatible routes with SSE streaming,
//! the WebSocket protocol, operations routes and the playground. Handlers validate at the
//! edge (`protocol`) and only talk to the [`Engine`].

pub mod access;
pub mod batch;
pub mod errors;
pub mod lora;
pub mod openai;
pub mod ops;
pub mod playground;
pub mod protocol;
pub mod responses;
pub mod shutdown;
pub mod ws;
pub mod ws_frames;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use actix_web::{App, HttpServer, middleware, web};
use dashmap::DashMap;

use crate::config::EngineArgs;
use crate::engine::{Architectures, Engine, EngineError};

/// Request bodies larger than this get 413.
pub const MAX_BODY_BYTES: usize = 4 << 20;

#[derive(Debug, Clone, clap::Args)]
pub struct ServeArgs {
    #[command(flatten)]
    pub engine: EngineArgs,
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// Names clients use in `model` (defaults to the `--model` argument as given, a path or
    /// a model id, as vLLM's does); every name is listed by /v1/models and responses echo
    /// the one asked for.
    #[arg(long, num_args = 1..)]
    pub served_model_name: Vec<String>,
    /// Require `Authorization: Bearer <key>` on every route but /health and the playground.
    #[arg(long, env = "VLLM_API_KEY")]
    pub api_key: Option<String>,
    /// Seconds a WebSocket may stay silent (no frame, not even a pong) before the server
    /// closes it and aborts its generations; the server pings it six times in that span,
    /// at most every 5 s.
    #[arg(long, default_value_t = 30.0, value_parser = positive_seconds)]
    pub ws_idle_timeout: f64,
    /// Seconds one engine step may run before `/health` reports the step loop stuck (503);
    /// vLLM's VLLM_ENGINE_ITERATION_TIMEOUT_S.
    #[arg(long, env = "VLLM_ENGINE_ITERATION_TIMEOUT_S", default_value_t = 120.0, value_parser = positive_seconds)]
    pub engine_iteration_timeout: f64,
    /// Origins whose pages may use the server (CORS and the WebSocket upgrade), besides
    /// its own origin and loopback pages; a JSON list or comma-separated, `*` for any.
    #[arg(long, num_args = 1..)]
    pub allowed_origins: Vec<String>,
    /// Methods other origins may use (CORS); all when not given.
    #[arg(long, num_args = 1..)]
    pub allowed_methods: Vec<String>,
    /// Request headers other origins may send (CORS); all when not given.
    #[arg(long, num_args = 1..)]
    pub allowed_headers: Vec<String>,
    /// Let allowed origins send credentials (cookies, HTTP auth) across origins.
    #[arg(long)]
    pub allow_credentials: bool,
    /// Host names the server answers to (against DNS rebinding). Bound to loopback, only
    /// localhost, 127.0.0.1 and [::1] are answered unless listed here; `*` for any.
    #[arg(long, num_args = 1..)]
    pub allowed_hosts: Vec<String>,
    /// Most sequences that may wait for a place in the batch; a request past it gets 429
    /// with Retry-After. Defaults to --max-num-seqs; 0 for no bound.
    #[arg(long)]
    pub max_waiting_requests: Option<usize>,
    /// Tokens each choice of a stream may leave unread (SSE or WebSocket) before its request
    /// is aborted with an error event (`client_not_reading` in /metrics), so that a client
    /// that stops reading holds neither memory nor KV blocks.
    #[arg(long, default_value_t = crate::engine::DEFAULT_STREAM_BACKLOG, value_parser = at_least_one)]
    pub stream_backlog: usize,
    /// Seconds a request body may take to arrive in full (408 past it).
    #[arg(long, default_value_t = 30.0, value_parser = positive_seconds)]
    pub request_body_timeout: f64,
    /// Seconds running requests may take to finish after SIGTERM or SIGINT before they are
    /// ended with an error (`actorllm serve`; see `web::shutdown`).
    #[arg(long, default_value_t = 30.0, value_parser = non_negative_seconds)]
    pub shutdown_timeout: f64,
    /// The path prefix a reverse proxy serves this server under (`/llm`): every route also
    /// answers under it, `<root-path>` alone redirects to the playground at `<root-path>/`,
    /// and the playground's links are relative, so it works behind a proxy that strips the
    /// prefix and one that passes it on.
    #[arg(long, value_parser = parse_root_path)]
    pub root_path: Option<String>,
    /// Serve HTTPS (and WSS) with this PEM private key; needs --ssl-certfile.
    #[arg(long, requires = "ssl_certfile")]
    pub ssl_keyfile: Option<std::path::PathBuf>,
    /// The PEM certificate chain for --ssl-keyfile, the server's certificate first.
    #[arg(long, requires = "ssl_keyfile")]
    pub ssl_certfile: Option<std::path::PathBuf>,
    /// The log level when RUST_LOG is not set (vLLM's flag for its HTTP server's log).
    #[arg(long, value_enum, default_value_t = LogLevel::Info)]
    pub uvicorn_log_level: LogLevel,
    /// No log line per HTTP request.
    #[arg(long)]
    pub disable_uvicorn_access_log: bool,
}

/// Uvicorn's log levels, as `--uvicorn-log-level` takes them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LogLevel {
    Critical,
    Error,
    Warning,
    Info,
    Debug,
    Trace,
}

impl LogLevel {
    /// The `tracing` filter directive of the level.
    pub fn directive(self) -> &'static str {
        match self {
            LogLevel::Critical | LogLevel::Error => "error",
            LogLevel::Warning => "warn",
            LogLevel::Info => "info",
            LogLevel::Debug => "debug",
            LogLevel::Trace => "trace",
        }
    }
}

/// `/llm`, `/llm/` and `llm` all give `/llm`; `/` gives none.
fn parse_root_path(s: &str) -> Result<String, String> {
    let trimmed = s.trim_matches('/');
    if trimmed.chars().any(|c| c.is_whitespace() || c == '?' || c == '#') {
        return Err(format!("{s:?} is not a URL path"));
    }
    Ok(if trimmed.is_empty() { String::new() } else { format!("/{trimmed}") })
}

impl ServeArgs {
    /// The server's own flags at their defaults, in front of an engine of `engine`.
    pub fn new(engine: EngineArgs) -> Self {
        Self {
            engine,
            host: "127.0.0.1".into(),
            port: 8000,
            served_model_name: Vec::new(),
            api_key: None,
            ws_idle_timeout: 30.0,
            engine_iteration_timeout: 120.0,
            allowed_origins: Vec::new(),
            allowed_methods: Vec::new(),
            allowed_headers: Vec::new(),
            allow_credentials: false,
            allowed_hosts: Vec::new(),
            max_waiting_requests: None,
            stream_backlog: crate::engine::DEFAULT_STREAM_BACKLOG,
            request_body_timeout: 30.0,
            shutdown_timeout: 30.0,
            root_path: None,
            ssl_keyfile: None,
            ssl_certfile: None,
            uvicorn_log_level: LogLevel::Info,
            disable_uvicorn_access_log: false,
        }
    }
}

fn positive_seconds(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v > 0.0 && v.is_finite() => Ok(v),
        _ => Err(format!("expected a positive number of seconds, got {s:?}")),
    }
}

fn at_least_one(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(n) if n >= 1 => Ok(n),
        _ => Err(format!("{s:?} is not a whole number of at least 1")),
    }
}

fn non_negative_seconds(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v >= 0.0 && v.is_finite() => Ok(v),
        _ => Err(format!("expected a number of seconds, 0 or more, got {s:?}")),
    }
}

/// Timing the server holds clients and the engine to.
#[derive(Debug, Clone, Copy)]
pub struct Timeouts {
    /// A WebSocket silent this long is closed.
    pub ws_idle: Duration,
    /// A step running this long makes `/health` answer 503.
    pub engine_iteration: Duration,
    /// A request body must arrive in full within this.
    pub body: Duration,
}

/// Shared by every handler.
pub struct AppState {
    pub engine: Engine,
    /// The first is the primary name.
    pub served_model_names: Vec<String>,
    pub api_key: Option<String>,
    pub timeouts: Timeouts,
    pub access: access::AccessPolicy,
    /// Response id → engine request ids, while the response is live (for cancellation).
    pub live: DashMap<String, Vec<String>>,
    pub started_unix: u64,
    /// Serving, draining or cut (`shutdown`); WebSocket sessions hold its receivers.
    pub phase: tokio::sync::watch::Sender<shutdown::Phase>,
    /// `--root-path` (`/llm`), or empty.
    pub root_path: String,
    /// One log line per HTTP request (not `--disable-uvicorn-access-log`).
    pub access_log: bool,
    id_salt: u64,
    next_id: AtomicU64,
}

impl AppState {
    pub fn new(
        engine: Engine,
        served_model_names: Vec<String>,
        api_key: Option<String>,
        timeouts: Timeouts,
        access: access::AccessPolicy,
    ) -> Self {
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        Self {
            engine,
            served_model_names,
            api_key,
            timeouts,
            access,
            live: DashMap::new(),
            started_unix: now.as_secs(),
            phase: tokio::sync::watch::Sender::new(shutdown::Phase::Serving),
            root_path: String::new(),
            access_log: true,
            id_salt: crate::sampling::uniform(now.as_nanos() as u64, 0, 0).to_bits(),
            next_id: AtomicU64::new(0),
        }
    }

    /// A unique, hard-to-guess request id (`cmpl-…`, `chatcmpl-…`).
    pub fn new_request_id(&self, prefix: &str) -> String {
        let n = self.next_id.fetch_add(1, Ordering::Relaxed);
        let r = crate::sampling::uniform(self.id_salt, n as usize, 0).to_bits();
        format!("{prefix}-{r:016x}{n:x}")
    }
}

/// Registers every route on an actix-web app.
pub fn configure(cfg: &mut web::ServiceConfig) {
    cfg.app_data(web::JsonConfig::default().limit(MAX_BODY_BYTES).error_handler(errors::json_error))
        .app_data(web::PayloadConfig::default().limit(MAX_BODY_BYTES))
        .route("/v1/completions", web::post().to(openai::completions))
        .route("/v1/chat/completions", web::post().to(openai::chat_completions))
        .route("/v1/models", web::get().to(openai::models))
        .route("/tokenize", web::post().to(openai::tokenize))
        .route("/detokenize", web::post().to(openai::detokenize))
        .route("/v1/requests/{id}/cancel", web::post().to(openai::cancel))
        .route("/v1/load_lora_adapter", web::post().to(lora::load))
        .route("/v1/unload_lora_adapter", web::post().to(lora::unload))
        .route("/v1/ws", web::get().to(ws::connect))
        .route("/health", web::get().to(ops::health))
        .route("/metrics", web::get().to(ops::metrics))
        .route("/", web::get().to(playground::index))
        .route("/favicon.ico", web::get().to(playground::favicon))
        .route("/static/{path:.*}", web::get().to(playground::file))
        .default_service(web::to(openai::not_found));
}

/// Loads the model, binds, and returns the running server and its address (port 0 picks
/// a free port). The server is ready when this returns.
pub async fn start(args: ServeArgs) -> Result<(actix_web::dev::Server, SocketAddr), EngineError> {
    start_with_architectures::<()>(args).await
}

/// As [`start`], with the architectures `A` registers beside the built-in ones.
pub async fn start_with_architectures<A: Architectures>(
    args: ServeArgs,
) -> Result<(actix_web::dev::Server, SocketAddr), EngineError> {
    let engine = Engine::start_with_architectures::<A>(args.engine.clone()).await?;
    start_with_engine(args, engine)
}

/// Binds the server in front of a running engine.
pub fn start_with_engine(
    args: ServeArgs,
    engine: Engine,
) -> Result<(actix_web::dev::Server, SocketAddr), EngineError> {
    bind(args, engine, false).map(|(server, addr, _)| (server, addr))
}

/// Serves until SIGTERM or SIGINT, then drains for `--shutdown-timeout` ([`shutdown`]).
pub async fn serve(args: ServeArgs) -> Result<(), EngineError> {
    shutdown::serve::<()>(args).await
}

/// As [`serve`], with the architectures `A` registers beside the built-in ones.
pub async fn serve_with_architectures<A: Architectures>(args: ServeArgs) -> Result<(), EngineError> {
    shutdown::serve::<A>(args).await
}

/// The names a request's `model` may use: `--served-model-name`'s, else `--model` as given
/// (a path or a model id), as vLLM's.
pub fn served_names(given: &[String], engine: &EngineArgs) -> Vec<String> {
    if given.is_empty() { vec![engine.model.to_string_lossy().into_owned()] } else { given.to_vec() }
}

/// Binds the server; with `own_signals` the caller handles SIGTERM and SIGINT itself.
fn bind(
    args: ServeArgs,
    engine: Engine,
    own_signals: bool,
) -> Result<(actix_web::dev::Server, SocketAddr, web::Data<AppState>), EngineError> {
    let names = served_names(&args.served_model_name, &args.engine);
    let name = names.join(", ");
    let timeouts = Timeouts {
        ws_idle: Duration::from_secs_f64(args.ws_idle_timeout),
        engine_iteration: Duration::from_secs_f64(args.engine_iteration_timeout),
        body: Duration::from_secs_f64(args.request_body_timeout),
    };
    let max_waiting = args.max_waiting_requests.unwrap_or(engine.config().max_num_seqs);
    engine.set_max_waiting((max_waiting > 0).then_some(max_waiting));
    engine.set_stream_backlog(args.stream_backlog);
    let access = access::AccessPolicy::new(access::AccessFlags {
        bind_host: &args.host,
        allowed_origins: &args.allowed_origins,
        allowed_hosts: &args.allowed_hosts,
        allowed_methods: &args.allowed_methods,
        allowed_headers: &args.allowed_headers,
        allow_credentials: args.allow_credentials,
    });
    let mut state = AppState::new(engine, names, args.api_key.clone(), timeouts, access);
    state.root_path = args.root_path.clone().unwrap_or_default();
    state.access_log = !args.disable_uvicorn_access_log;
    let state = web::Data::new(state);
    let app_state = state.clone();
    let server = HttpServer::new(move || {
        App::new()
            .app_data(app_state.clone())
            .wrap(middleware::from_fn(ops::auth_and_log))
            .wrap(middleware::from_fn(ops::root_path))
            .configure(configure)
    })
    .workers(2)
    // A client that closes its end has gone: its connection, and with it a non-streamed
    // request still waiting for its response, is dropped (which aborts the generation).
    .h1_allow_half_closed(false);
    let at = (args.host.as_str(), args.port);
    let cannot_bind =
        |e: std::io::Error| EngineError::Server(format!("cannot bind {}:{}: {e}", args.host, args.port));
    let (mut server, scheme) = match (&args.ssl_keyfile, &args.ssl_certfile) {
        (Some(key), Some(cert)) => {
            (server.bind_rustls_0_23(at, tls_config(key, cert)?).map_err(cannot_bind)?, "https")
        }
        _ => (server.bind(at).map_err(cannot_bind)?, "http"),
    };
    if own_signals {
        // The drain has run by the time the server is stopped: what is left may go.
        server = server.disable_signals().shutdown_timeout(1);
    }
    let addr =
        server.addrs().first().copied().ok_or_else(|| EngineError::Device("no bound address".into()))?;
    tracing::info!(model = %name, "listening on {scheme}://{addr}{}", state.root_path);
    Ok((server.run(), addr, state))
}

/// The TLS settings of `--ssl-keyfile` and `--ssl-certfile` (PEM), with HTTP/1.1 offered
/// by ALPN.
fn tls_config(key: &std::path::Path, cert: &std::path::Path) -> Result<rustls::ServerConfig, EngineError> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let fail = |what: &str, path: &std::path::Path, e: &dyn std::fmt::Display| {
        EngineError::Server(format!("{what} {}: {e}", path.display()))
    };
    let chain = CertificateDer::pem_file_iter(cert)
        .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
        .map_err(|e| fail("--ssl-certfile", cert, &e))?;
    if chain.is_empty() {
        return Err(fail("--ssl-certfile", cert, &"no PEM certificate in the file"));
    }
    let key_der = PrivateKeyDer::from_pem_file(key).map_err(|e| fail("--ssl-keyfile", key, &e))?;
    // ring rather than aws-lc-rs keeps the build free of cmake and a C++ toolchain; the
    // price is no post-quantum key exchange, which rustls marks by deprecating this.
    #[allow(deprecated)]
    let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| EngineError::Server(format!("TLS: {e}")))?
        .with_no_client_auth()
        .with_single_cert(chain, key_der)
        .map_err(|e| fail("--ssl-keyfile", key, &e))?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(config)
}
