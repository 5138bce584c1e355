"""A tiny deterministic Llama model with a byte-level tokenizer, built locally.

It lets a machine with no network (and no GPU) run the real vLLM engine end to end.
Its text is gibberish, but it is a pure function of the prompt, which is all the
tests and the resume machinery need. Weights are seeded, so every machine that builds
the same spec gets the same model, in a directory named after a hash of that spec.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from config import TINY_MODEL_NAME

# Bump when the build changes in a way the spec below does not capture.
BUILD_VERSION = 1

SPECIAL_TOKENS = ["<|bos|>", "<|eos|>", "<|system|>", "<|user|>", "<|assistant|>"]
BOS, EOS = SPECIAL_TOKENS[0], SPECIAL_TOKENS[1]

# Role markers are special tokens; any other role falls back to bytes ("<|tool|>").
# List-valued content (OpenAI content parts) is flattened to its text parts. Tools and
# tool calls are written as Hermes models write them, so vLLM's `hermes` tool parser
# reads what the model says (engine/model_spec.py).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}{{ '<|system|>' }}<tools>"
    "{% for tool in tools %}{{ tool | tojson }}{% endfor %}</tools>\n{% endif %}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% elif message['content'] %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{% for call in message['tool_calls'] or [] %}"
    "<tool_call>{{ {'name': call['function']['name'], 'arguments': call['function']['arguments']} | tojson }}"
    "</tool_call>{% endfor %}"
    "{{ '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)

TOOL_CALL_PARSER = "hermes"  # what reads the tool calls the template above writes

SPEC: dict[str, Any] = {
    "build_version": BUILD_VERSION,
    "seed": 1234,
    "vocab_size": 256 + len(SPECIAL_TOKENS),
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "head_dim": 64,  # vLLM's CPU attention needs head_dim >= 64
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    # Init scales (std of a unit-RMS input's projection). Layers strong enough that
    # the output depends on the whole context, not just the last token...
    "layer_gain": 1.0,
    # ...and logits spread wide (std ~ logit_std) so greedy top-1 is rarely a near-tie,
    # even under the float noise of different batch compositions.
    "logit_std": 12.0,
    # EOS's logit std relative to byte tokens': lower means rarer EOS.
    "eos_gain": 0.75,
    "special_tokens": SPECIAL_TOKENS,
    "chat_template": CHAT_TEMPLATE,
}


def spec_hash(max_model_len: int, seed: int = SPEC["seed"]) -> str:
    blob = json.dumps({**SPEC, "max_model_len": max_model_len, "seed": seed}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def tiny_model_dir(models_dir: Path, max_model_len: int = 2048, seed: int = SPEC["seed"]) -> Path:
    """Where the tiny model for `max_model_len` is (or will be) built."""
    return Path(models_dir) / f"{TINY_MODEL_NAME}-{spec_hash(max_model_len, seed)}"


def build_tiny_model(models_dir: Path, max_model_len: int = 2048, seed: int = SPEC["seed"]) -> Path:
    """Build (once) and return the directory of the tiny model for `max_model_len`. Another
    `seed` is another model (same shape and tokenizer, other weights): what a deployment
    of several models is tested with."""
    models_dir = Path(models_dir)
    final = tiny_model_dir(models_dir, max_model_len, seed)
    if final.is_dir():
        return final
    models_dir.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename into place: rename is atomic, so readers
    # never see a half-written model and concurrent builders cannot clash.
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=models_dir))
    try:
        _write_model(tmp, max_model_len, seed)
        os.rename(tmp, final)
    except OSError:
        if not final.is_dir():  # someone else winning the race is fine; anything else is not
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _write_model(out: Path, max_model_len: int, seed: int) -> None:
    tok = _write_tokenizer(out)
    s = SPEC
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": s["vocab_size"],
        "hidden_size": s["hidden_size"],
        "intermediate_size": s["intermediate_size"],
        "num_hidden_layers": s["num_hidden_layers"],
        "num_attention_heads": s["num_attention_heads"],
        "num_key_value_heads": s["num_attention_heads"],
        "head_dim": s["head_dim"],
        "hidden_act": "silu",
        "max_position_embeddings": max_model_len,
        "rms_norm_eps": s["rms_norm_eps"],
        "rope_theta": s["rope_theta"],
        "rope_parameters": {"rope_type": "default", "rope_theta": s["rope_theta"]},
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": tok[BOS],
        "eos_token_id": tok[EOS],
        "pad_token_id": tok[EOS],
        "dtype": "float32",
        "torch_dtype": "float32",
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))
    generation = {"bos_token_id": tok[BOS], "eos_token_id": tok[EOS], "pad_token_id": tok[EOS]}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2))
    _write_weights(out, tok, seed)


def _write_tokenizer(out: Path) -> dict[str, int]:
    """Byte-level BPE with no merges: every byte is a token, so any string round-trips."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    byte_chars = pre_tokenizers.ByteLevel.alphabet()  # the 256 printable stand-ins for bytes
    # Order by byte value so token id == byte value (handy when reading outputs).
    byte_to_char = _bytes_to_unicode()
    vocab = {byte_to_char[b]: b for b in range(256)}
    assert set(vocab) == set(byte_chars)
    for i, t in enumerate(SPECIAL_TOKENS):
        vocab[t] = 256 + i

    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    # use_regex=False: no word splitting, nothing but bytes; add_prefix_space=False keeps
    # decode(encode(s)) == s.
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens(SPECIAL_TOKENS)
    # Plain encodes (completions) start with BOS, like Llama's tokenizers.
    tk.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tk,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=EOS,
        chat_template=CHAT_TEMPLATE,
        model_max_length=10**9,
        clean_up_tokenization_spaces=False,
    )
    fast.save_pretrained(out)
    return vocab


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (what ByteLevel uses)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


