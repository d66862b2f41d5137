"""Structure-aware code signals: a per-character syntactic class, read off the code by Python's ``tokenize``.

The data pipeline labels every character of a source file with one of the ids below, maps them to tokens and
stores them as a second indexed dataset aligned with the tokens; the model adds ``StructureEmbedding(ids)`` to
the token embedding. No model is involved in the labelling, only the standard-library tokenizer.

====  ==========  ========================================================================================
 id   name        characters it marks
====  ==========  ========================================================================================
  0   UNKNOWN     not annotated: text that is not Python, from the first point the tokenizer rejects on
  1   WHITESPACE  spaces between tokens, newlines, blank lines, backslash line continuations
  2   INDENT      leading whitespace of a line that is not a continuation line (outside brackets)
  3   COMMENT     ``# ...`` up to the end of the line
  4   STRING      string and bytes literals; an f-string as a whole, its ``{expressions}`` included
  5   DOCSTRING   a string statement opening a module, ``class`` or ``def`` body
  6   NUMBER      numeric literals
  7   KEYWORD     hard keywords (``keyword.kwlist``, ``True``/``False``/``None`` included)
  8   NAME        other identifiers; soft keywords (``match``, ``case``, ``type``, ``_``) too, since only
                  the parser can tell them from names
  9   BUILTIN     an identifier naming a public builtin (``print``, ``len``, ``int``, ``ValueError``)
 10   DEFINITION  the name right after ``def`` or ``class``
 11   PARAMETER   a parameter name in a ``def``'s parameter list (not its annotations or defaults)
 12   ATTRIBUTE   an identifier right after ``.``
 13   OPERATOR    operators and delimiters other than brackets (``=``, ``+``, ``,``, ``:``, ``->``, ``.``)
 14   BRACKET     ``( ) [ ] { }``
 15   DECORATOR   the ``@`` opening a decorator line and the dotted name after it (not its arguments)
====  ==========  ========================================================================================

Precedence for identifiers: DECORATOR, DEFINITION, KEYWORD, ATTRIBUTE, PARAMETER, BUILTIN, NAME.

UNKNOWN is a label, not a silent fallback: a corpus of "code" holds prose, JSON, C, notebooks with shell
magics and truncated files, and the honest annotation of text the Python tokenizer cannot read is "unknown".
So ``char_structure_ids`` never raises: where the tokenizer stops (an exception in ``TOKENIZER_REJECTS``,
an ``ERRORTOKEN`` or a character that is no Python operator), everything from that point on keeps id 0, and
everything before keeps the labels it got. Python 3.11 reports a bad character as ``ERRORTOKEN`` where 3.12+
raises or emits an ``OP`` no operator table knows (``$``); stopping at any of them, and reading f-strings whole
(3.12+ splits them into tokens), makes 3.11, 3.12 and 3.13 label valid Python identically. On malformed text
the point of rejection can still differ (3.12+ rejects NUL bytes and inconsistent tabs at the first line), and
the builtin names come from the running interpreter, so the pipeline should record its Python version.
"""

from __future__ import annotations

import builtins
import enum
import io
import keyword
import tokenize
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from nam56r.config import NAM56RConfig  # the config's rules count Structure: no import back at run time


class Structure(enum.IntEnum):
    UNKNOWN = 0
    WHITESPACE = 1
    INDENT = 2
    COMMENT = 3
    STRING = 4
    DOCSTRING = 5
    NUMBER = 6
    KEYWORD = 7
    NAME = 8
    BUILTIN = 9
    DEFINITION = 10
    PARAMETER = 11
    ATTRIBUTE = 12
    OPERATOR = 13
    BRACKET = 14
    DECORATOR = 15


