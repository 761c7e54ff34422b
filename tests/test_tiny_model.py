"""The tiny-model recipe: a few-million-parameter Qwen2 with the Qwen2.5 chat template, built offline,
deterministically, once; and recognised by TRL's response parsing as a Qwen model."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2ForCausalLM

import harness_trainer.models.tiny as tiny
from harness_trainer.models.tiny import RECIPE_FILE, chat_template, ensure_tiny_model

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "bash",
            "description": "Run a shell command.",
            "parameters": {"type": "object", "properties": {"command": {"type": "string"}}},
        },
    }
]
TOOL_CALL_TEXT = '<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>'


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def model(tiny_model_dir: Path):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def two_builds(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The recipe built twice from scratch, into two fresh directories."""
    root = tmp_path_factory.mktemp("builds")
    return ensure_tiny_model(out=root / "a"), ensure_tiny_model(out=root / "b")


def test_recipe_builds_a_qwen2_causal_lm_with_a_few_million_parameters(model) -> None:
    assert isinstance(model, Qwen2ForCausalLM)
    params = sum(p.numel() for p in model.parameters())
    assert 1_000_000 < params < 10_000_000


def test_model_vocabulary_matches_the_tokenizer(model, tokenizer) -> None:
    assert model.config.vocab_size == len(tokenizer)
    assert model.get_input_embeddings().weight.shape[0] == len(tokenizer)


def test_model_ties_input_and_output_embeddings(model) -> None:
    assert model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()


def test_model_and_tokenizer_load_with_the_hub_offline(tiny_model_dir: Path) -> None:
    import huggingface_hub.constants

    assert os.environ.get("HF_HUB_OFFLINE") == "1"
    assert huggingface_hub.constants.HF_HUB_OFFLINE
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    ids = tokenizer("hello world", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], len(tokenizer))


@pytest.mark.slow
def test_building_twice_gives_identical_tokenizer_and_weights(two_builds: tuple[Path, Path]) -> None:
    a, b = two_builds
    assert a != b
    assert (a / "tokenizer.json").read_bytes() == (b / "tokenizer.json").read_bytes()
    tensors_a, tensors_b = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert tensors_a.keys() == tensors_b.keys()
    for name, tensor in tensors_a.items():
        assert tensor.dtype == tensors_b[name].dtype, name
        assert torch.equal(tensor, tensors_b[name]), name


def test_second_call_reuses_the_built_model(
    two_builds: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    built, _ = two_builds
    weights = built / "model.safetensors"
    before = weights.stat().st_mtime_ns

    def no_rebuild(*args: object, **kwargs: object) -> None:
        raise AssertionError("ensure_tiny_model rebuilt a model that was already there")

    monkeypatch.setattr(tiny, "build_tiny_model", no_rebuild)
    assert ensure_tiny_model(out=built) == built
    assert weights.stat().st_mtime_ns == before


def test_default_location_is_reused_across_calls(tiny_model_dir: Path) -> None:
    before = (tiny_model_dir / "model.safetensors").stat().st_mtime_ns
    assert ensure_tiny_model() == tiny_model_dir
    assert (tiny_model_dir / "model.safetensors").stat().st_mtime_ns == before


def test_non_empty_foreign_out_dir_is_refused(tmp_path: Path) -> None:
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("not a model\n")
    with pytest.raises(FileExistsError, match="not empty"):
        ensure_tiny_model(out=foreign)
    assert [p.name for p in foreign.iterdir()] == ["notes.txt"]


def test_out_dir_holding_another_recipe_is_refused(tmp_path: Path) -> None:
    other = tmp_path / "other"
    other.mkdir()
    (other / RECIPE_FILE).write_text('{"fingerprint": "000000000000"}\n')
    with pytest.raises(FileExistsError):
        ensure_tiny_model(out=other)


def test_saved_tokenizer_carries_the_qwen2_5_chat_template(tokenizer) -> None:
    assert tokenizer.chat_template == chat_template()


def test_chat_template_renders_tools_and_tool_calls_the_qwen_way(tokenizer) -> None:
    messages = [
        {"role": "user", "content": "What is here?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"type": "function", "function": {"name": "bash", "arguments": {"command": "ls"}}}
            ],
        },
        {"role": "tool", "content": "hello.txt"},
    ]
    text = tokenizer.apply_chat_template(messages, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert '<tools>\n{"type": "function", "function": {"name": "bash"' in text
    assert f"<|im_start|>assistant\n{TOOL_CALL_TEXT}<|im_end|>\n" in text
    assert "<|im_start|>user\n<tool_response>\nhello.txt\n</tool_response><|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("token", ["<|im_start|>", "<|im_end|>", "<|endoftext|>"])
def test_special_tokens_are_single_ids_dropped_when_skipping_specials(tokenizer, token: str) -> None:
    ids = tokenizer(f"hi{token}there", add_special_tokens=False)["input_ids"]
    token_id = tokenizer.convert_tokens_to_ids(token)
    assert tokenizer(token, add_special_tokens=False)["input_ids"] == [token_id]
    assert token_id in ids
    assert token not in tokenizer.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("token", ["<tool_call>", "</tool_call>"])
def test_tool_call_tags_are_single_ids_kept_when_skipping_specials(tokenizer, token: str) -> None:
    token_id = tokenizer.convert_tokens_to_ids(token)
    assert tokenizer(token, add_special_tokens=False)["input_ids"] == [token_id]
    ids = tokenizer(f"{TOOL_CALL_TEXT}<|im_end|>", add_special_tokens=False)["input_ids"]
    assert token_id in ids
    assert tokenizer.decode(ids, skip_special_tokens=True) == TOOL_CALL_TEXT


def test_chat_template_is_trls_qwen2_5_template() -> None:
    trl = pytest.importorskip("trl")
    shipped = Path(trl.__file__).parent / "chat_templates" / "qwen2_5.jinja"
    assert chat_template() == shipped.read_text(encoding="utf-8")


def test_trl_parses_a_tool_call_from_tiny_model_ids(tiny_model_dir: Path) -> None:
    trl_chat = pytest.importorskip("trl.chat_template_utils")
    tokenizer = trl_chat.add_response_schema(AutoTokenizer.from_pretrained(tiny_model_dir))
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "list files"}], tools=TOOLS, tokenize=False, add_generation_prompt=True
    )
    # transformers >= 5.13 needs the prompt as `prefix=`; without it trl falls back to plain text.
    prefix = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    ids = tokenizer(f"{TOOL_CALL_TEXT}<|im_end|>", add_special_tokens=False)["input_ids"]
    parsed = trl_chat.parse_response(tokenizer, ids, prefix=prefix)
    assert [call["function"]["name"] for call in parsed.get("tool_calls", [])] == ["bash"]
    assert parsed["tool_calls"][0]["function"]["arguments"] == {"command": "ls"}
