"""The host's trust store and proxy settings, carried into image builds and sandboxes.

HTTPS from many machines goes through a proxy whose CA the host trusts and a fresh image does not
(corporate networks; these machines' egress proxy): ``pip install`` in a task's Dockerfile then fails with
``CERTIFICATE_VERIFY_FAILED`` and npm with ``SELF_SIGNED_CERT_IN_CHAIN``, on the user's very first build.
So what works on the host works in a build and a sandbox: :class:`HostTrust` is the host's CA bundle (the
file its OpenSSL verifies with: ``SSL_CERT_FILE``, else the default) and its proxy variables
(``HTTP(S)_PROXY``, ``NO_PROXY``, ``ALL_PROXY``, either case).

- An image build copies the bundle into each stage at :data:`CA_PATH` and points the usual variables at it
  (:data:`CA_ENV`: OpenSSL and Python's ``ssl``, requests, pip, curl, git, and Node's extra CAs, which npm
  needs since it carries its own list); the proxy variables are build arguments. The bundle is part of the
  image's content hash, so a changed trust store rebuilds.
- A sandbox on this machine's filesystem (local) gets the same variables pointing at the host's own file.

Backends that run elsewhere (E2B) take nothing: the host's network is not theirs. Each backend that takes
it has ``inherit_host_trust`` (default on) to opt out.
"""

from __future__ import annotations

import os
import ssl
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import harness_trainer.sandboxes.dockerfile as dockerfile

CA_PATH = "/etc/harness-trainer/host-ca.crt"
"""Where an image build puts the host's CA bundle."""
CA_FILE_NAME = "harness-trainer-host-ca.crt"
"""The bundle's name in a build context (beside the task's files, which cannot use it)."""
CA_ENV = (
    "SSL_CERT_FILE",
    "REQUESTS_CA_BUNDLE",
    "PIP_CERT",
    "CURL_CA_BUNDLE",
    "GIT_SSL_CAINFO",
    "NODE_EXTRA_CA_CERTS",
)
"""The variables that point TLS clients at a CA bundle: OpenSSL and Python, requests, pip (which uses its
own bundle otherwise), curl, git, Node (npm ships its own list; this adds to it)."""
PROXY_ENV = tuple(
    name for base in ("HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "ALL_PROXY") for name in (base, base.lower())
)


@dataclass(frozen=True)
class HostTrust:
    """The host's CA bundle (a path on the host, or None) and its proxy variables."""

    ca_bundle: Path | None = None
    proxy: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def from_host(cls, environ: Mapping[str, str] = os.environ) -> HostTrust:
        """What this host trusts and which proxies it uses."""
        return cls(host_ca_bundle(environ), {name: environ[name] for name in PROXY_ENV if environ.get(name)})

    def env(self, ca_path: str) -> dict[str, str]:
        """The variables a process needs to trust the bundle at ``ca_path`` and use the host's proxies."""
        trusted = {name: ca_path for name in CA_ENV} if self.ca_bundle is not None else {}
        return {**trusted, **self.proxy}

    def dockerfile(self, text: str) -> str:
        """``text`` with the bundle copied into every stage and :data:`CA_ENV` set, right after each
        ``FROM`` (its line kept whole: a ``FROM`` continued over several lines too). Unchanged without a
        bundle."""
        if self.ca_bundle is None:
            return text
        env = " ".join(f"{name}={CA_PATH}" for name in CA_ENV)
        layer = [f"COPY {CA_FILE_NAME} {CA_PATH}", f"ENV {env}"]
        ends = {ins.end_line for ins in dockerfile.parse(text) if ins.keyword == "FROM"}
        out: list[str] = []
        for number, line in enumerate(text.splitlines(), start=1):
            out.append(line)
            if number in ends:
                out += layer
        return "\n".join(out) + "\n"


def host_ca_bundle(environ: Mapping[str, str] = os.environ) -> Path | None:
    """The CA bundle this host's TLS clients verify with: ``SSL_CERT_FILE`` where it names a file, else
    OpenSSL's default file; None where neither exists (nothing to carry)."""
    paths = ssl.get_default_verify_paths()
    for candidate in (environ.get("SSL_CERT_FILE"), paths.cafile, paths.openssl_cafile):
        if candidate and Path(candidate).is_file():
            return Path(candidate).resolve()
    return None


NO_TRUST = HostTrust()
"""Nothing carried (``inherit_host_trust=False``)."""
