"""The tiny local model: a deterministic recipe, no hub anywhere.

``ensure_tiny_model()`` builds (once) a small Qwen2-architecture causal LM with random weights from a
fixed seed and a byte-level BPE tokenizer trained on :mod:`harness_trainer.models.corpus`, with the
official Qwen2.5 chat template (tools and tool calls rendered the Qwen way, so TRL's
``add_response_schema`` / ``parse_response`` recognise it). Both are saved with ``save_pretrained``, so
everything downstream loads the directory exactly as it would load a hub model.

The result is cached under ``$HARNESS_TRAINER_CACHE`` (default ``~/.cache/harness-trainer``) in a folder
named by a fingerprint of the recipe; builds are atomic (build in a temporary folder, then rename) and
serialised by a file lock, so concurrent test workers never see half a model.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path

from harness_trainer.models.corpus import CORPUS_VERSION, corpus

RECIPE_VERSION = 1
RECIPE_FILE = "recipe.json"

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Qwen keeps these as added tokens that are *not* special, so decoding with skip_special_tokens keeps them.
ADDED_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>")
# Qwen2's pre-tokenizer split: contractions, letters, single digits, punctuation runs, newlines, spaces.
QWEN_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class TinyModelRecipe:
    """Everything that decides the tiny model's bytes; its fingerprint names the cache folder."""

    vocab_size: int = 4096
    hidden_size: int = 256
    intermediate_size: int = 768
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 16384
    initializer_range: float = 0.05
    seed: int = 0

    def fingerprint(self) -> str:
        payload = json.dumps(
            {**asdict(self), "recipe": RECIPE_VERSION, "corpus": CORPUS_VERSION}, sort_keys=True
        )
        return hashlib.sha256(payload.encode()).hexdigest()[:12]


def default_cache_dir() -> Path:
    """Where built models live: ``$HARNESS_TRAINER_CACHE`` or ``~/.cache/harness-trainer``."""
    root = os.environ.get("HARNESS_TRAINER_CACHE") or Path.home() / ".cache" / "harness-trainer"
    return Path(root) / "models"


def chat_template() -> str:
    """The Qwen2.5 chat template, byte for byte as Qwen2.5 tokenizers ship it."""
    return resources.files("harness_trainer.models").joinpath("qwen2_5_chat_template.jinja").read_text()


def ensure_tiny_model(out: Path | None = None, recipe: TinyModelRecipe | None = None) -> Path:
    """Return the tiny model's directory, building it first if it is not there yet.

    Raises:
        FileExistsError: ``out`` exists, is not empty and holds no model built by this recipe.
    """
    recipe = recipe or TinyModelRecipe()
    target = Path(out) if out is not None else default_cache_dir() / f"tiny-qwen2-{recipe.fingerprint()}"
    if _is_built(target, recipe):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _is_built(target, recipe):
            return target
        if target.exists() and any(target.iterdir()):
            raise FileExistsError(
                f"{target} is not empty and holds no tiny model of recipe {recipe.fingerprint()}; "
                "pick an empty or new --out directory"
            )
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
        try:
            build_tiny_model(staging, recipe)
            if target.exists():
                target.rmdir()
            staging.rename(target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return target


def _is_built(target: Path, recipe: TinyModelRecipe) -> bool:
    marker = target / RECIPE_FILE
    if not marker.is_file():
        return False
    return json.loads(marker.read_text()).get("fingerprint") == recipe.fingerprint()


def build_tiny_model(out: Path, recipe: TinyModelRecipe) -> None:
    """Build tokenizer and model into ``out`` (an existing, empty directory)."""
    import torch
    from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=train_tokenizer(recipe),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_max_length=recipe.max_position_embeddings,
        chat_template=chat_template(),
    )
    tokenizer.save_pretrained(out)

    im_end, endoftext = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=recipe.hidden_size,
        intermediate_size=recipe.intermediate_size,
        num_hidden_layers=recipe.num_hidden_layers,
        num_attention_heads=recipe.num_attention_heads,
        num_key_value_heads=recipe.num_key_value_heads,
        max_position_embeddings=recipe.max_position_embeddings,
        initializer_range=recipe.initializer_range,
        tie_word_embeddings=True,
        bos_token_id=endoftext,
        eos_token_id=im_end,
        pad_token_id=endoftext,
    )
    torch.manual_seed(recipe.seed)
    model = Qwen2ForCausalLM(config).to(torch.float32)
    model.generation_config = GenerationConfig(
        bos_token_id=endoftext, eos_token_id=[im_end, endoftext], pad_token_id=endoftext
    )
    model.save_pretrained(out)
    (out / RECIPE_FILE).write_text(
        json.dumps({"fingerprint": recipe.fingerprint(), **asdict(recipe)}, indent=2) + "\n"
    )


def train_tokenizer(recipe: TinyModelRecipe):
    """Train the byte-level BPE (``tokenizers.Tokenizer``) on the deterministic corpus."""
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        trainers,
    )

    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=recipe.vocab_size - len(SPECIAL_TOKENS) - len(ADDED_TOKENS),
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus(recipe.seed), trainer)
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED_TOKENS])
    return tokenizer