def _write_weights(out: Path, tok: dict[str, int], seed: int) -> None:
    import torch
    from safetensors.torch import save_file

    s = SPEC
    h, inter, v = s["hidden_size"], s["intermediate_size"], s["vocab_size"]
    g = torch.Generator().manual_seed(seed)

    def normal(rows: int, cols: int, std: float) -> torch.Tensor:
        return (torch.randn(rows, cols, generator=g, dtype=torch.float32) * std).contiguous()

    # A projection of a unit-RMS input with std gain/sqrt(fan_in) has output RMS ~ gain.
    def proj(rows: int, cols: int, gain: float = s["layer_gain"]) -> torch.Tensor:
        return normal(rows, cols, gain / cols**0.5)

    w: dict[str, torch.Tensor] = {"model.embed_tokens.weight": normal(v, h, 1.0)}
    for i in range(s["num_hidden_layers"]):
        p = f"model.layers.{i}."
        # q/k a bit larger than unit gain so attention is not near-uniform.
        w[p + "self_attn.q_proj.weight"] = proj(h, h, 2.0)
        w[p + "self_attn.k_proj.weight"] = proj(h, h, 2.0)
        w[p + "self_attn.v_proj.weight"] = proj(h, h)
        w[p + "self_attn.o_proj.weight"] = proj(h, h)
        w[p + "mlp.gate_proj.weight"] = proj(inter, h)
        w[p + "mlp.up_proj.weight"] = proj(inter, h)
        w[p + "mlp.down_proj.weight"] = proj(h, inter)
        w[p + "input_layernorm.weight"] = torch.ones(h)
        w[p + "post_attention_layernorm.weight"] = torch.ones(h)
    w["model.norm.weight"] = torch.ones(h)

    lm_head = proj(v, h, s["logit_std"])
    # Never generate BOS or role markers; make EOS possible but rare.
    for t in SPECIAL_TOKENS:
        lm_head[tok[t]] = 0.0
    lm_head[tok[EOS]] = proj(1, h, s["logit_std"] * s["eos_gain"])[0]
    w["lm_head.weight"] = lm_head
    save_file(w, str(out / "model.safetensors"), metadata={"format": "pt"})
