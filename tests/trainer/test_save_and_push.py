"""``save_model`` writes what ``from_pretrained`` (and peft) load back, equal to the trained policy;
``push_to_hub`` uploads exactly that folder through a fake ``HfApi`` whose every call is bound to the
installed huggingface_hub's real signature (a call the real ``HfApi`` would refuse fails the test)."""

from __future__ import annotations

import inspect
import logging
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from harness_trainer import HarnessAsyncGRPOTrainer
from harness_trainer.trainer import export
from harness_trainer.trainer.export import HubError, write_model_folder
from tests.trainer.handmade import HandmadeFactory
from tests.trainer.test_trainer import builder, config

TOKENIZER_FILES = ["chat_template.jinja", "tokenizer.json", "tokenizer_config.json"]
FULL_MODEL_FILES = sorted(["config.json", "generation_config.json", "model.safetensors", *TOKENIZER_FILES])
ADAPTER_FILES = sorted(["README.md", "adapter_config.json", "adapter_model.safetensors", *TOKENIZER_FILES])
IDS = torch.tensor([[4088, 84, 584, 198, 767, 4089, 198, 4088, 609, 762, 583, 198]])


class FakeHfApi:
    """Records ``create_repo``, ``create_branch`` and ``upload_folder``, each bound to the real ``HfApi``
    method's signature with its defaults; an upload keeps the bytes of the files the real one would send
    (huggingface_hub's own pattern filter), read at the call."""

    def __init__(self, *, upload_error: Exception | None = None, during: Any = None) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.uploaded: dict[str, bytes] = {}
        self.upload_error = upload_error
        self.during = during or (lambda: None)  # what the test notes at each call

    def create_repo(
        self,
        repo_id: str,
        *,
        token: str | bool | None = None,
        private: bool | None = None,
        visibility: Any = None,
        repo_type: str | None = None,
        exist_ok: bool = False,
        resource_group_id: str | None = None,
        region: Any = None,
        space_sdk: str | None = None,
        space_hardware: Any = None,
        space_sleep_time: int | None = None,
        space_secrets: list[dict[str, str]] | None = None,
        space_variables: list[dict[str, str]] | None = None,
        space_volumes: list[Any] | None = None,
        space_template: str | None = None,
    ) -> SimpleNamespace:
        self._record("create_repo", locals())
        return SimpleNamespace(repo_id=repo_id if "/" in repo_id else f"me/{repo_id}")

    def create_branch(
        self,
        repo_id: str,
        *,
        branch: str,
        revision: str | None = None,
        token: bool | str | None = None,
        repo_type: str | None = None,
        exist_ok: bool = False,
    ) -> None:
        self._record("create_branch", locals())

    def upload_folder(
        self,
        *,
        repo_id: str,
        folder_path: str | Path,
        path_in_repo: str | None = None,
        commit_message: str | None = None,
        commit_description: str | None = None,
        token: str | bool | None = None,
        repo_type: str | None = None,
        revision: str | None = None,
        create_pr: bool | None = None,
        parent_commit: str | None = None,
        allow_patterns: list[str] | str | None = None,
        ignore_patterns: list[str] | str | None = None,
        delete_patterns: list[str] | str | None = None,
        run_as_future: bool = False,
    ) -> SimpleNamespace:
        self._record("upload_folder", locals())
        if self.upload_error is not None:
            raise self.upload_error
        from huggingface_hub.utils import filter_repo_objects

        root = Path(folder_path)
        files = [str(p.relative_to(root)) for p in sorted(root.rglob("*")) if p.is_file()]
        chosen = filter_repo_objects(files, allow_patterns=allow_patterns, ignore_patterns=ignore_patterns)
        self.uploaded = {name: (root / name).read_bytes() for name in chosen}
        return SimpleNamespace(commit_url=f"https://huggingface.co/{repo_id}/commit/0", oid="0")

    def named(self, method: str) -> list[dict[str, Any]]:
        return [call for name, call in self.calls if name == method]

    def _record(self, method: str, call: dict[str, Any]) -> None:
        from huggingface_hub import HfApi

        call = {k: v for k, v in call.items() if k != "self"}
        bound = inspect.signature(getattr(HfApi, method)).bind(None, **call)
        bound.apply_defaults()
        arguments = {k: v for k, v in bound.arguments.items() if k != "self"}
        self.calls.append((method, {**arguments, "noted": self.during()}))


