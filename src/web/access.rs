//! Who may reach the server from a browser: the `Host` a request names (against DNS
//! rebinding), the `Origin` of the page that sent it (on every route, the WebSocket upgrade
//! included), and the CORS answers given to the origins that are allowed. vLLM's flag
//! names: `--allowed-origins`, `--allowed-methods`, `--allowed-headers`,
//! `--allow-credentials`, and Jupyter's `--allowed-hosts`.

use actix_web::dev::ServiceRequest;
use actix_web::http::header::{self, HeaderMap, HeaderValue};

use super::errors::ApiError;

/// Host names that are always this machine.
const LOOPBACK: [&str; 3] = ["localhost", "127.0.0.1", "[::1]"];

/// A list flag's values: each value may itself be a JSON list (`'["a","b"]'`, as vLLM takes
/// them) or a comma-separated list.
pub fn flatten_list(values: &[String]) -> Vec<String> {
    let mut out = Vec::new();
    for v in values {
        match serde_json::from_str::<Vec<String>>(v) {
            Ok(list) => out.extend(list),
            Err(_) => out.extend(v.split(',').map(str::trim).filter(|s| !s.is_empty()).map(str::to_string)),
        }
    }
    out
}

/// Either everything (`*`) or the listed values, compared without case.
#[derive(Debug, Clone)]
enum Allow {
    Any,
    Listed(Vec<String>),
}

impl Allow {
    /// `*` anywhere in the list allows everything; an empty list gives `default`.
    fn from_flag(values: &[String], default: Allow) -> Allow {
        let list = flatten_list(values);
        if list.is_empty() {
            default
        } else if list.iter().any(|v| v == "*") {
            Allow::Any
        } else {
            Allow::Listed(list.into_iter().map(|v| v.to_ascii_lowercase()).collect())
        }
    }

    fn allows(&self, v: &str) -> bool {
        match self {
            Allow::Any => true,
            Allow::Listed(l) => l.iter().any(|x| x.eq_ignore_ascii_case(v)),
        }
    }
}

/// The server's access rules, built once from its flags.
#[derive(Debug, Clone)]
pub struct AccessPolicy {
    /// Listed origins beside the server's own and loopback ones; `Any` for `*`.
    origins: Allow,
    /// `None`: the Host header is not checked (bound beyond loopback, no --allowed-hosts).
    hosts: Option<Allow>,
    methods: Allow,
    headers: Allow,
    credentials: bool,
}

/// The flags the policy is built from.
pub struct AccessFlags<'a> {
    pub bind_host: &'a str,
    pub allowed_origins: &'a [String],
    pub allowed_hosts: &'a [String],
    pub allowed_methods: &'a [String],
    pub allowed_headers: &'a [String],
    pub allow_credentials: bool,
}

/// The host part of a `Host` header or of an origin's authority (`[::1]:8000` → `[::1]`).
fn host_name(authority: &str) -> &str {
    if authority.starts_with('[') {
        return authority.find(']').map_or(authority, |i| &authority[..=i]);
    }
    authority.rsplit_once(':').map_or(authority, |(h, port)| match port.parse::<u16>() {
        Ok(_) => h,
        Err(_) => authority,
    })
}

