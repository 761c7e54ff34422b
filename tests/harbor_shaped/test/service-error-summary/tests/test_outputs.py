from pathlib import Path


def expected():
    counts = {}
    for log in Path("/app/logs").glob("*.log"):
        errors = sum(1 for line in log.read_text().splitlines() if line.split()[1:2] == ["ERROR"])
        if errors:
            counts[log.stem] = errors
    return [f"{name} {count}" for name, count in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))]


def test_summary_lists_services_with_errors():
    assert Path("/app/error_summary.txt").read_text().splitlines() == expected()
