"""What only the MLX engine has: MlxLLM's settings (tokenizer_config, model_config, LoRA adapters
in mlx-lm's format) reaching mlx-lm, and one-line start-up errors for what mlx-lm cannot load.
The shared contract (sampling, constraints, batching, cancel) is tests/engines/test_batched_engines.py."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import pytest
from gengate import errors
from gengate.domain import GenerationRequest, SamplingParams, StoppingCriteria
from gengate.engines.mlx import MlxBackend, MlxOptions
from gengate.models.tiny import TinyModelPaths

pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")

GREEDY = SamplingParams(temperature=0.0, seed=0)


def test_options_are_mlxllms() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        MlxOptions()
    with pytest.raises(ValueError, match="exactly one"):
        MlxOptions(model="x", tiny=True)
    with pytest.raises(ValueError, match="extra"):
        MlxOptions.model_validate({"tiny": True, "path_or_hf_repo": "x"})
    with pytest.raises(ValueError, match="revision"):
        MlxOptions(tiny=True, revision="main")
    options = MlxOptions.model_validate({"model": "org/repo", "model_config": {"rope_theta": 1.0}})
    assert options.model_config_overrides == {"rope_theta": 1.0} and options.max_batch_size == 16


async def greedy_tokens(options: MlxOptions, name: str = "tiny-mlx") -> list[int | None]:
    engine = MlxBackend(name, options)
    await engine.start()
    try:
        result = await engine.generate(
            GenerationRequest(
                model=name,
                prompt="The weather today is",
                sampling=GREEDY,
                logprobs=0,
                stopping=StoppingCriteria(max_tokens=12),
            )
        )
    finally:
        await engine.aclose()
    logprobs = result.generations[0].logprobs
    assert logprobs is not None
    return [lp.token_id for lp in logprobs]


def write_lora_adapters(model_dir: Path, dest: Path, *, seed: int) -> Path:
    """LoRA adapters for the tiny model in mlx-lm's format (adapter_config.json +
    adapters.safetensors), with random non-zero B matrices so they change the output."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm import load
    from mlx_lm.tuner.utils import linear_to_lora_layers

    lora = {"rank": 4, "scale": 20.0, "dropout": 0.0}
    model, _ = load(str(model_dir))
    linear_to_lora_layers(model, 2, lora)
    mx.random.seed(seed)
    weights = {
        name: mx.random.normal(value.shape) * 0.5
        for name, value in tree_flatten(model.parameters())
        if name.rsplit(".", 1)[-1] in ("lora_a", "lora_b")
    }
    assert weights, "no LoRA layers were made"
    dest.mkdir(parents=True)
    mx.save_safetensors(str(dest / "adapters.safetensors"), weights)
    config = {"fine_tune_type": "lora", "num_layers": 2, "lora_parameters": lora}
    (dest / "adapter_config.json").write_text(json.dumps(config))
    return dest


async def test_lora_adapters_change_the_model(tiny_model: TinyModelPaths, tmp_path: Path) -> None:
    base = await greedy_tokens(MlxOptions(model=str(tiny_model.hf_dir)))
    adapters = write_lora_adapters(tiny_model.hf_dir, tmp_path / "adapters", seed=1)
    tuned = await greedy_tokens(MlxOptions(model=str(tiny_model.hf_dir), adapter_path=str(adapters)))
    assert tuned != base
    assert await greedy_tokens(MlxOptions(model=str(tiny_model.hf_dir), adapter_path=str(adapters))) == tuned


async def test_model_config_and_tokenizer_config_reach_mlx_lm(tiny_model: TinyModelPaths) -> None:
    base = await greedy_tokens(MlxOptions(model=str(tiny_model.hf_dir)))
    overridden = MlxOptions.model_validate(
        {"model": str(tiny_model.hf_dir), "model_config": {"rms_norm_eps": 0.5}}
    )
    assert await greedy_tokens(overridden) != base
    engine = MlxBackend(
        "tiny-mlx", MlxOptions(model=str(tiny_model.hf_dir), tokenizer_config={"model_max_length": 77})
    )
    await engine.start()
    try:
        assert engine._loaded is not None and engine._loaded.tokenizer.model_max_length == 77
    finally:
        await engine.aclose()


