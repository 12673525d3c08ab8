"""A tiny local model built on the spot: real byte-level BPE tokenizer, random Llama weights.

Tests, the demo and benchmarks use it instead of downloading anything. One build writes the
same weights twice: as a Hugging Face folder (config.json, model.safetensors, tokenizer files,
generation_config.json) and as a llama.cpp GGUF, so both engines serve the very same model.
Building needs only numpy, tokenizers, safetensors and gguf — never torch or transformers.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

BUILD_VERSION = "gengate-tiny-v1"
MARKER_FILE = "BUILD"
GGUF_NAME = "tiny.gguf"
HF_DIR_NAME = "hf"

PAD_TOKEN = "<|pad|>"
BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|im_end|>"
IM_START_TOKEN = "<|im_start|>"
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, IM_START_TOKEN)

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass(frozen=True)
class TinyConfig:
    """Shape of the tiny Llama; small enough to build in well under a second."""

    vocab_size: int = 1024
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    context_length: int = 2048
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # Made-up words added to the tokenizer's training text: a vocabulary of real size needs far
    # more distinct text than the few KB the tiny one is trained on (see `synthetic_words`).
    extra_words: int = 0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


TINY = TinyConfig()
# The same model family with head_dim 64: vLLM's attention kernels (CPU and CUDA) take head sizes
# from 32 up, not the 16 of TINY. Used by the vLLM tests and benchmarks.
TINY_VLLM = TinyConfig(hidden_size=128, intermediate_size=256, num_heads=2, num_kv_heads=1)
# A real-size vocabulary (32k, as Llama 2 and Mistral) on a still-small model, for benchmarks where
# the mask over the vocabulary costs what it costs on real models (the tiny model's 1024 hide it).
BENCH_32K = TinyConfig(
    vocab_size=32768, hidden_size=256, intermediate_size=512, num_layers=4, num_heads=4, extra_words=120_000
)


@dataclass(frozen=True)
class TinyModelPaths:
    """Where a built tiny model lives: a Hugging Face folder and a GGUF file of the same weights."""

    hf_dir: Path
    gguf_path: Path


_ENGLISH = """\
The quick brown fox jumps over the lazy dog. A model reads a prompt and writes an answer.
Hello, world! How are you today? I am fine, thank you. What is your name? My name is Ada.
The weather is sunny and warm. It will rain tomorrow in the city, so take an umbrella.
Please write a short story about a robot who learns to paint. Once upon a time there was
a small robot named Bolt. Bolt lived in a quiet town near the sea and loved the colours of
the sky. Every morning it walked to the harbour, watched the boats and counted the birds.
Questions and answers: Who wrote the letter? She did. Where is the key? On the table.
When does the train leave? At nine o'clock. Why is the sky blue? Because of scattering.
The user asks the assistant for help. The assistant answers politely and clearly.
You are a helpful assistant. Answer in one sentence. Summarize the following text.
Translate to French: good morning, good night, thank you, please, yes, no, maybe.
Numbers: one two three four five six seven eight nine ten eleven twelve hundred thousand.
Colours: red green blue yellow orange purple black white grey pink brown.
Days: Monday Tuesday Wednesday Thursday Friday Saturday Sunday. Months: January March May.
Positive, negative, neutral. True or false. Yes or no. Good, bad, great, terrible, okay.
"""

_RECORDS: list[dict[str, Any]] = [
    {"name": "Ada Lovelace", "age": 36, "email": "ada@example.com", "active": True},
    {"id": 1, "title": "First post", "tags": ["news", "tech"], "score": 4.5, "draft": False},
    {"city": "Paris", "country": "France", "population": 2161000, "coordinates": [48.85, 2.35]},
    {"user": {"id": 42, "name": "Bob", "roles": ["admin", "user"]}, "created_at": "2024-01-31"},
    {"sentiment": "positive", "confidence": 0.93, "labels": ["joy", "trust"], "value": None},
    {"items": [{"sku": "A-100", "qty": 2, "price": 9.99}, {"sku": "B-7", "qty": 1, "price": 0.5}]},
    {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]},
    {"description": "a short text", "status": "ok", "count": 0, "total": -17, "ratio": 1e-3},
    {"date": "2025-12-24", "time": "18:30:00", "uuid": "123e4567-e89b-12d3-a456-426614174000"},
    {"key": "value", "list": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], "nested": {"a": {"b": {"c": "d"}}}},
]


def synthetic_words(count: int, seed: int = 0) -> list[str]:
    """`count` pronounceable made-up words (seeded): text with enough distinct pieces for a
    tokenizer to learn tens of thousands of merges."""
    rng = np.random.default_rng(seed)
    onsets = ["", "b", "br", "c", "ch", "d", "f", "g", "gr", "h", "j", "k", "l", "m", "n", "p", "pr",
              "qu", "r", "s", "sh", "st", "t", "th", "tr", "v", "w", "z"]  # fmt: skip
    vowels = ["a", "e", "i", "o", "u", "ai", "ea", "ou", "ie", "oo"]
    codas = ["", "n", "r", "s", "t", "l", "m", "nd", "st", "ck", "ng", "x"]
    words = []
    for _ in range(count):
        syllables = int(rng.integers(1, 5))
        words.append(
            "".join(
                onsets[rng.integers(len(onsets))]
                + vowels[rng.integers(len(vowels))]
                + codas[rng.integers(len(codas))]
                for _ in range(syllables)
            )
        )
    return words


def _corpus(config: TinyConfig = TINY) -> list[str]:
    """A few KB of English-ish and JSON-ish text so both tokenize into sensible pieces, plus
    `config.extra_words` made-up words for a vocabulary of real size."""
    lines = _ENGLISH.splitlines()
    for record in _RECORDS:
        lines.append(json.dumps(record))
        lines.append(json.dumps(record, indent=2))
        lines.append(json.dumps(record, separators=(",", ":")))
    lines.extend(" ".join(str(n) for n in range(k, k + 40)) for k in (0, 100, 1000, 2020))
    words = synthetic_words(config.extra_words)
    lines.extend(" ".join(words[i : i + 12]) for i in range(0, len(words), 12))
    return lines


def _build_hash(seed: int, config: TinyConfig = TINY) -> str:
    """Identifies one build: changes whenever the corpus, shape, template or seed change."""
    digest = hashlib.sha256()
    for part in (BUILD_VERSION, str(seed), repr(config), CHAT_TEMPLATE, *SPECIAL_TOKENS, *_corpus(config)):
        digest.update(part.encode())
        digest.update(b"\0")
    return digest.hexdigest()


def default_tiny_dir() -> Path:
    """`$GENGATE_CACHE/tiny`, or `~/.cache/gengate/tiny`."""
    cache = os.environ.get("GENGATE_CACHE")
    base = Path(cache).expanduser() if cache else Path.home() / ".cache" / "gengate"
    return base / "tiny"


def _paths(dest: Path) -> TinyModelPaths:
    return TinyModelPaths(hf_dir=dest / HF_DIR_NAME, gguf_path=dest / GGUF_NAME)


def _is_built(dest: Path, build_hash: str) -> bool:
    marker = dest / MARKER_FILE
    try:
        return marker.read_text().strip() == build_hash
    except OSError:
        return False


def build_tiny_model(dest: Path, *, seed: int = 0, config: TinyConfig = TINY) -> TinyModelPaths:
    """Builds the tiny model into `dest` (or reuses a finished build of the same version and seed).

    The build goes to a temporary sibling folder that is renamed into place, so concurrent
    builders never see, or leave, a half-written model. Same seed ⇒ byte-identical files.
    """
    dest = Path(dest).expanduser().absolute()
    build_hash = _build_hash(seed, config)
    if _is_built(dest, build_hash):
        return _paths(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.build-", dir=dest.parent))
    try:
        tmp.chmod(0o755)
        _write_model(tmp, seed, config)
        (tmp / MARKER_FILE).write_text(build_hash + "\n")
        _install(tmp, dest, build_hash)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return _paths(dest)


def build_tiny_lora(
    dest: Path, *, config: TinyConfig = TINY_VLLM, rank: int = 8, seed: int = 0, scale: float = 0.5
) -> Path:
    """Builds a LoRA adapter for the tiny model in PEFT's format (adapter_config.json and
    adapter_model.safetensors, random A and B on every layer's q_proj and v_proj), large enough
    to change what the model writes: what vLLM loads as a LoRA adapter. Same seed ⇒ same files."""
    from safetensors.numpy import save_file

    dest = Path(dest).expanduser().absolute()
    build_hash = hashlib.sha256(f"{BUILD_VERSION}-lora {config!r} {rank} {seed} {scale}".encode()).hexdigest()
    if _is_built(dest, build_hash):
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.build-", dir=dest.parent))
    try:
        tmp.chmod(0o755)
        rng = np.random.default_rng(seed)
        kv_dim = config.num_kv_heads * config.head_dim
        tensors: dict[str, npt.NDArray[np.float32]] = {}
        for layer in range(config.num_layers):
            for module, out_dim in (("q_proj", config.hidden_size), ("v_proj", kv_dim)):
                prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
                a = rng.normal(0.0, scale, (rank, config.hidden_size))
                b = rng.normal(0.0, scale, (out_dim, rank))
                tensors[f"{prefix}.lora_A.weight"] = a.astype(np.float32)
                tensors[f"{prefix}.lora_B.weight"] = b.astype(np.float32)
        save_file(tensors, str(tmp / "adapter_model.safetensors"))
        adapter_config = {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "r": rank,
            "lora_alpha": 2 * rank,
            "lora_dropout": 0.0,
            "target_modules": ["q_proj", "v_proj"],
            "bias": "none",
            "fan_in_fan_out": False,
            "use_rslora": False,
            "use_dora": False,
            "modules_to_save": None,
        }
        (tmp / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2) + "\n")
        (tmp / MARKER_FILE).write_text(build_hash + "\n")
        _install(tmp, dest, build_hash)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def _install(tmp: Path, dest: Path, build_hash: str) -> None:
    """Renames a finished build into place, replacing a stale build; a concurrent winner is kept."""
    for _ in range(3):
        try:
            os.rename(tmp, dest)
            return
        except OSError:
            if _is_built(dest, build_hash):
                return
        # dest holds a stale or broken build: move it aside, then retry the rename.
        stale = Path(tempfile.mkdtemp(prefix=f".{dest.name}.stale-", dir=dest.parent))
        try:
            os.rename(dest, stale / "old")
        except OSError:
            pass
        shutil.rmtree(stale, ignore_errors=True)
    if not _is_built(dest, build_hash):
        raise RuntimeError(f"could not install the tiny model into {dest}")


# -- tokenizer ---------------------------------------------------------------------------------


def _train_tokenizer(config: TinyConfig) -> Any:
    """Trains a byte-level BPE (GPT-2 pre-tokenizer, no prefix space) with the special tokens first."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=config.vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(config), trainer=trainer)
    return tokenizer


