"""What the benchmark reports share."""


def markdown(header: list[str], rows: list[list[str]]) -> str:
    """A markdown table of ``rows`` under ``header``."""
    lines = [header, ["---"] * len(header), *rows]
    return "\n".join("| " + " | ".join(line) + " |" for line in lines)
