"""A deterministic text corpus for training the tiny model's tokenizer.

The tiny model never sees the hub, so its byte-level BPE is trained here on text generated from a fixed
seed: English instructions, shell sessions, Python edits and tool-call JSON in the shapes coding agents
produce. Same seed, same corpus, same vocabulary on every machine.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator

CORPUS_VERSION = 1

_WORDS = (
    "the a an to of and in is it that for on with as be this file function test tests run fix bug "
    "error value return list dict string number line lines code task repo change add remove update "
    "check print output input read write path directory folder command shell python script module "
    "class method import from should must can will not if else when then first next after before "
    "make sure every each all none empty new old name names count total sum result results expected "
    "actual fails passes pass failed solution patch edit replace insert delete create open close "
    "please you I we your our this that these those here there now done found missing wrong right "
    "small large tiny big simple clear short long config option flag default version data json yaml "
    "about above across act active agent also always answer any are around ask at available back base "
    "because been being below between both bring build but by call called case cause certain character "
    "come common complete contain content context continue copy correct could current day decide "
    "describe detail did different do does down during early easy end enough environment even exact "
    "example exist explain fact fail far few field final find follow following form format full get "
    "give go good great group had has have help high hold how however important include information "
    "instead into issue just keep key kind know last later least leave left less let level like limit "
    "little local look lose low main many may mean message might model more most move much my need "
    "never next no note number off often once one only or order other out over own part per place "
    "point possible problem process program provide put question quite rather reason reply request "
    "require response rest review rule same save say second see seem send server session set several "
    "show side since so some something sort source space start state step still stop such system take "
    "tell term text than their them thing think three through time too tool top try turn two type under "
    "until up use used user using usually very want was way well were what where whether which while "
    "who why within without word work working would year yet bash submit workspace verifier reward "
    "agent model token tokens prompt completion trace sandbox proxy engine training"
).split()

_COMMANDS = (
    "ls",
    "ls -la",
    "cat {f}",
    "pwd",
    "cd {d}",
    "grep -rn {w} .",
    "python {f}",
    "python -m pytest -q",
    "sed -n '1,40p' {f}",
    "head -n 20 {f}",
    "tail -n 5 {f}",
    "echo {w} > {f}",
    "mkdir -p {d}",
    "find . -name '*.py'",
    "wc -l {f}",
    "git status",
    "git diff",
    "bash tests/test.sh",
    "rm {f}",
    "cp {f} {d}/",
    "python3 -c 'print({n})'",
    "cat > {f} <<'EOF'\n{w} {n}\nEOF",
)
_FILES = (
    "main.py",
    "app.py",
    "utils.py",
    "test_main.py",
    "README.md",
    "config.json",
    "solve.sh",
    "hello.txt",
    "data.csv",
    "setup.py",
    "src/lib.py",
    "tests/test.sh",
    "notes.md",
)
_DIRS = ("src", "tests", "app", "/app", "/logs/verifier", "/tmp/work", "data", "scripts")


_SYLLABLES = tuple(c + v for c in "bcdfghjklmnprstvwxz" for v in ("a", "e", "i", "o", "u", "ai", "ou"))
# Pseudo-words give the BPE enough distinct, frequent pairs to fill its vocabulary.
_LEXICON = tuple("".join(random.Random(i).choices(_SYLLABLES, k=1 + i % 3)) for i in range(3000))


def _word(rng: random.Random) -> str:
    return rng.choice(_WORDS) if rng.random() < 0.85 else rng.choice(_LEXICON)


def _sentence(rng: random.Random) -> str:
    words = [_word(rng) for _ in range(rng.randint(4, 16))]
    return " ".join(words).capitalize() + rng.choice((".", ".", ".", "?", "!", ":"))


def _command(rng: random.Random) -> str:
    template = rng.choice(_COMMANDS)
    return template.format(
        f=rng.choice(_FILES), d=rng.choice(_DIRS), w=rng.choice(_WORDS), n=rng.randint(0, 999)
    )


def _python(rng: random.Random) -> str:
    name = "_".join(_word(rng) for _ in range(2))
    args = ", ".join(rng.sample(("x", "y", "items", "path", "value", "n", "text"), rng.randint(0, 3)))
    body = rng.choice(
        (
            f"    return {rng.choice(('x + y', 'len(items)', 'sorted(items)', 'value * 2', 'n - 1'))}",
            "    for item in items:\n        if item is None:\n            continue\n        print(item)",
            f"    with open(path) as f:\n        return f.read().{rng.choice(('strip', 'split', 'lower'))}()",
            f"    if n <= {rng.randint(0, 3)}:\n        return n\n    return {name}(n - 1) + {name}(n - 2)",
            '    raise ValueError(f"bad value: {value!r}")',
        )
    )
    return f'def {name}({args}):\n    """{_sentence(rng)}"""\n{body}\n'


def _tool_call(rng: random.Random) -> str:
    call = {
        "name": rng.choice(("bash", "read_file", "write_file", "edit", "submit")),
        "arguments": {"command": _command(rng)},
    }
    return f"<tool_call>\n{json.dumps(call)}\n</tool_call>"


def corpus(seed: int = 0, documents: int = 20000) -> Iterator[str]:
    """Yield ``documents`` deterministic training documents for the tokenizer."""
    rng = random.Random(seed)
    makers = (_sentence, _command, _python, _tool_call)
    for _ in range(documents):
        parts = [rng.choice(makers)(rng) for _ in range(rng.randint(1, 6))]
        yield rng.choice(("\n", "\n\n", " ")).join(parts)
