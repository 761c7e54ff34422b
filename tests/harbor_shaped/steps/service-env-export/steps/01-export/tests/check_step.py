import sys

sys.path.insert(0, "/tests")
from common import env_lines, expect

expect(
    env_lines(),
    [
        "SERVER_HOST=0.0.0.0",
        "SERVER_PORT=8080",
        "DATABASE_URL=postgres://orders@db:5432/orders",
        "DATABASE_POOL=5",
    ],
)
