"""Makes tests/fixtures/models/*.json: greedy references from Hugging Face transformers for
tiny models of every architecture the engine registers.

Each model is built by transformers from a small config; its weights are then overwritten
with values from a counter-based generator (splitmix64 of the parameter's name and index)
that actorllm::models::random::write_golden_model reproduces bit for bit, so that only this script and the
JSON files are committed, never weights. For each model the file records the config,
every parameter's name and shape, and for several prompts the greedy continuation (24
tokens, EOS ignored) with the top-5 logprobs of every step, computed in float32 with eager
attention. Prompts are kept only where every step's best token leads the runner-up by at
least MIN_GAP in logprob, so that float noise cannot flip an argmax; some are longer than
the model's sliding window, where it has one, or than the context its rotary embedding
changes at (dynamic NTK, LongRoPE), where it has one; the short ones generate past it.

    python scripts/make_model_goldens.py tests/fixtures/models [MODEL ...]

(granite, which examples/granite.rs registers out of tree, goes to tests/fixtures/out-of-tree/.
The models of KV_FP8 are run a second time with an FP8 KV cache, into tests/fixtures/kv-fp8/,
the first also with per-layer KV cache scales in its checkpoint (`kv_scales` in the file,
written as scalar tensors beside the weights); then with an e5m2 cache (`fp8_e5m2`, files
named *-e5m2.json), and the first with vLLM's --calculate-kv-scales over an e5m2 cache
(each layer's scales from the first keys and values it stores, *-calculated.json); name
`kv-fp8` to make only those.)
"""
import contextlib
import json
import math
import os
import sys
import tempfile

import numpy as np
import torch
import transformers

TOKENS = 24
PROMPTS = 4
MIN_GAP = 2e-3
VOCAB = 320
M64 = (1 << 64) - 1


def fnv1a64(s):
    h = 0xCBF29CE484222325
    for b in s.encode():
        h ^= b
        h = (h * 0x100000001B3) & M64
    return h


def uniform(name, n):
    """n values in [0, 1) with 24 bits each: splitmix64 of (fnv1a64(name) + i · golden)."""
    with np.errstate(over="ignore"):
        z = np.uint64(fnv1a64(name)) + np.arange(n, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(40)).astype(np.float32) / np.float32(1 << 24)


def values(name, shape, embed_scale):
    """A parameter's values, by its kind (the rule hf_weights.rs follows); embeddings are
    uniform in ±embed_scale (small for models whose tied head would otherwise only echo
    the last token)."""
    n = int(np.prod(shape))
    u = uniform(name, n) - np.float32(0.5)
    leaf = name.rsplit(".", 1)[0].rsplit(".", 1)[-1]
    if name.endswith(".bias"):
        v = u * np.float32(0.2)
    elif "norm" in leaf:
        v = np.float32(1.0) + u * np.float32(0.2)
    elif "embed" in leaf:
        v = u * np.float32(2.0 * embed_scale)
    else:
        v = u * np.float32(2.0 * math.sqrt(3.0 / shape[-1]))
    return torch.from_numpy(v.astype(np.float32).reshape(shape))


BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
            tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)