@pytest.fixture
def hub(monkeypatch) -> FakeHfApi:
    fake = FakeHfApi()
    monkeypatch.setattr(export, "hf_api", lambda: fake)
    return fake


@pytest.fixture
def no_stored_token(monkeypatch, tmp_path):
    """No HF_TOKEN and no token file: huggingface_hub's get_token() finds nothing."""
    import huggingface_hub.constants

    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_OIDC_RESOURCE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))


def trained(tmp_path: Path, model_dir: Path, factory: HandmadeFactory | None = None, **settings):
    trainer = HarnessAsyncGRPOTrainer(
        str(model_dir), builder(factory or HandmadeFactory()), config(tmp_path, max_steps=1, **settings)
    )
    trainer.train()
    return trainer


def logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(IDS).logits


# -- save_model ----------------------------------------------------------------------------------------


def test_save_model_writes_output_dir_a_full_model_and_tokenizer_that_from_pretrained_loads(
    tmp_path, tiny_model_dir
):
    trainer = trained(tmp_path, tiny_model_dir)
    out = tmp_path / "out"

    trainer.save_model()

    assert sorted(p.name for p in out.iterdir() if p.is_file() and p.suffix != ".jsonl") == FULL_MODEL_FILES
    assert (out / "checkpoint-1").is_dir() and (out / "metrics.jsonl").is_file()  # the run's files stay
    loaded = AutoModelForCausalLM.from_pretrained(out)
    saved = loaded.state_dict()
    for name, tensor in trainer.model.state_dict().items():
        assert torch.equal(saved[name], tensor), name
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    assert any(not torch.equal(saved[name], base[name]) for name in base)  # the trained weights, not the base
    tokenizer, original = AutoTokenizer.from_pretrained(out), AutoTokenizer.from_pretrained(tiny_model_dir)
    assert tokenizer.chat_template == original.chat_template and tokenizer.chat_template
    messages = [{"role": "user", "content": "List the files."}]
    assert tokenizer.apply_chat_template(messages, add_generation_prompt=True) == (
        original.apply_chat_template(messages, add_generation_prompt=True)
    )
    generation = GenerationConfig.from_pretrained(tiny_model_dir)
    assert loaded.generation_config.to_diff_dict() == generation.to_diff_dict()


def test_a_lora_run_saves_its_adapter_which_peft_loads_onto_the_base(tmp_path, tiny_model_dir):
    from peft import PeftModel

    trainer = trained(tmp_path, tiny_model_dir, use_peft=True, lora_r=4, lora_alpha=8)
    folder = tmp_path / "adapter"

    trainer.save_model(folder)

    assert sorted(p.name for p in folder.iterdir()) == ADAPTER_FILES
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), folder)
    expected = logits(trainer.model)
    assert torch.allclose(logits(loaded), expected, atol=1e-5)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert not torch.allclose(logits(base), expected, atol=1e-4)  # the trained adapter, not B = 0
    template = AutoTokenizer.from_pretrained(tiny_model_dir).chat_template
    assert AutoTokenizer.from_pretrained(folder).chat_template == template


