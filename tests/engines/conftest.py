"""A fake vLLM control plane served on loopback for each test that asks for one."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import pytest
from aiohttp import web

from tests.engines.fake_vllm_control import FakeVLLM


@dataclass
class Served:
    """A running fake and its URL."""

    fake: FakeVLLM
    url: str


async def serve(app: web.Application, sock: socket.socket) -> web.AppRunner:
    """Serve ``app`` on the bound socket ``sock``; the caller cleans the runner up."""
    runner = web.AppRunner(app)
    await runner.setup()
    await web.SockSite(runner, sock).start()
    return runner


def bound_socket(port: int = 0) -> socket.socket:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    return sock


@pytest.fixture
async def serve_fake() -> AsyncIterator[Callable[..., Awaitable[Served]]]:
    """Start fakes (``await serve_fake(**FakeVLLM kwargs)``); all are stopped after the test."""
    runners: list[web.AppRunner] = []

    async def start(**kwargs) -> Served:
        fake = FakeVLLM(**kwargs)
        sock = bound_socket()
        runners.append(await serve(fake.app(), sock))
        return Served(fake, f"http://127.0.0.1:{sock.getsockname()[1]}")

    yield start
    for runner in runners:
        await runner.cleanup()


@pytest.fixture(scope="session")
def drift_adapter(tiny_model_dir, tmp_path_factory: pytest.TempPathFactory):
    """A real PEFT adapter of the tiny model (rank 4 on q_proj, v_proj), for the control-route replay."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    folder = tmp_path_factory.mktemp("drift-adapter")
    model.save_pretrained(folder)
    return folder