MODELS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(
        rope_theta=10000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64})),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=16)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(
        use_sliding_window=True, sliding_window=16, max_window_layers=1,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128})),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(
        rope_scaling={"rope_type": "linear", "factor": 2.0})),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(hidden_act="gelu_pytorch_tanh", tie_word_embeddings=True)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(
        hidden_activation="gelu_pytorch_tanh", sliding_window=16, query_pre_attn_scalar=24,
        attn_logit_softcapping=5.0, final_logit_softcapping=10.0, tie_word_embeddings=True)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        hidden_activation="gelu_pytorch_tanh", sliding_window=16, query_pre_attn_scalar=16,
        sliding_window_pattern=2, rope_local_base_freq=10000.0, rope_theta=100000.0,
        rope_scaling={"rope_type": "linear", "factor": 4.0}, tie_word_embeddings=True)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(
        max_position_embeddings=1024, original_max_position_embeddings=256, sliding_window=16,
        partial_rotary_factor=0.5,
        rope_scaling={"type": "longrope", "short_factor": [1.0, 1.1, 1.3, 1.6], "long_factor": [2.0, 3.0, 4.0, 5.0]})),
    # LongRoPE past its original context: forwards longer than 16 tokens take the long
    # factors (keys cached before keep their rotation).
    "phi3-longrope": ("Phi3Config", "Phi3ForCausalLM", dict(
        max_position_embeddings=1024, original_max_position_embeddings=16, partial_rotary_factor=0.5,
        rope_scaling={"type": "longrope", "short_factor": [1.0, 1.1, 1.3, 1.6], "long_factor": [2.0, 3.0, 4.0, 5.0]})),
    # Dynamic NTK past max_position_embeddings: the base grows with each forward's length.
    "llama-dynamic": ("LlamaConfig", "LlamaForCausalLM", dict(
        max_position_embeddings=24, rope_scaling={"rope_type": "dynamic", "factor": 4.0})),
    "opt": ("OPTConfig", "OPTForCausalLM", dict(
        ffn_dim=128, word_embed_proj_dim=32, do_layer_norm_before=True, num_key_value_heads=None, head_dim=None,
        intermediate_size=None, max_position_embeddings=512, tie_word_embeddings=True)),
    # Not built in: served by examples/granite.rs, an architecture registered out of tree.
    "granite": ("GraniteConfig", "GraniteForCausalLM", dict(
        embedding_multiplier=3.0, attention_multiplier=0.2, residual_multiplier=0.5, logits_scaling=2.5)),
    "opt-post-norm": ("OPTConfig", "OPTForCausalLM", dict(
        ffn_dim=128, do_layer_norm_before=False, num_key_value_heads=None, head_dim=None,
        intermediate_size=None, max_position_embeddings=512, tie_word_embeddings=True)),
    # Mixture-of-experts: 8 experts, top-2, a sliding window.
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(
        intermediate_size=48, num_local_experts=8, num_experts_per_tok=2, sliding_window=16)),
    # A shared expert with its sigmoid gate, top-k weights not renormalized, and a dense MLP
    # on the layer mlp_only_layers names.
    "qwen2-moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
        norm_topk_prob=False, mlp_only_layers=[1])),
    # q/k norms, top-k weights renormalized.
    "qwen3-moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)),
}

# Architectures whose experts transformers keeps fused in memory: built from a checkpoint
# in the layout their hub files use (one tensor per expert), as the engine reads them.
MOE = {"mixtral", "qwen2-moe", "qwen3-moe"}

# The least margin, in router probability, between the last expert a token takes and the
# first it does not, so that float noise cannot change a route.
MIN_ROUTER_GAP = 1e-4


OUT_OF_TREE = {"granite"}

# The lengths of the long prompts where they are not the sliding window's: past the context
# the rotary embedding changes at.
LONG_PROMPTS = {"phi3-longrope": (18, 30), "llama-dynamic": (26, 40)}

# Gemma scales its embeddings by √hidden and ties its head: with ±1 embeddings the residual
# is the last token's embedding and every step repeats it.
EMBED_SCALE = {"gemma": 0.05, "gemma2": 0.05, "gemma3": 0.05, "opt-post-norm": 4.0}
# Run again with every key and value rounded to FP8 as it enters the cache (vLLM's
# --kv-cache-dtype fp8 without calibrated scales): a plain model, and one with soft caps and
# alternating sliding windows.
KV_FP8 = ["llama", "gemma2"]
# The least distance, as a share of the gap between the two FP8 values around it, from any
# key or value to the midpoint where its rounding turns: a value nearer than float noise
# could round either way in another implementation.
MIN_KV_MARGIN = 3e-5
# The least such distance of the keys and values rounded since the last run.
KV_MARGIN = [float("inf")]
# Each FP8 format: its torch dtype, mantissa bits, least normal value and largest value.
FP8 = {"fp8": (torch.float8_e4m3fn, 3, 2.0 ** -6, 448.0),
       "fp8_e5m2": (torch.float8_e5m2, 2, 2.0 ** -14, 57344.0)}
