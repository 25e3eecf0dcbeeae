"""A prediction that loops: the same phrase over and over inside one string ("No such user: No such group: No
such ..."). Torch-free: the decoder's constraint closes such a string (`constrain.RowMatcher`), and the reports
count the predictions that still contain one (`app.divergence.looping`)."""
from __future__ import annotations

import re

_WORD = re.compile(r"\w+")
MAX_REPEATS = 4
"""A phrase may appear this many times in a row; one more is a loop. Calibrated on real responses: at 4, none
of the 1,303 distinct responses of BFCL's training split counts as a loop (real records repeat "Not installed"
four times), while 12 of the shipped adapter's 290 forced held-out predictions do (every one of them looped
until the token budget cut it off, "unable to touch 'a.csv': unable to touch 'a.csv': ..."); at 2, 19 real
responses would."""
MIN_PHRASE_CHARS = 6
"""A phrase is two consecutive words of at least this many characters together ("No such", "a/b c/d")."""
MAX_GAP_WORDS = 6
"""Repeats count as a loop only this close together: at most this many other words between two of them
("No such user: No such group: No such ..."); real text that mentions a phrase again later is not a loop."""


def repeated_phrase(text: str, max_repeats: int = MAX_REPEATS) -> str | None:
    """The first two-word phrase that `text` repeats more than `max_repeats` times in a row, or None."""
    words = _WORD.findall(text.lower())
    runs: dict[str, tuple[int, int]] = {}  # phrase -> (last position, repeats in the current run)
    for i, (a, b) in enumerate(zip(words, words[1:])):
        if len(a) + len(b) + 1 < MIN_PHRASE_CHARS:
            continue
        phrase = f"{a} {b}"
        last, run = runs.get(phrase, (-100, 0))
        run = run + 1 if i - last - 2 <= MAX_GAP_WORDS else 1
        runs[phrase] = (i, run)
        if run > max_repeats:
            return phrase
    return None


def open_string(text: str) -> str | None:
    """The content of the JSON string `text` ends inside (None when it is not inside one)."""
    inside, escaped, start = False, False, 0
    for i, ch in enumerate(text):
        if inside:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                inside = False
        elif ch == '"':
            inside, start = True, i + 1
    return text[start:] if inside else None


__all__ = ["MAX_GAP_WORDS", "MAX_REPEATS", "MIN_PHRASE_CHARS", "open_string", "repeated_phrase"]