def _tokenizer_vocab(tokenizer: Any) -> tuple[list[str], list[str]]:
    """(tokens ordered by id, merges as "a b" strings) read back from the trained tokenizer."""
    spec = json.loads(tokenizer.to_str())
    vocab: dict[str, int] = spec["model"]["vocab"]
    for added in spec["added_tokens"]:
        vocab[added["content"]] = added["id"]
    tokens = [""] * len(vocab)
    for token, index in vocab.items():
        tokens[index] = token
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    return tokens, merges


def _write_tokenizer_files(hf_dir: Path, tokenizer: Any, config: TinyConfig) -> None:
    tokenizer.save(str(hf_dir / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "additional_special_tokens": [IM_START_TOKEN],
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": config.context_length,
        "chat_template": CHAT_TEMPLATE,
    }
    _write_json(hf_dir / "tokenizer_config.json", tokenizer_config)
    _write_json(
        hf_dir / "special_tokens_map.json",
        {
            "bos_token": BOS_TOKEN,
            "eos_token": EOS_TOKEN,
            "pad_token": PAD_TOKEN,
            "additional_special_tokens": [IM_START_TOKEN],
        },
    )


# -- weights -----------------------------------------------------------------------------------

Weights = dict[str, npt.NDArray[np.float32]]


def _random_weights(config: TinyConfig, seed: int) -> Weights:
    """Llama weights in Hugging Face naming, (out, in) layout, scaled so logits are not flat."""
    rng = np.random.default_rng(seed)

    def linear(out_features: int, in_features: int, gain: float = 1.0) -> npt.NDArray[np.float32]:
        scale = gain / float(np.sqrt(in_features))
        return (rng.standard_normal((out_features, in_features)) * scale).astype(np.float32)

    def norm(size: int) -> npt.NDArray[np.float32]:
        return (1.0 + 0.1 * rng.standard_normal(size)).astype(np.float32)

    h, ffn, kv = config.hidden_size, config.intermediate_size, config.num_kv_heads * config.head_dim
    weights: Weights = {
        "model.embed_tokens.weight": rng.standard_normal((config.vocab_size, h)).astype(np.float32)
    }
    for i in range(config.num_layers):
        prefix = f"model.layers.{i}"
        weights[f"{prefix}.input_layernorm.weight"] = norm(h)
        weights[f"{prefix}.self_attn.q_proj.weight"] = linear(h, h, 2.0)
        weights[f"{prefix}.self_attn.k_proj.weight"] = linear(kv, h, 2.0)
        weights[f"{prefix}.self_attn.v_proj.weight"] = linear(kv, h)
        weights[f"{prefix}.self_attn.o_proj.weight"] = linear(h, h)
        weights[f"{prefix}.post_attention_layernorm.weight"] = norm(h)
        weights[f"{prefix}.mlp.gate_proj.weight"] = linear(ffn, h)
        weights[f"{prefix}.mlp.up_proj.weight"] = linear(ffn, h)
        weights[f"{prefix}.mlp.down_proj.weight"] = linear(h, ffn)
    weights["model.norm.weight"] = norm(h)
    weights["lm_head.weight"] = linear(config.vocab_size, h, 3.0)
    return weights


def _hf_config(config: TinyConfig) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": SPECIAL_TOKENS.index(BOS_TOKEN),
        "eos_token_id": SPECIAL_TOKENS.index(EOS_TOKEN),
        "pad_token_id": SPECIAL_TOKENS.index(PAD_TOKEN),
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "hidden_size": config.hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": config.intermediate_size,
        "max_position_embeddings": config.context_length,
        "mlp_bias": False,
        "num_attention_heads": config.num_heads,
        "num_hidden_layers": config.num_layers,
        "num_key_value_heads": config.num_kv_heads,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_parameters": {"rope_theta": config.rope_theta, "rope_type": "default"},
        "rope_theta": config.rope_theta,
        "tie_word_embeddings": False,
        "dtype": "float32",
        "use_cache": True,
        "vocab_size": config.vocab_size,
    }