# How the tokenizer says "not Python": TokenError and SyntaxError (IndentationError included) by design; CPython
# 3.12/3.13's C tokenizer also raises UnicodeDecodeError (a ValueError) on a lone "\r" before non-ASCII text and
# SystemError on some NUL bytes. Only the tokenizer's own ``next`` is guarded, so our bugs still raise.
TOKENIZER_REJECTS = (tokenize.TokenError, SyntaxError, ValueError, SystemError)
BUILTIN_NAMES = frozenset(n for n in dir(builtins) if not n.startswith("_"))
OPEN_BRACKETS, CLOSE_BRACKETS = frozenset("([{"), frozenset(")]}")
# 3.12+ splits f-strings (3.14: t-strings) into start / middle / end tokens; 3.11 has none of these.
STRING_STARTS = frozenset(getattr(tokenize, n) for n in ("FSTRING_START", "TSTRING_START") if hasattr(tokenize, n))
STRING_ENDS = frozenset(getattr(tokenize, n) for n in ("FSTRING_END", "TSTRING_END") if hasattr(tokenize, n))


def char_structure_ids(text: str) -> list[int]:
    """One ``Structure`` id per character of ``text`` (same length); never raises (see the module docstring)."""
    annotator = _Annotator(text)
    tokens = tokenize.generate_tokens(annotator.readline)
    while True:
        try:
            tok = next(tokens)
        except StopIteration:
            break
        except TOKENIZER_REJECTS:
            break  # the rest keeps UNKNOWN: the defined label for text the tokenizer rejects
        if not annotator.step(tok):
            break
    return annotator.labels


