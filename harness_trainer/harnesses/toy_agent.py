"""A minimal tool-calling agent, stdlib only: the smallest real agent program for tests and the dev loop.

``python3 toy_agent.py --base-url URL --api-key KEY --model M --steps N "instruction"``: it sends the
instruction with one ``bash`` tool to ``/chat/completions``, runs each tool call with ``bash -c`` (output
and exit code go back as the tool result), and stops at a reply without tool calls, after ``--steps``
model calls, or on a model error. Each step is printed as one JSON line (``{"step", "tool", "command",
"exit_code"}``), which the adapter counts. Like a real agent it owns its loop and only sees an endpoint.
"""

from __future__ import annotations

import argparse
import http.client
import json
import subprocess
import sys
import urllib.parse

BASH_TOOL = {
    "type": "function",
    "function": {
        "name": "bash",
        "description": "Run a bash command in the working directory and return its output.",
        "parameters": {
            "type": "object",
            "properties": {"command": {"type": "string", "description": "The command to run."}},
            "required": ["command"],
        },
    },
}
SYSTEM = "You are a coding agent. Use the bash tool to change files. Reply without a tool call when done."


class Endpoint:
    """One kept-alive HTTP connection to the model endpoint, as the SDKs real agents use keep them."""

    def __init__(self, base_url: str, timeout: float) -> None:
        url = urllib.parse.urlsplit(base_url.rstrip("/"))
        kind = http.client.HTTPSConnection if url.scheme == "https" else http.client.HTTPConnection
        self.connection = kind(url.netloc, timeout=timeout)
        self.path = url.path + "/chat/completions"

    def post(self, body: bytes, headers: dict[str, str]) -> bytes:
        while True:
            reused = self.connection.sock is not None
            try:
                self.connection.request("POST", self.path, body=body, headers=headers)
                response = self.connection.getresponse()
                data = response.read()
                break
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError):
                self.connection.close()
                if not reused:
                    raise
                # The server had closed the idle kept-alive connection: one try on a fresh one.
        if response.status != 200:
            raise ValueError(f"HTTP {response.status}: {data[:500].decode('utf-8', 'replace')}")
        return data


def chat(args: argparse.Namespace, endpoint: Endpoint, messages: list[dict]) -> dict:
    body = json.dumps({"model": args.model, "messages": messages, "tools": [BASH_TOOL]}).encode()
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {args.api_key}"}
    return json.loads(endpoint.post(body, headers))["choices"][0]["message"]


def run_tool(call: dict, timeout: float) -> tuple[str, int]:
    try:
        command = json.loads(call["function"].get("arguments") or "{}")["command"]
    except (KeyError, TypeError, ValueError):
        return 'error: the bash tool needs {"command": "..."}', 2
    try:
        done = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"error: command timed out after {timeout}s", 124
    return (done.stdout + done.stderr)[-8000:] or "(no output)", done.returncode


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--api-key", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--request-timeout", type=float, default=600)
    parser.add_argument("--tool-timeout", type=float, default=120)
    parser.add_argument("instruction")
    args = parser.parse_args()
    messages: list[dict] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": args.instruction},
    ]
    endpoint = Endpoint(args.base_url, args.request_timeout)
    for step in range(args.steps):
        try:
            message = chat(args, endpoint, messages)
        except (http.client.HTTPException, OSError, ValueError, KeyError) as exc:
            print(json.dumps({"step": step, "error": str(exc)}), flush=True)
            return 1
        calls = message.get("tool_calls") or []
        messages.append({"role": "assistant", "content": message.get("content"), "tool_calls": calls or None})
        if not calls:
            print(json.dumps({"step": step, "final": message.get("content")}), flush=True)
            return 0
        for call in calls:
            output, code = run_tool(call, args.tool_timeout)
            messages.append({"role": "tool", "tool_call_id": call.get("id", ""), "content": output})
            record = {"step": step, "tool": call["function"]["name"], "exit_code": code}
            print(json.dumps(record), flush=True)
    print(json.dumps({"step": args.steps, "final": None, "step_limit": True}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
