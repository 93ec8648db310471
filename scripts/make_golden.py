"""Makes tests/fixtures/golden_smollm2.json: greedy references from Hugging Face transformers.

Independent of actorllm: transformers reads the GGUF itself (gguf_file=, dequantized to f32)
and its own tokenizer conversion. Each continuation is recorded as ids and as the text
transformers decodes them to (special tokens skipped, as a server streams them). Run in a
venv with torch, transformers and gguf, on the GGUF that scripts/fetch_model.sh keeps:

    python scripts/make_golden.py models/SmolLM2-135M-Instruct.Q4_1.gguf tests/fixtures/golden_smollm2.json
"""
import json
import os
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

gguf, out = sys.argv[1], sys.argv[2]
d, f = os.path.dirname(os.path.abspath(gguf)), os.path.basename(gguf)
tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, torch_dtype=torch.float32)
model.eval()
torch.manual_seed(0)

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "Water boils at 100 degrees Celsius because",
    "List of planets:\n1.",
]
CHATS = [
    [{"role": "user", "content": "What is the tallest mountain in the world?"}],
    [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Give me two words that rhyme with cat."},
        {"role": "assistant", "content": "Hat, bat."},
        {"role": "user", "content": "Two more, please."},
    ],
]
TOKENIZER_TEXTS = [
    "Hello, world!",
    "  leading spaces and\ttabs\n\n\nnewlines   ",
    "Numbers 1234567 and 3.14159, dates 2024-11-29.",
    "Unicode: café naïve 日本語 中文 한국어 emoji 🎉🚀 Ünïcödé",
    "def f(x):\n    return x ** 2  # square\n",
    "<|im_start|>user\nhi<|im_end|>\n",
    "don't won't I'm you're they've we'll he'd",
    "    \n\t  \r\n mixed   whitespace",
    "URL https://example.com/path?q=1&b=two#frag",
    "ÀÉÎÕÜ ßẞ ﬁ ligatures and Ω≈ç√∫",
]


def greedy(ids, n=32):
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]), max_new_tokens=n, do_sample=False, num_beams=1,
            eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id,
        )
    return out[0, len(ids):].tolist()


# Beam search: (prompt or chat, num_beams, num_return_sequences, length_penalty, early_stopping,
# max_new_tokens). transformers' results in float32 equal its results in float64 for every
# case, and the returned scores of neighbours differ by at least 2e-4.
BEAMS = [
    ("The capital of France is", 4, 4, 1.0, False, 16),
    ("def fibonacci(n):\n    ", 4, 4, 0.5, True, 16),
    ("Once upon a time, in a small village,", 4, 2, 2.0, "never", 16),
    ("The three primary colors are", 4, 4, -1.0, False, 16),
    ("List of planets:\n1.", 3, 3, 1.0, True, 12),
    ([{"role": "user", "content": "What is 2 + 2? Answer with one number."}], 4, 4, 1.0, True, 24),
    ([{"role": "user", "content": "Name one color."}], 4, 2, 1.0, False, 24),
]


def beam(ids, num_beams, n, length_penalty, early_stopping, max_new):
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]), max_new_tokens=max_new, do_sample=False, num_beams=num_beams,
            num_return_sequences=n, length_penalty=length_penalty, early_stopping=early_stopping,
            eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id,
            return_dict_in_generate=True, output_scores=True,
        )
    seqs = []
    for row in out.sequences[:, len(ids):].tolist():
        # Shorter hypotheses are padded with the EOS id: keep up to the first one.
        if tok.eos_token_id in row:
            row = row[: row.index(tok.eos_token_id) + 1]
        seqs.append(row)
    return seqs, out.sequences_scores.tolist()


# prompt_logprobs: one forward over the whole prompt, float32 log-softmax of each position's
# logits, for the token that follows it: its log-probability, its rank (1 + how many tokens
# are more likely) and the PROMPT_TOP most likely tokens.
PROMPT_TOP = 8


def prompt_logprobs(ids):
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    lp = torch.log_softmax(logits, dim=-1)
    rows = []
    for i in range(1, len(ids)):
        row, t = lp[i - 1], ids[i]
        top = torch.topk(row, PROMPT_TOP)
        rows.append({
            "token_id": t, "logprob": row[t].item(), "rank": int((row > row[t]).sum().item()) + 1,
            "top": [[j, v] for j, v in zip(top.indices.tolist(), top.values.tolist())],
        })
    return rows


def decoded(ids):
    return tok.decode(ids, skip_special_tokens=True)


golden = {"model": f, "prompts": [], "chats": [], "tokenizer": [], "beams": []}
for p in PROMPTS:
    ids = tok(p, add_special_tokens=True)["input_ids"]
    cont = greedy(ids)
    golden["prompts"].append({"text": p, "prompt_ids": ids, "output_ids": cont, "output_text": decoded(cont)})
for msgs in CHATS:
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    cont = greedy(ids)
    golden["chats"].append(
        {"messages": msgs, "prompt_text": text, "prompt_ids": ids, "output_ids": cont, "output_text": decoded(cont)}
    )
for t in TOKENIZER_TEXTS:
    ids = tok(t, add_special_tokens=False)["input_ids"]
    golden["tokenizer"].append({"text": t, "ids": ids, "decoded": tok.decode(ids)})
for prompt, num_beams, n, lp, es, max_new in BEAMS:
    if isinstance(prompt, str):
        ids = tok(prompt, add_special_tokens=True)["input_ids"]
    else:
        text = tok.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
        ids = tok(text, add_special_tokens=False)["input_ids"]
    seqs, scores = beam(ids, num_beams, n, lp, es, max_new)
    golden["beams"].append({
        "prompt_ids": ids, "num_beams": num_beams, "n": n, "length_penalty": lp,
        "early_stopping": es, "max_tokens": max_new, "output_ids": seqs, "scores": scores,
    })
golden["prompt_logprobs"] = []
for p in PROMPTS + [CHATS[0]]:
    if isinstance(p, str):
        ids = tok(p, add_special_tokens=True)["input_ids"]
    else:
        ids = tok(tok.apply_chat_template(p, tokenize=False, add_generation_prompt=True), add_special_tokens=False)["input_ids"]
    golden["prompt_logprobs"].append({"prompt_ids": ids, "positions": prompt_logprobs(ids)})
with open(out, "w") as fh:
    json.dump(golden, fh, ensure_ascii=False, indent=1)
print("wrote", out)
