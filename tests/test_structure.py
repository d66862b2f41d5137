"""Structure ids: chosen positions in a Python snippet, non-Python text, zero-initialised embedding."""

import torch

from nam56r.blocks.structure import Structure as S
from nam56r.blocks.structure import StructureEmbedding, char_structure_ids
from nam56r.config import NAM56RConfig

SNIPPET = '''"""Module doc."""
@functools.cache
def parse(path: str, *rest, n=2) -> int:
    """Parse."""
    s = "text".upper()  # why
    return len(path) + 0x1F
'''


def at(text: str, ids: list[int], needle: str, nth: int = 0) -> set[int]:
    """The set of ids covering the ``nth`` occurrence of ``needle``."""
    start = -1
    for _ in range(nth + 1):
        start = text.index(needle, start + 1)
    return set(ids[start : start + len(needle)])


def test_snippet_labels():
    ids = char_structure_ids(SNIPPET)
    assert len(ids) == len(SNIPPET)
    expected = {
        ('"""Module doc."""', 0): S.DOCSTRING,
        ("@functools.cache", 0): S.DECORATOR,
        ("def", 0): S.KEYWORD,
        ("parse", 0): S.DEFINITION,
        ("path", 0): S.PARAMETER,
        ("str", 0): S.BUILTIN,
        ("rest", 0): S.PARAMETER,
        ("n", 1): S.PARAMETER,  # n of "n=2" (the first "n" is inside "functools")
        ("2", 0): S.NUMBER,
        ("->", 0): S.OPERATOR,
        ("(", 0): S.BRACKET,
        ('"""Parse."""', 0): S.DOCSTRING,
        ('"text"', 0): S.STRING,  # a string statement that goes on (.upper()) is no docstring
        ("upper", 0): S.ATTRIBUTE,
        ("# why", 0): S.COMMENT,
        ("return", 0): S.KEYWORD,
        ("len", 0): S.BUILTIN,
        ("path", 1): S.NAME,  # a use, not the parameter list
        ("0x1F", 0): S.NUMBER,
        ("    ", 0): S.INDENT,
        ("\n", 0): S.WHITESPACE,
    }
    for (needle, nth), label in expected.items():
        assert at(SNIPPET, ids, needle, nth) == {label}, (needle, nth)
    assert S.UNKNOWN not in ids  # valid Python is annotated to the end


def test_non_python_text_never_raises_and_is_unknown_from_the_rejection_on():
    prose = "It's not code."
    ids = char_structure_ids(prose)
    assert len(ids) == len(prose)
    assert ids[:2] == [S.NAME, S.NAME] and set(ids[2:]) == {S.UNKNOWN}  # "It" reads as a name; "'" stops it
    for text in ["$ ls -la\n", 'x = """never closed\n', "x = 1\x00\n", "a\r\u00e9", "", "\\"]:
        ids = char_structure_ids(text)
        assert len(ids) == len(text) and all(0 <= i < 16 for i in ids)
    assert set(char_structure_ids("$ ls -la\n")) == {S.UNKNOWN}
    truncated = char_structure_ids('x = """never closed\n')
    assert truncated[0] == S.NAME and truncated[4:] == [S.UNKNOWN] * 16  # kept before, unknown after


def test_embedding_is_zero_at_init_and_meta_buildable():
    cfg = NAM56RConfig(hidden=8)
    emb = StructureEmbedding(cfg)
    out = emb(torch.tensor([char_structure_ids("x = 1")]))
    assert out.shape == (1, 5, 8) and torch.count_nonzero(out) == 0
    with torch.device("meta"):
        assert StructureEmbedding(NAM56RConfig()).embedding.weight.shape == (16, 4096)
    assert len(S) <= cfg.structure_vocab
