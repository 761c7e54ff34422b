"""The shell a docker sandbox's commands run under: the wrapper each command is started in (its own process
group, its output in files, its exit code first), the killer of a command's group, and the login profile
that keeps the sandbox's PATH."""

from __future__ import annotations

MAX_OUTPUT_BYTES = 16 << 20
EXEC_DIR = "/run/ht-exec"
# $1 = exec id, $2 = command. The command runs in its own process group (job control), its output in
# files, so a background child that keeps them open cannot hold the exec open; at its end the wrapper
# prints its exit code on a line of its own, then the tails of its stdout and stderr.
WRAP = f"""d={EXEC_DIR}/$1; mkdir -p "$d" || exit 125
set -m
/bin/bash -lc "$2" >"$d/out" 2>"$d/err" </dev/null &
p=$!; set +m; echo $p >"$d/pid"
wait $p; rc=$?
echo $rc; tail -c {MAX_OUTPUT_BYTES} "$d/out"; tail -c {MAX_OUTPUT_BYTES} "$d/err" >&2; rm -rf "$d"; exit $rc
"""
# $1 = exec id, $2 = grace in 50 ms ticks: SIGTERM to the command's group, SIGKILL when it outlives it.
KILL = f"""f={EXEC_DIR}/$1/pid; i=0
while [ ! -s "$f" ] && [ $i -lt 40 ]; do sleep 0.05; i=$((i+1)); done
p=$(cat "$f" 2>/dev/null) || exit 0
kill -TERM -- "-$p" 2>/dev/null || exit 0
i=0; while kill -0 -- "-$p" 2>/dev/null && [ $i -lt "$2" ]; do sleep 0.05; i=$((i+1)); done
kill -KILL -- "-$p" 2>/dev/null; exit 0
"""
BASH_PROFILE = """\
# Written by harness-trainer's docker sandbox: /etc/profile resets PATH in a login shell; restore ours.
if [ -n "${__HT_PATH-}" ]; then PATH=$__HT_PATH; export PATH; fi
unset __HT_PATH
if [ -f "$HOME/.profile" ]; then . "$HOME/.profile"; fi
"""