def test_lora_save_merged_writes_one_full_model_with_the_adapters_outputs(tmp_path, tiny_model_dir):
    trainer = trained(tmp_path, tiny_model_dir, use_peft=True, lora_r=4, lora_alpha=8)
    folder = tmp_path / "saved"
    trainer.save_model(folder)  # the adapter first: the merged save below replaces it

    trainer.args.lora_save = "merged"
    trainer.save_model(folder)

    assert sorted(p.name for p in folder.iterdir()) == sorted([*FULL_MODEL_FILES, "README.md"])  # peft's
    merged = AutoModelForCausalLM.from_pretrained(folder)
    assert not any("lora" in name or "base_layer" in name for name in merged.state_dict())
    assert torch.allclose(logits(merged), logits(trainer.model), atol=1e-5)
    assert any(hasattr(m, "lora_A") for m in trainer.model.modules())  # the policy itself stays unmerged


def test_a_module_that_names_no_source_needs_a_processing_class(tmp_path, tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    model.name_or_path = ""  # as a model built from a config
    trainer = HarnessAsyncGRPOTrainer(model, builder(HandmadeFactory()), config(tmp_path, max_steps=1))
    trainer.train()
    with pytest.raises(ValueError, match="pass processing_class="):
        trainer.save_model()

    trainer.processing_class = AutoTokenizer.from_pretrained(tiny_model_dir)
    trainer.save_model()
    assert AutoTokenizer.from_pretrained(tmp_path / "out").chat_template


def test_a_save_removes_the_model_files_an_earlier_save_left(tmp_path):
    class Model:
        def __init__(self, *names: str) -> None:
            self.names = names

        def save_pretrained(self, folder: Path) -> None:
            for name in self.names:
                (Path(folder) / name).write_text(name)

    folder = tmp_path / "model"
    write_model_folder(Model("config.json", "model-00001-of-00002.safetensors", "x.json"), Model(), folder)
    (folder / "notes.txt").write_text("mine")
    (folder / ".save-model-tmp-dead").mkdir()  # a save killed midway

    adapter = Model("adapter_config.json", "adapter_model.safetensors")
    written = write_model_folder(adapter, Model("t.json"), folder)

    assert written == ["adapter_config.json", "adapter_model.safetensors", "t.json"]
    assert sorted(p.name for p in folder.iterdir()) == sorted([*written, "notes.txt", "x.json"])


# -- push_to_hub ---------------------------------------------------------------------------------------


def test_push_to_hub_opens_the_repo_before_training_and_pushes_only_the_model_at_the_end(
    tmp_path, tiny_model_dir, hub, no_stored_token
):
    factory = HandmadeFactory()
    hub.during = lambda: len(factory.created)
    trainer = trained(
        tmp_path, tiny_model_dir, factory, push_to_hub=True, hub_model_id="org/tiny-grpo",
        hub_private_repo=True, hub_revision="grpo", hub_token="hf_fake_token",
    )  # fmt: skip
    out = tmp_path / "out"

    opening = ["create_repo", "create_branch"]
    assert [name for name, _ in hub.calls] == [*opening, *opening, "upload_folder"]
    opened, branched = hub.named("create_repo")[0], hub.named("create_branch")[0]
    assert opened["noted"] == 0  # before the first session
    assert opened["repo_id"] == "org/tiny-grpo" and opened["token"] == "hf_fake_token"
    assert opened["private"] is True and opened["exist_ok"] is True
    assert (branched["repo_id"], branched["branch"], branched["exist_ok"]) == ("org/tiny-grpo", "grpo", True)
    (pushed,) = hub.named("upload_folder")
    assert pushed["noted"] == len(factory.created) and not factory.live  # after every session closed
    assert pushed["repo_id"] == "org/tiny-grpo" and pushed["folder_path"] == out
    assert pushed["revision"] == "grpo" and pushed["token"] == "hf_fake_token"
    assert pushed["commit_message"] == "End of training" and pushed["run_as_future"] is False
    assert sorted(hub.uploaded) == FULL_MODEL_FILES  # no checkpoints, metrics or rollouts
    assert all(hub.uploaded[name] == (out / name).read_bytes() for name in hub.uploaded)
    assert "hf_fake_token" not in repr(trainer.args) and trainer.args.to_dict()["hub_token"] == "<HUB_TOKEN>"


def test_push_to_hub_by_hand_names_the_repo_after_output_dir_and_takes_transformers_arguments(
    tmp_path, tiny_model_dir, hub, monkeypatch, caplog
):
    monkeypatch.setenv("HF_TOKEN", "hf_env_token")
    trainer = trained(tmp_path, tiny_model_dir, use_peft=True)
    assert not hub.calls  # push_to_hub=False: nothing at the end

    with caplog.at_level(logging.WARNING):
        result = trainer.push_to_hub("by hand", blocking=False, private=False, dataset_name="tasks")

    (opened,) = hub.named("create_repo")
    assert (opened["repo_id"], opened["token"], opened["private"]) == ("out", "hf_env_token", False)
    assert not hub.named("create_branch")
    (pushed,) = hub.named("upload_folder")
    assert pushed["repo_id"] == "me/out" and pushed["commit_message"] == "by hand"
    assert pushed["run_as_future"] is True  # blocking=False
    assert pushed["revision"] is None and result.oid == "0"
    assert sorted(hub.uploaded) == ADAPTER_FILES
    assert "writes no model card: dataset_name ignored" in caplog.text


def test_push_to_hub_without_a_token_stops_the_run_before_any_rollout(
    tmp_path, tiny_model_dir, hub, no_stored_token
):
    factory = HandmadeFactory()
    trainer = HarnessAsyncGRPOTrainer(
        str(tiny_model_dir), builder(factory), config(tmp_path, max_steps=1, push_to_hub=True)
    )
    with pytest.raises(HubError, match=r"needs a token with write.*HF_TOKEN.*hf auth login.*hub_token"):
        trainer.train()
    assert not factory.created and not hub.calls and trainer.model is None


def test_a_failed_upload_raises_naming_the_saved_folder_after_the_checkpoint(tmp_path, tiny_model_dir, hub):
    from huggingface_hub.errors import HfHubHTTPError, HTTPError

    http = sys.modules[HTTPError.__module__]  # the HTTP client huggingface_hub uses
    response = http.Response(403, request=http.Request("POST", "https://huggingface.co/api/models/me/out"))
    hub.upload_error = HfHubHTTPError("403 Forbidden: no write access", response=response)
    factory = HandmadeFactory()
    with pytest.raises(HubError, match=r"uploading .*out to the Hub repository me/out failed: 403") as raised:
        trained(tmp_path, tiny_model_dir, factory, push_to_hub=True, hub_token="hf_fake_token")
    assert "trainer.push_to_hub()" in str(raised.value)
    assert (tmp_path / "out" / "checkpoint-1").is_dir() and (tmp_path / "out" / "model.safetensors").is_file()
    assert not factory.live and factory.factory_closed


def test_a_run_stopped_before_its_end_is_not_pushed(tmp_path, tiny_model_dir, hub, caplog):
    trainer = HarnessAsyncGRPOTrainer(
        str(tiny_model_dir), builder(HandmadeFactory()),
        config(tmp_path, max_steps=3, push_to_hub=True, hub_token="hf_fake_token"),
    )  # fmt: skip
    trainer.stop()
    with caplog.at_level(logging.WARNING):
        trainer.train()
    assert [name for name, _ in hub.calls] == ["create_repo"]
    assert "before its end: not pushed to the Hub" in caplog.text


def test_a_run_that_fails_is_not_pushed(tmp_path, tiny_model_dir, hub):
    from harness_trainer.trace import CaptureContractError

    factory = HandmadeFactory(malformed=lambda n: True)
    trainer = HarnessAsyncGRPOTrainer(
        str(tiny_model_dir), builder(factory),
        config(tmp_path, max_steps=3, push_to_hub=True, hub_token="hf_fake_token"),
    )  # fmt: skip
    with pytest.raises(CaptureContractError):
        trainer.train()
    assert [name for name, _ in hub.calls] == ["create_repo"]
