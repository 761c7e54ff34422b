"""capture_proxy: the token-capturing proxy between black-box agents and an inference engine.

It stands alone (it never imports ``harness_trainer`` or torch). Entry points:

- ``python -m capture_proxy --upstream URL --data-dir DIR`` (or ``harness-trainer proxy``): serve it;
- :func:`capture_proxy.app.build_app` with a :class:`capture_proxy.config.ProxyConfig`: the aiohttp app;
- :func:`capture_proxy.export.trace_from_journal`: a session's TrainingTrace from its journal, offline;
- :func:`capture_proxy.assembly.assemble_trace`: the same from records in memory.

The wire contract is in the repository's ``docs/design.md``; the journal format in ``JOURNAL.md`` beside
this file.
Importing the package imports nothing else, so entry points that only need the CLI stay light.
"""

from __future__ import annotations

__version__ = "0.1.0"