# --calculate-kv-scales: each layer's (k_scale, v_scale), max |k| / 200 and max |v| / 100
# (vLLM's K_SCALE_CONSTANT and V_SCALE_CONSTANT) of the first keys and values it stores, in
# f32 as the engine divides; cleared before each prompt (the test starts an engine a prompt).
CALCULATED = {}


def kv_margin(x, r, fmt):
    """The least distance of x's values from the rounding midpoint around them (r: their
    rounded values in format `fmt`), as a share of the gap there; saturated values are not
    counted."""
    _, bits, normal, top = FP8[fmt]
    a, b = x.abs().float(), r.abs().float()
    low = torch.minimum(a, b).clamp(min=normal)
    gap = torch.exp2(torch.floor(torch.log2(low)) - bits)
    frac = (a - b).abs() / gap
    inside = a < top
    return (0.5 - frac[inside]).min().item() if inside.any() else float("inf")


@contextlib.contextmanager
def fp8_kv_cache(scales=None, fmt="fp8", calculate=False):
    """transformers' cache stores each key and value rounded to FP8 (`fmt`: e4m3, or e5m2
    for "fp8_e5m2"; nearest even, saturated at the format's largest value), and attention
    reads them back from there, the step's own keys and values included. With `scales` (a
    (k_scale, v_scale) pair a layer, a checkpoint's) a key x is stored as fp8(x / k_scale)
    and read back as that times k_scale, as vLLM's FP8 cache does; else the scale is 1.
    With `calculate`, each layer's scales come from the first keys and values it stores
    (CALCULATED). KV_MARGIN keeps how near a rounding midpoint they came."""
    from transformers.cache_utils import Cache
    orig = Cache.__dict__["update"]
    dtype, _, _, top = FP8[fmt]

    def fp8(x, scale):
        y = x / scale
        r = y.clamp(-top, top).to(dtype).to(x.dtype)
        KV_MARGIN[0] = min(KV_MARGIN[0], kv_margin(y, r, fmt))
        return r * scale

    def first_scales(key_states, value_states):
        one = torch.tensor(1.0)
        ks, vs = key_states.abs().max() / 200.0, value_states.abs().max() / 100.0
        return (ks if ks > 0 else one, vs if vs > 0 else one)

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if calculate:
            if layer_idx not in CALCULATED:
                CALCULATED[layer_idx] = first_scales(key_states, value_states)
            ks, vs = CALCULATED[layer_idx]
        else:
            ks, vs = scales[layer_idx] if scales else (1.0, 1.0)
        return orig(self, fp8(key_states, ks), fp8(value_states, vs), layer_idx, *args, **kwargs)
    Cache.update = update
    try:
        yield
    finally:
        Cache.update = orig


def calibrated_kv_scales(model, ids):
    """Each layer's (k_scale, v_scale) as a calibration tool makes them: the largest
    magnitude of its keys (values) over a prompt, over 448, in float32."""
    from transformers.cache_utils import Cache
    orig = Cache.__dict__["update"]
    amax = {}

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        k, v = amax.get(layer_idx, (0.0, 0.0))
        amax[layer_idx] = (max(k, key_states.abs().max().item()), max(v, value_states.abs().max().item()))
        return orig(self, key_states, value_states, layer_idx, *args, **kwargs)
    Cache.update = update
    try:
        run(model, ids)
    finally:
        Cache.update = orig
    return [tuple(float(np.float32(a / 448.0)) for a in amax[i]) for i in sorted(amax)]


def kv_scale_tensors(scales):
    """The scales as a checkpoint holds them, under three writers' names: layer 0's as
    compressed-tensors writes them, layer 1's as NVIDIA ModelOpt does, and the rest as one
    older `kv_scale` a layer (the larger of the pair, for keys and values alike)."""
    tensors, used = {}, []
    for i, (k, v) in enumerate(scales):
        at = f"model.layers.{i}.self_attn."
        if i == 0:
            tensors.update({at + "k_scale": k, at + "v_scale": v})
        elif i == 1:
            tensors.update({at + "k_proj.k_scale": k, at + "v_proj.v_scale": v})
        else:
            k = v = max(k, v)
            tensors[at + "kv_scale"] = k
        used.append((k, v))
    return tensors, used


