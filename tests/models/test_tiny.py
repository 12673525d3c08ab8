"""The tiny local model: reproducible builds, loadable by transformers and llama.cpp, same logits."""

from __future__ import annotations

import multiprocessing
import sys
from pathlib import Path

import numpy as np
import pytest
from gengate.models import tiny
from gengate.models.tiny import TinyModelPaths, build_tiny_model, default_tiny_dir

PROMPT = 'User: {"name": "Ada", "age": 36}\nAssistant: The answer is 42.'


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_build_writes_hf_folder_and_gguf(tmp_path: Path) -> None:
    paths = build_tiny_model(tmp_path / "tiny")
    assert paths.gguf_path.is_file()
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (paths.hf_dir / name).is_file(), name
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "temp build dirs left behind"


def test_build_does_not_import_torch(tmp_path: Path) -> None:
    code = (
        "import sys; from pathlib import Path; from gengate.models.tiny import build_tiny_model;"
        f"build_tiny_model(Path({str(tmp_path / 't')!r}));"
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules"
    )
    import subprocess

    subprocess.run([sys.executable, "-c", code], check=True)


def test_same_seed_is_byte_identical_and_other_seed_differs(tmp_path: Path) -> None:
    a = build_tiny_model(tmp_path / "a", seed=7)
    build_tiny_model(tmp_path / "b", seed=7)
    c = build_tiny_model(tmp_path / "c", seed=8)
    assert _files(tmp_path / "a") == _files(tmp_path / "b")
    assert a.gguf_path.read_bytes() != c.gguf_path.read_bytes()
    assert (a.hf_dir / "tokenizer.json").read_bytes() == (c.hf_dir / "tokenizer.json").read_bytes()


def test_rebuild_is_skipped_when_built_and_redone_for_another_seed(tmp_path: Path) -> None:
    dest = tmp_path / "tiny"
    paths = build_tiny_model(dest)
    mtime = paths.gguf_path.stat().st_mtime_ns
    assert build_tiny_model(dest) == paths
    assert paths.gguf_path.stat().st_mtime_ns == mtime
    first = paths.gguf_path.read_bytes()
    build_tiny_model(dest, seed=1)
    assert paths.gguf_path.read_bytes() != first
    assert (dest / tiny.MARKER_FILE).read_text().strip() == tiny._build_hash(1)


def test_broken_build_is_replaced(tmp_path: Path) -> None:
    dest = tmp_path / "tiny"
    dest.mkdir()
    (dest / "tiny.gguf").write_bytes(b"half written")
    paths = build_tiny_model(dest)
    assert paths.gguf_path.read_bytes()[:4] == b"GGUF"


def _build_in_child(dest: str) -> None:
    build_tiny_model(Path(dest))


def test_concurrent_builds_do_not_corrupt(tmp_path: Path) -> None:
    dest = tmp_path / "tiny"
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_build_in_child, args=(str(dest),)) for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    reference = build_tiny_model(tmp_path / "reference")
    assert _files(dest) == _files(tmp_path / "reference")
    assert reference.gguf_path.name == "tiny.gguf"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["reference", "tiny"]


def test_default_tiny_dir_follows_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("GENGATE_CACHE", str(tmp_path))
    assert default_tiny_dir() == tmp_path / "tiny"
    monkeypatch.delenv("GENGATE_CACHE")
    assert default_tiny_dir() == Path.home() / ".cache" / "gengate" / "tiny"


def test_tokenizer_in_transformers(tiny_model: TinyModelPaths) -> None:
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(tiny_model.hf_dir)
    assert len(tok) == tiny.TINY.vocab_size
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<|bos|>", "<|im_end|>", "<|pad|>")
    ids = tok('{"name": "Ada", "age": 36}')["input_ids"]
    assert len(ids) <= 12, "JSON should tokenize into sensible pieces"
    assert tok.decode(ids) == '{"name": "Ada", "age": 36}'
    text = tok.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert text == (
        "<|bos|><|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def _hf_logits(paths: TinyModelPaths, ids: list[int]) -> np.ndarray:
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    model = transformers.AutoModelForCausalLM.from_pretrained(paths.hf_dir)
    model.eval()
    with torch.no_grad():
        out = model(torch.tensor([ids]))
    return out.logits[0].float().numpy()


def test_transformers_generates(tiny_model: TinyModelPaths) -> None:
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(tiny_model.hf_dir)
    ids = tok(PROMPT)["input_ids"]
    logits = _hf_logits(tiny_model, ids)
    assert logits.shape == (len(ids), tiny.TINY.vocab_size)
    assert float(logits[-1].std()) > 0.5, "logits should not be flat"


def test_llamacpp_matches_transformers(tiny_model: TinyModelPaths) -> None:
    try:
        import llama_cpp
    except ImportError as exc:  # pragma: no cover - depends on the environment
        pytest.skip(f"llama_cpp not importable: {exc}")
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(tiny_model.hf_dir)
    ids = tok(PROMPT)["input_ids"]

    # F32 KV cache: the default F16 cache alone moves these logits by ~1e-2.
    llm = llama_cpp.Llama(
        model_path=str(tiny_model.gguf_path),
        n_ctx=256,
        logits_all=True,
        verbose=False,
        type_k=llama_cpp.GGML_TYPE_F32,
        type_v=llama_cpp.GGML_TYPE_F32,
    )
    assert llm.tokenize(PROMPT.encode(), add_bos=False, special=False) == ids
    chat_ids = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    chat_ids = chat_ids["input_ids"] if isinstance(chat_ids, dict) or hasattr(chat_ids, "keys") else chat_ids
    chat_text = tok.decode(chat_ids)
    assert llm.tokenize(chat_text.encode(), add_bos=False, special=True) == list(chat_ids)
    assert llm.token_eos() == tok.eos_token_id
    assert llm.metadata.get("tokenizer.chat_template") == tiny.CHAT_TEMPLATE

    llm.eval(ids)
    llama_logits = np.asarray(llm.scores[: len(ids)], dtype=np.float32)
    hf_logits = _hf_logits(tiny_model, ids)
    np.testing.assert_allclose(llama_logits, hf_logits, atol=1e-3, rtol=0)
    assert llm.detokenize(ids).decode() == PROMPT


def test_made_up_words_grow_the_vocabulary_to_the_size_asked(tmp_path: Path) -> None:
    """What BENCH_32K relies on (at 32k it takes ~15 s, so a smaller one here): a vocabulary far
    beyond what the tiny corpus holds trains to exactly the size asked, with the same tokenizer
    files and special tokens as the tiny model."""
    assert tiny.synthetic_words(50, seed=3) == tiny.synthetic_words(50, seed=3)
    assert len(set(tiny.synthetic_words(2000))) > 1500
    config = tiny.TinyConfig(vocab_size=4096, extra_words=20_000)
    from tokenizers import Tokenizer

    with pytest.raises(RuntimeError, match="expected 4096"):
        tiny.build_tiny_model(tmp_path / "too-few-words", config=tiny.TinyConfig(vocab_size=4096))
    paths = tiny.build_tiny_model(tmp_path / "4k", config=config)
    tokenizer = Tokenizer.from_file(str(paths.hf_dir / "tokenizer.json"))
    assert tokenizer.get_vocab_size() == 4096
    assert tokenizer.token_to_id(tiny.EOS_TOKEN) == tiny.SPECIAL_TOKENS.index(tiny.EOS_TOKEN)
    assert tiny.BENCH_32K.vocab_size == 32768 and tiny.BENCH_32K.extra_words > 0
