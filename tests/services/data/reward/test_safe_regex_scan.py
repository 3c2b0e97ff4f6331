"""The repeat count of a reward pattern, read from its text as `re` reads it: escapes, sets,
groups, comments and verbose mode decide what a quantifier repeats."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import services.core.safe_regex as safe_regex
from services.core.safe_regex import MAX_REPEAT_COUNT, check_pattern


@pytest.mark.parametrize(
    ("pattern", "count"),
    [
        (r"a{3}b{2,5}c{4,}d{,7}e*f+g?", 22),
        (r"\x41{5}", 5),
        (r"\u0041{5}", 5),
        (r"\N{LATIN SMALL LETTER A}{5}", 5),
        (r"\012{3}", 3),  # three octal digits: one character
        (
            r"(a)(b)(c)(d)(e)(f)(g)(h)(i)(j)(k)\11{3}",
            14,
        ),  # two digits: a group's number
        (r"[]{]{5}", 5),  # a `]` first in a set is a member
        (r"[\]]{6}", 6),
        (r"a{}", 3),  # `{}` and `{x}` are literal braces
        (r"a{x}{2}", 5),
        (r"a\{3}{2}", 5),
        ("(?x) a {3} # c{100}\n b{2}", 5),  # verbose: spaces and comments are no items
        (r"(?x:a {3} b)c {2}", 7),
        (r"(?#x{99})a{3}", 3),
        (r"(?#a\)b{9999})a{3}", 3),  # an escaped `)` does not end a comment
        (r"(?P<n>a{3})(?P=n){4}", 7),
        (r"(a)?(?(1)b{3}|c{4})", 8),  # both branches of a condition
        (r"(?=a{3})(?!b{2})(?<=c)(?<!d)", 7),
        (r"(?>a{5})+", 5),
        (r"a{3}?b{3}+", 6),
        (r"x{2}|y{3}|", 5),
    ],
)
def test_the_count_follows_re_syntax(pattern: str, count: int) -> None:
    re.compile(pattern)
    assert safe_regex._repeat_count(pattern) == count


def test_a_repeat_hidden_from_a_naive_scan_is_still_refused() -> None:
    """The repeat after an octal escape binds to that escape, not to a digit of it."""
    check_pattern(r"\101{9999}")
    with pytest.raises(ValueError, match=f"at most {MAX_REPEAT_COUNT}"):
        check_pattern(r"(?:\101{9999}){2}")


def test_no_private_standard_library_module_is_imported() -> None:
    """`re._parser` and the other `_` modules change without notice between Python releases."""
    tree = ast.parse(Path(safe_regex.__file__).read_text())
    names = [alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names]
    names += [node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)]
    private = [
        name
        for name in names
        if name.startswith("sre_") or any(part[:1] == "_" != part[1:2] for part in name.split("."))
    ]
    assert not private