def build_moe(cls, cfg, embed_scale):
    """A mixture-of-experts model loaded from a checkpoint of the hub's layout (what
    save_pretrained writes), its tensors given the generator's values by their names there."""
    from safetensors import safe_open
    from safetensors.torch import save_file
    with tempfile.TemporaryDirectory() as d:
        torch.manual_seed(0)
        cls(cfg).save_pretrained(d)
        with safe_open(os.path.join(d, "model.safetensors"), "pt") as f:
            shapes = {k: list(f.get_slice(k).get_shape()) for k in f.keys()}
        params = [[k, shapes[k]] for k in sorted(shapes)]
        save_file({k: values(k, s, embed_scale) for k, s in params}, os.path.join(d, "model.safetensors"),
                  metadata={"format": "pt"})
        model = cls.from_pretrained(d, dtype=torch.float32, attn_implementation="eager").eval()
    routers = []
    for m in model.modules():
        if type(m).__name__.endswith("TopKRouter"):
            m.register_forward_hook(lambda mod, inp, out: routers.append((out[0].detach(), mod.top_k)))
    return model, params, routers


def router_gap(routers):
    """The least gap in probability between each token's k-th and (k+1)-th expert."""
    gap = float("inf")
    for logits, k in routers:
        p = torch.softmax(logits.float(), dim=-1).sort(dim=-1, descending=True).values
        gap = min(gap, (p[:, k - 1] - p[:, k]).min().item())
    routers.clear()
    return gap


def build(key, cfg_class, model_class, extra, embed_scale):
    kwargs = {k: v for k, v in {**BASE, **extra}.items() if v is not None}
    cfg = getattr(transformers, cfg_class)(**kwargs)
    cfg._attn_implementation = "eager"
    if key in MOE:
        model, params, routers = build_moe(getattr(transformers, model_class), cfg, embed_scale)
        model.generation_config.eos_token_id = None
        return cfg, model, params, routers
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(cfg).to(torch.float32).eval()
    tied = bool(getattr(cfg, "tie_word_embeddings", False))
    params = []
    with torch.no_grad():
        for name, p in model.state_dict().items():
            if tied and name == "lm_head.weight":
                continue
            p.copy_(values(name, list(p.shape), embed_scale))
            params.append([name, list(p.shape)])
        if tied:
            model.tie_weights()
    # EOS neither stops nor is masked: the engine's ignore_eos.
    model.generation_config.eos_token_id = None
    return cfg, model, params, None


def run(model, ids):
    # transformers keeps dynamic NTK's grown frequencies from one generate to the next: each
    # prompt starts from the original ones, as a fresh model (and the engine) would.
    for m in model.modules():
        if hasattr(m, "original_max_seq_len") and hasattr(m, "original_inv_freq"):
            m.max_seq_len_cached = m.original_max_seq_len
            m.register_buffer("inv_freq", m.original_inv_freq.clone(), persistent=False)
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=TOKENS, do_sample=False, num_beams=1,
                             output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    tokens = out.sequences[0, len(ids):].tolist()
    steps, gap = [], float("inf")
    for logits in out.logits:
        lp = torch.log_softmax(logits[0].float(), dim=-1)
        top = torch.topk(lp, 5)
        gap = min(gap, (top.values[0] - top.values[1]).item())
        steps.append([[int(i), float(v)] for v, i in zip(top.values, top.indices)])
    return tokens, steps, gap


