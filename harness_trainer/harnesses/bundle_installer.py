"""A pip agent's bundle completes itself for one image's Python: copied into the bundle as ``install.py``
and run by that image's ``python3`` (stdlib only, and old syntax: it must run far enough on any Python 3 to
say that the image's is too old).

    python3 install.py install   # make the venv for this Python (once; needs the package index)
    python3 install.py where     # print the venv's path, or explain and exit 3 when it was never made

A venv is tied to the interpreter it was made with, so the bundle holds one per Python, under
``venvs/<key>``, the key a hash of the interpreter's real path, version and C library: images that share
a Python share its venv. Concurrent installs (two images with one Python) serialise on a ``flock``; a venv
is complete once it holds the marker file. pip itself comes from the wheel in ``pip/`` (an image's Python
may have no ``ensurepip``: Debian's without ``python3-venv``). The specs are in ``specs.txt``, the Pythons
the package runs on in ``requires.txt``: comma-separated bounds, ``>=X`` or ``<X`` (a bare ``X`` is ``>=X``).
Both commands refuse a Python out of those bounds first, naming the package, the bounds and the image's
Python (exit 3): pip's own refusal of a release whose ``Requires-Python`` excludes it reads as if the
release did not exist.
"""

import fcntl
import glob
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import venv

ROOT = os.path.dirname(os.path.abspath(__file__))
MARKER = ".harness-trainer-installed"


def read(name):
    with open(os.path.join(ROOT, name)) as handle:
        return handle.read().split()


def fail(message, code=3):
    sys.stderr.write("harness-trainer: " + message + "\n")
    sys.exit(code)


def key():
    python = os.path.realpath(sys.executable)
    text = "|".join([python, sys.version, " ".join(platform.libc_ver())])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def describe():
    return "Python " + platform.python_version() + " at " + os.path.realpath(sys.executable)


def specs():
    return " ".join(read("specs.txt"))


def bounds():
    """``requires.txt`` as ``(operator, version tuple)`` pairs, the operator ``>=`` or ``<``."""
    pairs = []
    for clause in "".join(read("requires.txt")).split(","):
        operator = "<" if clause.startswith("<") else ">="
        version = clause[len(operator) :] if clause.startswith(operator) else clause
        pairs.append((operator, tuple(int(part) for part in version.split("."))))
    return pairs


def check_version():
    for operator, need in bounds():
        have = sys.version_info[: len(need)]
        if (have < need) if operator == ">=" else (have >= need):
            wanted = ", ".join(op + " " + ".".join(map(str, version)) for op, version in bounds())
            fail(specs() + " needs Python " + wanted + "; this image has " + describe())


def install(dest):
    check_version()
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    with open(dest + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if os.path.isfile(os.path.join(dest, MARKER)):
            return
        shutil.rmtree(dest, ignore_errors=True)
        venv.EnvBuilder(with_pip=False, symlinks=True).create(dest)
        wheels = glob.glob(os.path.join(ROOT, "pip", "pip-*.whl"))
        if not wheels:
            fail("the bundle has no pip wheel under " + os.path.join(ROOT, "pip"))
        python = os.path.join(dest, "bin", "python")
        command = [python, os.path.join(wheels[0], "pip"), "install", "--no-input", "--no-cache-dir"]
        command += ["--disable-pip-version-check", "-q", *read("specs.txt")]
        if subprocess.call(command) != 0:
            fail("pip install " + specs() + " failed under " + describe())
        with open(os.path.join(dest, MARKER), "w") as marker:
            marker.write(describe() + "\n")


def main():
    dest = os.path.join(ROOT, "venvs", key())
    what = sys.argv[1] if len(sys.argv) > 1 else ""
    if what == "install":
        install(dest)
    elif what == "where":
        check_version()
        if not os.path.isfile(os.path.join(dest, MARKER)):
            fail(specs() + " was never installed for " + describe() + " in this bundle (prepare it)")
    else:
        fail("usage: install.py install|where", code=2)
    print(dest)


if __name__ == "__main__":
    main()