class _Annotator:
    """Walks the token stream once, keeping the little context the labels need."""

    def __init__(self, text: str):
        self.text = text
        self.labels = [int(Structure.UNKNOWN)] * len(text)
        self._reader = io.StringIO(text)
        self.line_start: list[int] = []  # char offset of each line tokenize has read (row r -> [r - 1])
        self._read = 0
        self.covered = 0  # chars before this offset are labelled
        self.last_label = int(Structure.WHITESPACE)
        self.prev: str | None = None  # previous significant token's text; None at a statement start
        self.statement_start = True  # the next token begins a logical line
        self.depth = 0  # bracket depth
        self.awaiting_params = False  # seen ``def NAME``, its "(" opens the parameter list
        self.param_depth: int | None = None  # bracket depth inside that parameter list
        self.in_decorator = False
        self.line_defines = False  # the current logical line is a def/class header
        self.header_defines = False  # the previous logical line was
        self.docstring_allowed = True  # module start, or the first statement of a def/class body
        self.pending_docstring: tuple[int, int] | None = None  # span waiting for "is it the whole statement?"
        self.string_depth = 0  # inside an f-string / t-string (3.12+ tokens)

    def readline(self) -> str:
        line = self._reader.readline()
        self.line_start.append(self._read)
        self._read += len(line)
        return line

    def offset(self, row: int, col: int) -> int:
        if row - 1 >= len(self.line_start):
            return len(self.text)
        return min(self.line_start[row - 1] + col, len(self.text))

    def step(self, tok: tokenize.TokenInfo) -> bool:
        """Label one token and the gap before it; False where the text stops being Python."""
        if tok.type == tokenize.ERRORTOKEN or (
            tok.type == tokenize.OP and tok.string not in tokenize.EXACT_TOKEN_TYPES
        ):
            return False
        a, b = self.offset(*tok.start), self.offset(*tok.end)
        self.fill_gap(a, tok.start[0])
        self.settle_docstring(tok.type)
        label = self.classify(tok)
        if label is not None and b > a:
            self.labels[a:b] = [int(label)] * (b - a)
            self.last_label = int(label)
        self.covered = max(self.covered, b)
        return True

    def fill_gap(self, end: int, row: int) -> None:
        """Label the characters no token claims, between the last token and ``end`` (on line ``row``)."""
        line_start = self.offset(row, 0)
        leading = self.statement_start and self.covered <= line_start
        for i in range(self.covered, end):
            ch = self.text[i]
            if ch in " \t\f" and leading and i >= line_start:
                self.labels[i] = int(Structure.INDENT)
            elif ch.isspace() or ch == "\\":
                self.labels[i] = int(Structure.WHITESPACE)
            else:  # a span the tokenizer reports short (3.12 f-string "{{" escapes): same as its token
                self.labels[i] = self.last_label

    def settle_docstring(self, next_type: int) -> None:
        """A docstring candidate is one only if the statement ends right after it (``"a".join(x)`` is not)."""
        if self.pending_docstring is None:
            return
        if next_type not in (tokenize.NEWLINE, tokenize.NL, tokenize.COMMENT, tokenize.ENDMARKER):
            a, b = self.pending_docstring
            self.labels[a:b] = [int(Structure.STRING)] * (b - a)
        if next_type != tokenize.COMMENT:
            self.pending_docstring = None

    def classify(self, tok: tokenize.TokenInfo) -> Structure | None:
        t = tok.type
        if self.string_depth or t in STRING_STARTS:
            self.string_depth += (t in STRING_STARTS) - (t in STRING_ENDS)
            self.significant(tok.string)
            return Structure.STRING
        if t == tokenize.COMMENT:
            return Structure.COMMENT
        if t in (tokenize.NEWLINE, tokenize.NL):
            if t == tokenize.NEWLINE:
                self.header_defines, self.line_defines = self.line_defines, False
                self.prev, self.in_decorator = None, False
            if t == tokenize.NEWLINE or self.depth == 0:  # an NL inside brackets continues the statement
                self.statement_start = True
            return Structure.WHITESPACE
        if t == tokenize.INDENT:
            self.docstring_allowed = self.header_defines
            return Structure.INDENT
        if t in (tokenize.DEDENT, tokenize.ENDMARKER):
            return None  # zero width
        at_start, docstring_ok = self.statement_start, self.docstring_allowed
        prev = self.prev
        self.significant(tok.string)
        if t == tokenize.STRING:
            prefix = tok.string[: len(tok.string) - len(tok.string.lstrip("rRuUbBfF"))].lower()
            if docstring_ok and "f" not in prefix and "b" not in prefix:
                self.pending_docstring = (self.offset(*tok.start), self.offset(*tok.end))
                return Structure.DOCSTRING
            return Structure.STRING
        if t == tokenize.NUMBER:
            return Structure.NUMBER
        if t == tokenize.OP:
            return self.classify_op(tok.string, at_start)
        if t == tokenize.NAME:
            return self.classify_name(tok.string, prev)
        return Structure.UNKNOWN  # a token type this tokenizer version added and this table does not know

    def significant(self, text: str) -> None:
        self.prev = text
        self.statement_start = False
        self.docstring_allowed = False

    def classify_op(self, op: str, at_start: bool) -> Structure:
        if op == "@" and at_start:
            self.in_decorator = True
            return Structure.DECORATOR
        if self.in_decorator and op == ".":
            return Structure.DECORATOR
        self.in_decorator = False
        if op in OPEN_BRACKETS:
            self.depth += 1
            if op == "(" and self.awaiting_params:
                self.awaiting_params, self.param_depth = False, self.depth
            return Structure.BRACKET
        if op in CLOSE_BRACKETS:
            if self.depth == self.param_depth:
                self.param_depth = None
            self.depth = max(self.depth - 1, 0)
            return Structure.BRACKET
        return Structure.OPERATOR

    def classify_name(self, name: str, prev: str | None) -> Structure:
        if self.in_decorator:
            return Structure.DECORATOR
        if prev in ("def", "class"):
            self.awaiting_params, self.line_defines = prev == "def", True
            return Structure.DEFINITION
        if keyword.iskeyword(name):
            return Structure.KEYWORD
        if prev == ".":
            return Structure.ATTRIBUTE
        if self.depth == self.param_depth and prev in ("(", ",", "*", "**"):
            return Structure.PARAMETER
        if name in BUILTIN_NAMES:
            return Structure.BUILTIN
        return Structure.NAME


class StructureEmbedding(nn.Module):
    """``nn.Embedding(structure_vocab, hidden)``, zero at init: a model with structure signals starts out
    computing exactly what the same model without them computes."""

    def __init__(self, cfg: NAM56RConfig):
        super().__init__()
        if cfg.structure_vocab < len(Structure):
            raise ValueError(
                f"structure_vocab must be >= {len(Structure)} (the ids in nam56r/blocks/structure.py), "
                f"found {cfg.structure_vocab}; raise it in the recipe"
            )
        self.embedding = nn.Embedding(cfg.structure_vocab, cfg.hidden)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.embedding.weight)

    def forward(self, structure_ids: torch.Tensor) -> torch.Tensor:
        return self.embedding(structure_ids)  # [b, s] -> [b, s, hidden]