def main(out_dir, only=None):
    os.makedirs(out_dir, exist_ok=True)
    for key in MODELS:
        if only and key not in only:
            continue
        make(key, out_dir)
    if not only or "kv-fp8" in only:
        where = os.path.join(os.path.dirname(out_dir.rstrip("/")), "kv-fp8")
        for key in KV_FP8:
            with fp8_kv_cache():
                make(key, where, kv_cache_dtype="fp8")
        # The same with a checkpoint's scales (calibrated on a prompt of its own).
        make(KV_FP8[0], where, kv_cache_dtype="fp8", scaled=True)
        for key in KV_FP8:
            with fp8_kv_cache(fmt="fp8_e5m2"):
                make(key, where, kv_cache_dtype="fp8_e5m2")
        # In e5m2: under e4m3 the largest key (stored as 200) and value (100) fall midway
        # between two bytes, where float noise picks either.
        with fp8_kv_cache(fmt="fp8_e5m2", calculate=True):
            make(KV_FP8[0], where, kv_cache_dtype="fp8_e5m2", calculated=True)


def make(key, where, kv_cache_dtype=None, scaled=False, calculated=False):
    cfg_class, model_class, extra = MODELS[key]
    rng = np.random.default_rng(fnv1a64(key) & 0xFFFFFFFF)
    embed_scale = EMBED_SCALE.get(key, 1.0)
    cfg, model, params, routers = build(key, cfg_class, model_class, extra, embed_scale)
    scale_tensors = None
    if scaled:
        calibration = [int(x) for x in np.random.default_rng(7).integers(3, VOCAB, 24)]
        scale_tensors, scales = kv_scale_tensors(calibrated_kv_scales(model, calibration))
        with fp8_kv_cache(scales):
            return make_runs(key, where, kv_cache_dtype, rng, (cfg, model, params, routers, extra, embed_scale),
                             scale_tensors)
    return make_runs(key, where, kv_cache_dtype, rng, (cfg, model, params, routers, extra, embed_scale), None,
                     calculated)


def make_runs(key, where, kv_cache_dtype, rng, built, scale_tensors, calculated=False):
    cfg, model, params, routers, extra, embed_scale = built
    model_class = MODELS[key][1]
    window = extra.get("sliding_window") or 0
    runs, tried = [], 0
    while len(runs) < PROMPTS and tried < 400:
        # Short prompts and, every other one, prompts past the sliding window.
        long = LONG_PROMPTS.get(key, (window + 4, window + 16))
        length = int(rng.integers(3, 9)) if tried % 2 == 0 else int(rng.integers(*long))
        tried += 1
        ids = [int(x) for x in rng.integers(3, VOCAB, length)]
        KV_MARGIN[0] = float("inf")
        CALCULATED.clear()
        tokens, steps, gap = run(model, ids)
        routed = routers is None or router_gap(routers) >= MIN_ROUTER_GAP
        rounded = not kv_cache_dtype or KV_MARGIN[0] >= MIN_KV_MARGIN
        if gap >= MIN_GAP and routed and rounded:
            runs.append({"prompt_ids": ids, "output_ids": tokens, "top_logprobs": steps, "min_gap": gap})
    assert len(runs) == PROMPTS, f"{key}: only {len(runs)} prompts with margins in {tried}"
    config = json.loads(cfg.to_json_string(use_diff=False))
    config["architectures"] = [model_class]
    golden = {"model": key, "transformers": transformers.__version__, "config": config, "params": params,
              "embed_scale": embed_scale,
              "tokens": TOKENS, "runs": runs}
    if kv_cache_dtype:
        golden["kv_cache_dtype"] = kv_cache_dtype
    if scale_tensors:
        golden["kv_scales"] = scale_tensors
    if calculated:
        golden["calculate_kv_scales"] = True
    # Architectures served out of tree go beside, in fixtures/out-of-tree/.
    if key in OUT_OF_TREE:
        where = os.path.join(os.path.dirname(where.rstrip("/")), "out-of-tree")
    os.makedirs(where, exist_ok=True)
    suffix = ("-scaled" if scale_tensors else "-calculated" if calculated
              else "-e5m2" if kv_cache_dtype == "fp8_e5m2" else "")
    path = os.path.join(where, f"{key}{suffix}.json")
    with open(path, "w") as fh:
        json.dump(golden, fh, separators=(",", ":"))
    print(key, "prompts", [len(r["prompt_ids"]) for r in runs], "tried", tried,
          "min gap", min(r["min_gap"] for r in runs),
          "distinct tokens", [len(set(r["output_ids"])) for r in runs], flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
