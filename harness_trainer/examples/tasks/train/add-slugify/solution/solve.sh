#!/bin/bash
# Reference solution (absolute paths: works from any cwd).
set -euo pipefail
cat >> /app/textutils.py <<'EOF'


def slugify(text: str) -> str:
    """Lower-case; every run of other characters becomes one '-'; no '-' at either end."""
    import re

    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")
EOF
