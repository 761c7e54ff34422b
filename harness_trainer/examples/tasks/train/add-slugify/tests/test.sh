#!/bin/bash
# Verifier: textutils.slugify on six cases, and shout still working.
# Writes two named scores to /logs/verifier/reward.json: "reward" (1.0 only when every case passes and
# shout is intact, else 0.0) and "cases_passed" (the fraction of slugify cases that pass).
mkdir -p /logs/verifier
python3 -B - <<'EOF'
import json
import sys

sys.path.insert(0, "/app")
CASES = {
    "Hello, World!": "hello-world",
    "  Already-slugged  ": "already-slugged",
    "Harbor Tasks 101": "harbor-tasks-101",
    "a__b--c": "a-b-c",
    "MiXeD CaSe": "mixed-case",
    "!!!": "",
}
passed = 0
shout_ok = False
try:
    import textutils

    shout_ok = textutils.shout("hi") == "HI!"
    for text, expected in CASES.items():
        try:
            passed += textutils.slugify(text) == expected
        except Exception as exc:  # a crashing case is a failed case
            print(f"slugify({text!r}) raised {exc!r}")
except Exception as exc:  # no module or no slugify: every case failed
    print(f"could not use textutils: {exc!r}")
fraction = passed / len(CASES)
reward = 1.0 if passed == len(CASES) and shout_ok else 0.0
with open("/logs/verifier/reward.json", "w") as out:
    json.dump({"reward": reward, "cases_passed": fraction}, out)
print(f"cases passed: {passed}/{len(CASES)}, shout intact: {shout_ok}")
EOF
