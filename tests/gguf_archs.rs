//! GGUF files of Gemma and Qwen2 with a SentencePiece vocabulary, as llama.cpp's converter
//! writes them (tests/fixtures/gguf/*.json, made by scripts/make_gguf_golden.py): the test
//! writes the file from the tiny model's rebuilt weights and the converter's metadata,
//! checks every tensor against the converter's fingerprints (names, layout, Gemma's norms
//! stored plus one), imports it, and serves transformers' greedy tokens and logprobs, and
//! transformers' tokenization of the fixture's strings.

mod common;

use actorllm::Engine;
use actorllm::gguf::import::{ImportDtype, ImportOptions, import_gguf};
use serde_json::Value;

/// A GGUF v3 file of `metadata` (the fixture's typed values) and f32 `tensors`
/// (name, dims in GGUF order, values).
fn gguf(metadata: &serde_json::Map<String, Value>, tensors: &[(String, Vec<u64>, Vec<f32>)]) -> Vec<u8> {
    let mut b = Vec::new();
    let text = |b: &mut Vec<u8>, t: &str| {
        b.extend((t.len() as u64).to_le_bytes());
        b.extend(t.as_bytes());
    };
    // GGUF value types: uint32 4, int32 5, float32 6, bool 7, string 8, array 9.
    let code = |ty: &str| match ty {
        "uint32" => 4u32,
        "int32" => 5,
        "float32" => 6,
        "bool" => 7,
        "string" => 8,
        other => panic!("no writer for GGUF {other}"),
    };
    let scalar = |b: &mut Vec<u8>, ty: &str, v: &Value| match ty {
        "uint32" => b.extend((v.as_u64().unwrap() as u32).to_le_bytes()),
        "int32" => b.extend((v.as_i64().unwrap() as i32).to_le_bytes()),
        "float32" => b.extend((v.as_f64().unwrap() as f32).to_le_bytes()),
        "bool" => b.push(v.as_bool().unwrap() as u8),
        "string" => text(b, v.as_str().unwrap()),
        other => panic!("no writer for GGUF {other}"),
    };
    b.extend(b"GGUF");
    b.extend(3u32.to_le_bytes());
    b.extend((tensors.len() as u64).to_le_bytes());
    b.extend((metadata.len() as u64).to_le_bytes());
    for (key, v) in metadata {
        text(&mut b, key);
        let ty = v["type"].as_str().unwrap();
        if ty == "array" {
            let of = v["of"].as_str().unwrap();
            let items = v["value"].as_array().unwrap();
            b.extend(9u32.to_le_bytes());
            b.extend(code(of).to_le_bytes());
            b.extend((items.len() as u64).to_le_bytes());
            for item in items {
                scalar(&mut b, of, item);
            }
        } else {
            b.extend(code(ty).to_le_bytes());
            scalar(&mut b, ty, &v["value"]);
        }
    }
    let mut offset = 0u64;
    for (name, dims, values) in tensors {
        text(&mut b, name);
        b.extend((dims.len() as u32).to_le_bytes());
        dims.iter().for_each(|d| b.extend(d.to_le_bytes()));
        b.extend(0u32.to_le_bytes()); // F32
        b.extend(offset.to_le_bytes());
        offset += (values.len() as u64 * 4).div_ceil(32) * 32;
    }
    let pad = |b: &mut Vec<u8>| b.resize(b.len().div_ceil(32) * 32, 0);
    pad(&mut b);
    for (_, _, values) in tensors {
        b.extend(bytemuck::cast_slice::<f32, u8>(values));
        pad(&mut b);
    }
    b
}

/// The Hugging Face tensor llama.cpp names `name`, and whether llama.cpp stored it plus one.
fn hf_of(name: &str, model: &str) -> (String, bool) {
    let plus_one = model == "gemma" && name.ends_with("norm.weight");
    let hf = match name {
        "token_embd.weight" => "model.embed_tokens.weight".to_string(),
        "output_norm.weight" => "model.norm.weight".to_string(),
        "output.weight" => "lm_head.weight".to_string(),
        _ => {
            let rest = name.strip_prefix("blk.").unwrap();
            let (layer, leaf) = rest.split_once('.').unwrap();
            let (module, kind) = leaf.rsplit_once('.').unwrap();
            let hf = match module {
                "attn_norm" => "input_layernorm",
                "ffn_norm" => "post_attention_layernorm",
                "attn_q" => "self_attn.q_proj",
                "attn_k" => "self_attn.k_proj",
                "attn_v" => "self_attn.v_proj",
                "attn_output" => "self_attn.o_proj",
                "ffn_gate" => "mlp.gate_proj",
                "ffn_up" => "mlp.up_proj",
                "ffn_down" => "mlp.down_proj",
                other => panic!("no Hugging Face name for {other}"),
            };
            format!("model.layers.{layer}.{hf}.{kind}")
        }
    };
    (hf, plus_one)
}

