"""Small text helpers."""


def shout(text: str) -> str:
    """Upper-case ``text`` and add an exclamation mark."""
    return text.upper() + "!"
