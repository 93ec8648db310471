"""Makes tests/fixtures/lora_golden.json: greedy references from transformers + PEFT for
the default model with two LoRA adapters whose weights come from a deterministic
generator. The Rust tests write the same adapters (same generator, PEFT's file layout)
at run time, so no adapter weights are committed. Each continuation is recorded as ids and
as the text transformers decodes them to (special tokens skipped).

    python scripts/make_lora_golden.py models/SmolLM2-135M-Instruct.Q4_1.gguf tests/fixtures/lora_golden.json
"""
import json
import os
import sys

import numpy as np
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer

MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

ADAPTERS = [
    {"name": "qv8", "seed": 1, "r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"], "use_rslora": False},
    {"name": "mlp16", "seed": 2, "r": 16, "lora_alpha": 32,
     "target_modules": ["k_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], "use_rslora": True},
]
PROMPTS = ["The capital of France is", "def add(a, b):\n    return", "My favourite colour is"]
TOKENS = 24


def xorshift_values(seed, n):
    """n values in [-1000, 1000] * 2^-14 (exact in f32), from a 32-bit xorshift."""
    x = (seed * 2654435761 + 12345) & 0xFFFFFFFF or 1
    out = np.empty(n, dtype=np.float32)
    for i in range(n):
        x ^= (x << 13) & 0xFFFFFFFF
        x ^= x >> 17
        x ^= (x << 5) & 0xFFFFFFFF
        out[i] = ((x % 2001) - 1000) * 2.0**-14
    return out


def tensor_seed(adapter_seed, layer, module, which):
    return adapter_seed * 1000003 + layer * 101 + MODULES.index(module) * 7 + which


gguf = sys.argv[1]
out = sys.argv[2]
d, f = os.path.dirname(os.path.abspath(gguf)), os.path.basename(gguf)
tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
golden = {"prompts": PROMPTS, "tokens": TOKENS, "adapters": []}
for spec in ADAPTERS:
    base = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, torch_dtype=torch.float32)
    cfg = LoraConfig(r=spec["r"], lora_alpha=spec["lora_alpha"], target_modules=spec["target_modules"],
                     lora_dropout=0.0, bias="none", use_rslora=spec["use_rslora"])
    model = get_peft_model(base, cfg)
    model.eval()
    for name, mod in model.named_modules():
        if not hasattr(mod, "lora_A") or "default" not in mod.lora_A:
            continue
        layer = int(name.split(".layers.")[1].split(".")[0])
        module = name.split(".")[-1]
        a, b = mod.lora_A["default"].weight, mod.lora_B["default"].weight
        with torch.no_grad():
            a.copy_(torch.from_numpy(xorshift_values(tensor_seed(spec["seed"], layer, module, 0), a.numel()).reshape(a.shape)))
            b.copy_(torch.from_numpy(xorshift_values(tensor_seed(spec["seed"], layer, module, 1), b.numel()).reshape(b.shape)))
    outputs = []
    for p in PROMPTS:
        ids = tok(p)["input_ids"]
        with torch.no_grad():
            gen = model.generate(torch.tensor([ids]), max_new_tokens=TOKENS, do_sample=False, num_beams=1,
                                 eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)
        out_ids = gen[0, len(ids):].tolist()
        outputs.append({"prompt_ids": ids, "output_ids": out_ids,
                        "output_text": tok.decode(out_ids, skip_special_tokens=True)})
    golden["adapters"].append({**spec, "outputs": outputs})
    print(spec["name"], [o["output_ids"][:6] for o in outputs], flush=True)
with open(out, "w") as fh:
    json.dump(golden, fh, indent=1)
print("wrote", out)
