"""Makes tests/fixtures/gguf/*.json: what llama.cpp's own converter writes for tiny Gemma
and Qwen2 models with a SentencePiece tokenizer, and what transformers does with them.

A SentencePiece BPE model (320 pieces, byte fallback, unk/bos/eos = 0/1/2) is trained on a
fixed text. For each architecture the tiny model is built with make_model_goldens.py's
counter-based weights (so actorllm::models::random::write_golden_model rebuilds it), saved
with that tokenizer, and converted by llama.cpp's convert_hf_to_gguf.py (f32). The file
records:
- the GGUF's metadata (every key, arrays included: the vocabulary is 320 entries) and, for
  every tensor, its name, shape, type and two fingerprints of its values (their sum and
  their index-weighted sum), so that a test can write the same file from the rebuilt
  weights and prove it did so as llama.cpp does (names, Gemma's norms stored plus one);
- transformers' greedy continuations with top-5 logprobs for 4 prompts (float32, eager
  attention), kept only where the best token leads the runner-up by MIN_GAP;
- transformers' tokenizer (loaded from the SentencePiece model as a user's would be: Gemma's
  for Gemma, Llama's, with its leading space, for the other) on a few strings: ids with
  special tokens added, and the decoded text.

    python scripts/make_gguf_golden.py tests/fixtures/gguf LLAMA_CPP_DIR

LLAMA_CPP_DIR is llama.cpp's source (for example the llama-cpp-python sdist's
vendor/llama.cpp), whose gguf-py is put on the path. Needs torch, transformers,
sentencepiece, protobuf, numpy.
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np
import torch
import transformers

sys.path.insert(0, os.path.dirname(__file__))
import make_model_goldens as mg  # noqa: E402

VOCAB = mg.VOCAB
WORDS = ("the quick brown fox jumps over lazy dogs while a tokenizer turns plain text into pieces "
         "hello world there models serve tokens quickly and then stream them back to clients").split()
STRINGS = ["hello world", " the quick brown fox", "tokens\nstream  back", "naïve café 🙂", "Hello, World!",
           "<s>the end</s>", "x"]
MODELS = {
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(hidden_act="gelu_pytorch_tanh", tie_word_embeddings=True),
              "GemmaTokenizer", 0.05),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(rope_theta=10000.0), "LlamaTokenizer", 1.0),
}


def train_spm(path):
    import sentencepiece as spm
    rng = np.random.default_rng(7)
    text = [" ".join(rng.choice(WORDS, size=12)) for _ in range(400)]
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(text), model_prefix=path, vocab_size=VOCAB, model_type="bpe", byte_fallback=True,
        character_coverage=1.0, unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2)
    return path + ".model"


def jsonable(v):
    if isinstance(v, (bytes, bytearray)):
        return v.decode("utf-8")
    if isinstance(v, np.ndarray):
        return [jsonable(x) for x in v.tolist()]
    if isinstance(v, (list, tuple)):
        return [jsonable(x) for x in v]
    if isinstance(v, (np.floating,)):
        return float(v)
    if isinstance(v, (np.integer,)):
        return int(v)
    return v


def read_gguf(path):
    import gguf
    r = gguf.GGUFReader(path)
    meta = {}
    for name, field in r.fields.items():
        if name.startswith("GGUF."):
            continue
        t = field.types[0]
        if t == gguf.GGUFValueType.ARRAY:
            sub = field.types[1]
            vals = [field.parts[i] for i in field.data]
            vals = [bytes(v).decode("utf-8") if sub == gguf.GGUFValueType.STRING else v.tolist()[0] for v in vals]
            meta[name] = {"type": "array", "of": sub.name.lower(), "value": vals}
        elif t == gguf.GGUFValueType.STRING:
            meta[name] = {"type": "string", "value": bytes(field.parts[-1]).decode("utf-8")}
        else:
            meta[name] = {"type": t.name.lower(), "value": field.parts[-1].tolist()[0]}
    tensors = []
    for t in r.tensors:
        v = np.asarray(t.data, dtype=np.float64).reshape(-1)
        tensors.append({"name": t.name, "shape": [int(x) for x in t.shape], "type": t.tensor_type.name,
                        "sum": float(v.sum()), "weighted": float((v * np.arange(v.size)).sum() / v.size)})
    return meta, tensors


def main(out_dir, llama_cpp):
    os.makedirs(out_dir, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=os.path.join(llama_cpp, "gguf-py"))
    sys.path.insert(0, os.path.join(llama_cpp, "gguf-py"))
    with tempfile.TemporaryDirectory() as tmp:
        sp_model = train_spm(os.path.join(tmp, "spm"))
        for key, (cfg_class, model_class, extra, tok_class, embed_scale) in MODELS.items():
            cfg, model, params, _ = mg.build(key, cfg_class, model_class, extra, embed_scale)
            d = os.path.join(tmp, key)
            model.save_pretrained(d, safe_serialization=True)
            shutil.copy(sp_model, os.path.join(d, "tokenizer.model"))
            with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
                json.dump({"tokenizer_class": tok_class, "add_bos_token": True, "add_eos_token": False,
                           "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}, f)
            # The tokenizer alone, so that transformers picks its class by tokenizer_config.json
            # and not by the model's type.
            td = os.path.join(tmp, f"{key}-tokenizer")
            os.makedirs(td)
            for f in ["tokenizer.model", "tokenizer_config.json"]:
                shutil.copy(os.path.join(d, f), td)
            tok = transformers.AutoTokenizer.from_pretrained(td)
            encoded = [{"text": s, "ids": tok(s).input_ids,
                        "decoded": tok.decode(tok(s, add_special_tokens=False).input_ids)} for s in STRINGS]
            out = os.path.join(tmp, f"{key}.gguf")
            subprocess.run([sys.executable, os.path.join(llama_cpp, "convert_hf_to_gguf.py"), d, "--outfile", out,
                            "--outtype", "f32"], check=True, env=env, capture_output=True)
            meta, tensors = read_gguf(out)
            rng = np.random.default_rng(mg.fnv1a64(key) & 0xFFFFFFFF)
            runs, tried = [], 0
            while len(runs) < 4 and tried < 400:
                tried += 1
                ids = [int(x) for x in rng.integers(3, VOCAB, int(rng.integers(3, 12)))]
                tokens, steps, gap = mg.run(model, ids)
                if gap >= mg.MIN_GAP:
                    runs.append({"prompt_ids": ids, "output_ids": tokens, "top_logprobs": steps, "min_gap": gap})
            assert len(runs) == 4, f"{key}: {len(runs)} prompts with margins in {tried}"
            config = json.loads(cfg.to_json_string(use_diff=False))
            config["architectures"] = [model_class]
            golden = {"model": key, "transformers": transformers.__version__, "config": config, "params": params,
                      "embed_scale": embed_scale, "tokens": mg.TOKENS, "runs": runs, "tokenizer": encoded,
                      "gguf": {"metadata": meta, "tensors": tensors}}
            with open(os.path.join(out_dir, f"{key}.json"), "w") as fh:
                json.dump(jsonable(golden), fh, separators=(",", ":"))
            print(key, "tensors", len(tensors), "prompts", [len(r["prompt_ids"]) for r in runs], "tried", tried,
                  "min gap", min(r["min_gap"] for r in runs), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