def _permute_for_llamacpp(weight: npt.NDArray[np.float32], n_head: int) -> npt.NDArray[np.float32]:
    """llama.cpp applies rotary embeddings to interleaved pairs; HF to halves (as convert_hf_to_gguf)."""
    out_features = weight.shape[0]
    return np.ascontiguousarray(
        weight.reshape(n_head, 2, out_features // n_head // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


_GGUF_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def _write_gguf(
    path: Path, weights: Weights, tokens: list[str], merges: list[str], config: TinyConfig
) -> None:
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("gengate-tiny")
    writer.add_context_length(config.context_length)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_head_count(config.num_heads)
    writer.add_head_count_kv(config.num_kv_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_vocab_size(config.vocab_size)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)

    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types(
        [gguf.TokenType.CONTROL if t in SPECIAL_TOKENS else gguf.TokenType.NORMAL for t in tokens]
    )
    writer.add_token_merges(merges)
    writer.add_bos_token_id(SPECIAL_TOKENS.index(BOS_TOKEN))
    writer.add_eos_token_id(SPECIAL_TOKENS.index(EOS_TOKEN))
    writer.add_pad_token_id(SPECIAL_TOKENS.index(PAD_TOKEN))
    writer.add_add_bos_token(False)
    writer.add_add_eos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)

    writer.add_tensor("token_embd.weight", weights["model.embed_tokens.weight"])
    for i in range(config.num_layers):
        for hf_name, gguf_name in _GGUF_LAYER_NAMES.items():
            tensor = weights[f"model.layers.{i}.{hf_name}.weight"]
            if hf_name == "self_attn.q_proj":
                tensor = _permute_for_llamacpp(tensor, config.num_heads)
            elif hf_name == "self_attn.k_proj":
                tensor = _permute_for_llamacpp(tensor, config.num_kv_heads)
            writer.add_tensor(f"blk.{i}.{gguf_name}.weight", tensor)
    writer.add_tensor("output_norm.weight", weights["model.norm.weight"])
    writer.add_tensor("output.weight", weights["lm_head.weight"])

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _write_model(root: Path, seed: int, config: TinyConfig = TINY) -> None:
    """Writes the HF folder and the GGUF of one seeded model into `root`."""
    from safetensors.numpy import save_file

    hf_dir = root / HF_DIR_NAME
    hf_dir.mkdir()
    tokenizer = _train_tokenizer(config)
    tokens, merges = _tokenizer_vocab(tokenizer)
    if len(tokens) != config.vocab_size:
        raise RuntimeError(f"tokenizer trained {len(tokens)} tokens, expected {config.vocab_size}")
    _write_tokenizer_files(hf_dir, tokenizer, config)

    weights = _random_weights(config, seed)
    save_file(weights, str(hf_dir / "model.safetensors"), metadata={"format": "pt"})
    _write_json(hf_dir / "config.json", _hf_config(config))
    _write_json(
        hf_dir / "generation_config.json",
        {
            "bos_token_id": SPECIAL_TOKENS.index(BOS_TOKEN),
            "eos_token_id": SPECIAL_TOKENS.index(EOS_TOKEN),
            "pad_token_id": SPECIAL_TOKENS.index(PAD_TOKEN),
            "do_sample": True,
        },
    )
    _write_gguf(root / GGUF_NAME, weights, tokens, merges, config)