async def start_error(options: MlxOptions) -> str:
    engine = MlxBackend("broken", options)
    with pytest.raises(errors.ConfigError) as caught:
        await engine.start()
    message = str(caught.value)
    assert "\n" not in message, message  # one line, whatever mlx-lm printed
    assert message.startswith("model 'broken': ")
    return message


async def test_a_folder_mlx_lm_cannot_load_is_a_one_line_start_error(
    tiny_model: TinyModelPaths, tmp_path: Path
) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    assert f"mlx-lm could not load '{empty}'" in await start_error(MlxOptions(model=str(empty)))
    unknown = tmp_path / "unknown-architecture"
    shutil.copytree(tiny_model.hf_dir, unknown)
    config = json.loads((unknown / "config.json").read_text())
    (unknown / "config.json").write_text(json.dumps({**config, "model_type": "no_such_architecture"}))
    message = await start_error(MlxOptions(model=str(unknown)))
    assert f"mlx-lm could not load '{unknown}'" in message and "no_such_architecture" in message


async def test_a_bad_adapter_path_is_a_one_line_start_error(
    tiny_model: TinyModelPaths, tmp_path: Path
) -> None:
    missing = tmp_path / "nowhere"
    message = await start_error(MlxOptions(model=str(tiny_model.hf_dir), adapter_path=str(missing)))
    assert f"adapter_path '{missing}' is not a folder" in message
    not_adapters = tmp_path / "not-adapters"
    not_adapters.mkdir()
    message = await start_error(MlxOptions(model=str(tiny_model.hf_dir), adapter_path=str(not_adapters)))
    assert "(with adapter_path)" in message and "adapter_config.json" in message
    wrong_shape = write_lora_adapters(tiny_model.hf_dir, tmp_path / "wrong", seed=2)
    config = json.loads((wrong_shape / "adapter_config.json").read_text())
    config["lora_parameters"]["rank"] = 8  # the saved matrices have rank 4
    (wrong_shape / "adapter_config.json").write_text(json.dumps(config))
    message = await start_error(MlxOptions(model=str(tiny_model.hf_dir), adapter_path=str(wrong_shape)))
    assert "(with adapter_path)" in message


async def test_a_model_mlx_lm_cannot_batch_runs_each_row_alone_with_the_same_tokens(
    tiny_model: TinyModelPaths,
) -> None:
    """Where mlx-lm cannot merge a model's caches, every row keeps its own: one forward pass per
    row, the tokens unchanged (seeded, greedy)."""
    engine = MlxBackend("tiny-mlx", MlxOptions(model=str(tiny_model.hf_dir)))
    await engine.start()
    try:
        assert engine._loaded is not None
        batch = engine._loaded.scheduler.batch
        prompts = ["One two three", "The weather", "Colours: red green"]

        async def tokens_of_each() -> list[list[int | None]]:
            results = await asyncio.gather(
                *(
                    engine.generate(
                        GenerationRequest(
                            model="tiny-mlx",
                            prompt=p,
                            sampling=GREEDY,
                            logprobs=0,
                            stopping=StoppingCriteria(max_tokens=10),
                        )
                    )
                    for p in prompts
                )
            )
            return [[lp.token_id for lp in r.generations[0].logprobs or ()] for r in results]

        batched = await tokens_of_each()
        batch.batchable = False  # idle now: the next rows start with caches of their own
        passes = engine.stats.forward_passes
        alone = await tokens_of_each()
        assert alone == batched
        # every decode pass ran once per live row: more passes than tokens' steps of one batch
        assert engine.stats.forward_passes - passes > 10 * 1.5
    finally:
        await engine.aclose()