fn is_loopback_bind(host: &str) -> bool {
    let h = host.trim_start_matches('[').trim_end_matches(']');
    h == "localhost" || h.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

impl AccessPolicy {
    pub fn new(f: AccessFlags<'_>) -> Self {
        let hosts = match (flatten_list(f.allowed_hosts).is_empty(), is_loopback_bind(f.bind_host)) {
            (false, _) => Some(Allow::from_flag(f.allowed_hosts, Allow::Any)),
            (true, true) => Some(Allow::Listed(Vec::new())),
            (true, false) => None,
        };
        Self {
            origins: Allow::from_flag(f.allowed_origins, Allow::Listed(Vec::new())),
            hosts,
            methods: Allow::from_flag(f.allowed_methods, Allow::Any),
            headers: Allow::from_flag(f.allowed_headers, Allow::Any),
            credentials: f.allow_credentials,
        }
    }

    /// Refuses a `Host` that is not this machine's name (when bound to loopback) or not
    /// listed in --allowed-hosts.
    fn check_host(&self, headers: &HeaderMap) -> Result<(), ApiError> {
        let (Some(hosts), Some(host)) = (&self.hosts, headers.get(header::HOST)) else { return Ok(()) };
        let host = host.to_str().unwrap_or("");
        let name = host_name(host);
        if LOOPBACK.iter().any(|l| l.eq_ignore_ascii_case(name)) || hosts.allows(name) || hosts.allows(host) {
            return Ok(());
        }
        Err(ApiError::Forbidden(format!(
            "Host {host:?} is not allowed: the server answers its loopback names only; add the name with \
             --allowed-hosts (or --allowed-hosts '*')"
        )))
    }

    /// Whether a page of `origin` may use the server: its own origin (the authority the
    /// request was sent to), loopback pages, and --allowed-origins.
    fn origin_allowed(&self, origin: &str, headers: &HeaderMap) -> bool {
        if self.origins.allows(origin) {
            return true;
        }
        let Some((_, authority)) = origin.split_once("://") else { return false };
        let own = headers.get(header::HOST).and_then(|h| h.to_str().ok());
        own.is_some_and(|h| h.eq_ignore_ascii_case(authority))
            || LOOPBACK.iter().any(|l| l.eq_ignore_ascii_case(host_name(authority)))
    }

    /// What the request may do before it is routed: `Err` refuses it, `Ok(Some)` answers a
    /// CORS preflight itself, `Ok(None)` lets it through.
    pub fn admit(&self, req: &ServiceRequest) -> Result<Option<actix_web::HttpResponse>, ApiError> {
        let headers = req.headers();
        self.check_host(headers)?;
        let Some(origin) = headers.get(header::ORIGIN).and_then(|o| o.to_str().ok()) else {
            return Ok(None);
        };
        if !self.origin_allowed(origin, headers) {
            return Err(ApiError::Forbidden(format!(
                "Origin {origin:?} is not allowed: add it with --allowed-origins"
            )));
        }
        let wanted = headers.get(header::ACCESS_CONTROL_REQUEST_METHOD).and_then(|m| m.to_str().ok());
        let (true, Some(method)) = (req.method() == actix_web::http::Method::OPTIONS, wanted) else {
            return Ok(None);
        };
        if !self.methods.allows(method) {
            return Err(ApiError::Forbidden(format!(
                "method {method} is not allowed from other origins: see --allowed-methods"
            )));
        }
        let asked = headers.get(header::ACCESS_CONTROL_REQUEST_HEADERS).and_then(|h| h.to_str().ok());
        if let Some(bad) =
            asked.into_iter().flat_map(|h| h.split(',')).map(str::trim).find(|h| !self.headers.allows(h))
        {
            return Err(ApiError::Forbidden(format!(
                "header {bad} is not allowed from other origins: see --allowed-headers"
            )));
        }
        let mut res = actix_web::HttpResponse::NoContent();
        res.insert_header((header::ACCESS_CONTROL_ALLOW_METHODS, method))
            .insert_header((header::ACCESS_CONTROL_MAX_AGE, "600"));
        if let Some(h) = asked {
            res.insert_header((header::ACCESS_CONTROL_ALLOW_HEADERS, h));
        }
        let mut res = res.finish();
        self.decorate(origin, res.headers_mut());
        Ok(Some(res))
    }

    /// The CORS headers of a response to an allowed page of `origin`.
    pub fn decorate(&self, origin: &str, out: &mut HeaderMap) {
        let any = matches!(self.origins, Allow::Any) && !self.credentials;
        let value = if any {
            HeaderValue::from_static("*")
        } else {
            HeaderValue::from_str(origin).unwrap_or(HeaderValue::from_static("null"))
        };
        out.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, value);
        out.insert(header::VARY, HeaderValue::from_static("Origin"));
        out.insert(header::ACCESS_CONTROL_EXPOSE_HEADERS, HeaderValue::from_static("X-Request-Id"));
        if self.credentials {
            out.insert(header::ACCESS_CONTROL_ALLOW_CREDENTIALS, HeaderValue::from_static("true"));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_names_lose_their_port_but_not_their_brackets() {
        assert_eq!(host_name("localhost:8000"), "localhost");
        assert_eq!(host_name("[::1]:8000"), "[::1]");
        assert_eq!(host_name("[::1]"), "[::1]");
        assert_eq!(host_name("evil.example"), "evil.example");
        assert_eq!(
            flatten_list(&[r#"["http://a", "http://b"]"#.into(), "http://c,http://d".into()]).len(),
            4
        );
    }
}
