import sys
from pathlib import Path

sys.path.insert(0, "/tests")
from common import env_lines, expect

if Path("/app/setup.sh").exists():
    sys.exit("the step's setup hook was left in the working directory")
expect(
    env_lines(),
    [
        "SERVER_HOST=0.0.0.0",
        "SERVER_PORT=9000",
        "DATABASE_URL=postgres://orders@db:5432/orders",
        "DATABASE_POOL=5",
        "LOGGING_LEVEL=debug",
    ],
)
