"""The supervisor on its own: orphans reaped when the launcher is their reaper (as the job's PID 1 is)."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_orphans_re_parented_to_the_launcher_do_not_stay_zombies() -> None:
    program = textwrap.dedent(
        """
        import ctypes, os
        from harness_trainer.jobs.process_supervisor import Supervisor

        ctypes.CDLL(None).prctl(36, 1)  # PR_SET_CHILD_SUBREAPER: orphans come to us, as to a PID 1
        supervisor = Supervisor()
        supervisor.start("parent", ["bash", "-c", "(sleep 0.2 &); exec sleep 30"], dict(os.environ),
                         stop_timeout_s=5)
        supervisor.sleep(1.5)

        def zombies():
            found = []
            for entry in os.listdir("/proc"):
                try:
                    fields = open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()
                except (OSError, ValueError):
                    continue
                if fields[0] == "Z" and int(fields[1]) == os.getpid():
                    found.append(entry)
            return found

        print(len(zombies()))
        supervisor.stop_all()
        """
    )
    result = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "0"