async fn check(model: &str) {
    let g: Value = serde_json::from_str(
        &std::fs::read_to_string(common::fixture(&format!("tests/fixtures/gguf/{model}.json"))).unwrap(),
    )
    .unwrap();
    let hf = common::scratch(&format!("gguf-{model}-hf"));
    actorllm::models::random::write_golden_model(&g, hf.path()).unwrap();
    let bytes = std::fs::read(hf.path().join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    // Every tensor of the converter's file, from the rebuilt weights, matching its
    // fingerprints: the same values in the same order.
    let mut tensors = Vec::new();
    for t in g["gguf"]["tensors"].as_array().unwrap() {
        let name = t["name"].as_str().unwrap();
        let (hf_name, plus_one) = hf_of(name, model);
        let view = st.tensor(&hf_name).unwrap_or_else(|e| panic!("{name} ({hf_name}): {e}"));
        let mut values: Vec<f32> = bytemuck::pod_collect_to_vec(view.data());
        if plus_one {
            values.iter_mut().for_each(|v| *v += 1.0);
        }
        let dims: Vec<u64> = t["shape"].as_array().unwrap().iter().map(|d| d.as_u64().unwrap()).collect();
        let hf_dims: Vec<u64> = view.shape().iter().rev().map(|&d| d as u64).collect();
        assert_eq!(dims, hf_dims, "{name}: GGUF lists dimensions innermost first");
        let sum: f64 = values.iter().map(|&v| v as f64).sum();
        let weighted: f64 =
            values.iter().enumerate().map(|(i, &v)| v as f64 * i as f64).sum::<f64>() / values.len() as f64;
        for (what, got, want) in [("sum", sum, &t["sum"]), ("weighted sum", weighted, &t["weighted"])] {
            let want = want.as_f64().unwrap();
            assert!(
                (got - want).abs() <= 1e-6 * (1.0 + want.abs()),
                "{name}: {what} {got} vs the converter's {want}"
            );
        }
        tensors.push((name.to_string(), dims, values));
    }
    let scratch = common::scratch(&format!("gguf-{model}"));
    let file = scratch.path().join(format!("{model}.gguf"));
    std::fs::write(&file, gguf(g["gguf"]["metadata"].as_object().unwrap(), &tensors)).unwrap();
    let dir = scratch.path().join("imported");
    import_gguf(&file, &dir, ImportOptions { dtype: ImportDtype::F32, keep_quantized: false }).unwrap();

    let tok = tokenizers::Tokenizer::from_file(dir.join("tokenizer.json")).unwrap();
    for case in g["tokenizer"].as_array().unwrap() {
        let text = case["text"].as_str().unwrap();
        let want: Vec<u32> =
            case["ids"].as_array().unwrap().iter().map(|i| i.as_u64().unwrap() as u32).collect();
        let got = tok.encode(text, true).unwrap().get_ids().to_vec();
        assert_eq!(got, want, "{model}: {text:?} tokenized");
        let plain = tok.encode(text, false).unwrap().get_ids().to_vec();
        assert_eq!(
            tok.decode(&plain, false).unwrap(),
            case["decoded"].as_str().unwrap(),
            "{model}: {text:?} decoded"
        );
    }

    let engine = Engine::start(common::args(&dir)).await.unwrap_or_else(|e| panic!("{model}: {e}"));
    let steps = g["tokens"].as_u64().unwrap() as usize;
    for (i, run) in g["runs"].as_array().unwrap().iter().enumerate() {
        let ids =
            |v: &Value| v.as_array().unwrap().iter().map(|t| t.as_u64().unwrap() as u32).collect::<Vec<_>>();
        let got = common::greedy_top5(&engine, ids(&run["prompt_ids"]), steps).await;
        assert_eq!(
            got.iter().map(|s| s.0).collect::<Vec<_>>(),
            ids(&run["output_ids"]),
            "{model}: prompt {i}"
        );
        for (step, ((_, got), want)) in got.iter().zip(run["top_logprobs"].as_array().unwrap()).enumerate() {
            for w in want.as_array().unwrap() {
                let (id, lp) = (w[0].as_u64().unwrap() as u32, w[1].as_f64().unwrap() as f32);
                let ours = got.iter().find(|(t, _)| *t == id).map(|(_, l)| *l);
                assert!(
                    ours.is_some_and(|l| (l - lp).abs() < 1e-4),
                    "{model}: prompt {i} step {step}: token {id} at {lp}, ours {got:?}"
                );
            }
        }
    }
}

#[actix_rt::test]
async fn a_gemma_gguf_with_sentencepiece_matches_transformers() {
    check("gemma").await;
}

#[actix_rt::test]
async fn a_qwen2_gguf_matches_transformers() {
    check("qwen2").await;
}

#[test]
fn unknown_gguf_architectures_are_named() {
    let metadata = serde_json::json!({"general.architecture": {"type": "string", "value": "phi2"}});
    let scratch = common::scratch("gguf-phi2");
    let file = scratch.path().join("phi2.gguf");
    std::fs::write(&file, gguf(metadata.as_object().unwrap(), &[])).unwrap();
    let e = import_gguf(
        &file,
        &scratch.path().join("out"),
        ImportOptions { dtype: ImportDtype::F32, keep_quantized: false },
    )
    .unwrap_err()
    .to_string();
    assert_eq!(e, "architecture \"phi2\" is not supported by import-gguf (supported: llama, qwen2, gemma)");
}
