//! Runtime adapter management: `POST /v1/load_lora_adapter` and
//! `POST /v1/unload_lora_adapter` (vLLM's routes), off unless `--allow-runtime-lora`.
//! Paths are confined to `--lora-root`.

use actix_web::{HttpResponse, web};
use serde::Deserialize;
use serde_json::json;

use super::AppState;
use super::errors::ApiError;
use crate::actors::lora_manager::{LoraManagerError, Register, Unregister, confine};

#[derive(Deserialize)]
pub struct LoadRequest {
    lora_name: String,
    lora_path: String,
}

#[derive(Deserialize)]
pub struct UnloadRequest {
    lora_name: String,
}

fn runtime_config(state: &AppState) -> Result<&crate::config::LoraConfig, ApiError> {
    let l = state.engine.config().lora.as_ref().ok_or_else(|| {
        ApiError::Forbidden("LoRA is off: start the server with --enable-lora --allow-runtime-lora".into())
    })?;
    if !l.allow_runtime {
        return Err(ApiError::Forbidden(
            "runtime LoRA loading is off: start the server with --allow-runtime-lora".into(),
        ));
    }
    Ok(l)
}

fn manager_error(e: LoraManagerError) -> ApiError {
    match &e {
        LoraManagerError::NotFound(n) => ApiError::NotFound(format!("no LoRA adapter named {n:?}")),
        LoraManagerError::Load(l) => ApiError::bad(l.to_string(), Some("lora_path")),
        LoraManagerError::BadName(_) => ApiError::bad(e.to_string(), Some("lora_name")),
        other => ApiError::Internal(other.to_string()),
    }
}

pub async fn load(
    state: web::Data<AppState>,
    body: web::Json<LoadRequest>,
) -> Result<HttpResponse, ApiError> {
    let cfg = runtime_config(&state)?;
    let root = cfg.root.clone().ok_or_else(|| {
        ApiError::Forbidden(
            "runtime LoRA loading needs --lora-root: adapters may only come from there".into(),
        )
    })?;
    let LoadRequest { lora_name, lora_path } = body.into_inner();
    if lora_name.is_empty() || state.served_model_names.contains(&lora_name) {
        return Err(ApiError::bad(
            format!("lora_name {lora_name:?} is empty or names the base model"),
            Some("lora_name"),
        ));
    }
    let canonical_root = root.canonicalize().map_err(|e| ApiError::Internal(format!("--lora-root: {e}")))?;
    let dir = web::block(move || confine(&root, &lora_path))
        .await
        .map_err(|e| ApiError::Internal(e.to_string()))?
        .map_err(ApiError::Forbidden)?;
    let manager = state.engine.lora_manager().ok_or_else(|| ApiError::Internal("no LoRA manager".into()))?;
    let info = manager
        .send(Register { name: lora_name, path: dir, root: Some(canonical_root) })
        .await
        .map_err(|_| ApiError::Unavailable("LoRA manager stopped".into()))?
        .map_err(manager_error)?;
    Ok(HttpResponse::Ok().json(json!({ "lora_name": info.name, "rank": info.rank, "targets": info.targets })))
}

pub async fn unload(
    state: web::Data<AppState>,
    body: web::Json<UnloadRequest>,
) -> Result<HttpResponse, ApiError> {
    runtime_config(&state)?;
    let manager = state.engine.lora_manager().ok_or_else(|| ApiError::Internal("no LoRA manager".into()))?;
    manager
        .send(Unregister { name: body.lora_name.clone() })
        .await
        .map_err(|_| ApiError::Unavailable("LoRA manager stopped".into()))?
        .map_err(manager_error)?;
    Ok(HttpResponse::Ok().json(json!({ "lora_name": body.lora_name, "unloaded": true })))
}
