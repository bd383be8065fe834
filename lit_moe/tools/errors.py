"""Running the path-taking subcommands (``preprocess``, ``convert-config``, ``convert-hf``, ``plan``) so that
a user's bad path is one line naming it, never a traceback, and nothing already saved is overwritten.

Before the tool runs, its output path is checked (``OUTPUTS``): an output file that already exists,
a non-empty output directory, an output whose parent is a file. While it runs, the errors a bad input
raises deep inside a library (an unreadable or truncated ``.gz``/``.xz``, bytes that are not UTF-8,
a permission error) are caught here and reported with the path the OS or the arguments name.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Optional

# subcommand → (option, kind) of its outputs; kind "file" must not exist, "dir" must be absent or empty,
# "prefix" names ``PREFIX_<json-key>_document.{bin,idx}`` files that must not exist.
OUTPUTS = {
    "convert-config": [("-o", "file"), ("--output", "file")],
    "convert-hf": [("--output", "dir")],
    "preprocess": [("--output-prefix", "prefix")],
}
# subcommand → options naming inputs (reported when a decompressor fails without naming its file).
INPUTS = {
    "convert-config": [None],  # positional graph.yaml
    "convert-hf": ["--config", "--checkpoint"],
    "preprocess": ["--input"],
    "plan": ["--config", "-c"],
    "predict": ["--config", "--checkpoint", "--prompts-file"],
}


MAX_TOKEN_CHARS = 160   # a longer run of non-space characters in an error line is cut in the middle
MAX_LINE_CHARS = 1000


def one_line(message: object) -> str:
    """An error message as one bounded line: its first three non-empty lines joined, each run of
    non-space characters longer than ``MAX_TOKEN_CHARS`` (a 200 kB value pasted into a key) cut to
    its start and end with the number of characters left out, the whole at most ``MAX_LINE_CHARS``."""
    lines = [ln.strip() for ln in str(message).splitlines() if ln.strip()]
    words = " ".join(lines[:3]).split(" ") if lines else ["invalid", "configuration"]
    keep = MAX_TOKEN_CHARS // 2
    cut = [w if len(w) <= MAX_TOKEN_CHARS else f"{w[:keep]}…[{len(w) - keep - 20:,} characters]…{w[-20:]}"
           for w in words]
    line = " ".join(cut)
    return line if len(line) <= MAX_LINE_CHARS else line[:MAX_LINE_CHARS - 1] + "…"


class ToolPathError(Exception):
    """A bad output path, found before the tool writes anything."""


def _option_values(argv: list[str], option: Optional[str]) -> list[str]:
    if option is None:
        return [a for a in argv if not a.startswith("-")][:1]
    out = []
    for i, arg in enumerate(argv):
        name, eq, value = arg.partition("=")
        if name == option:
            if eq:
                out.append(value)
            else:
                j = i + 1
                while j < len(argv) and not argv[j].startswith("-"):
                    out.append(argv[j])
                    j += 1
    return out


def _json_key(argv: list[str]) -> str:
    values = _option_values(argv, "--json-key")
    return values[0] if values else "text"


def check_outputs(tool: str, argv: list[str]) -> None:
    for option, kind in OUTPUTS.get(tool, []):
        for path in _option_values(argv, option):
            targets = [path]
            if kind == "prefix":
                stem = f"{path}_{_json_key(argv)}_document"
                targets = [stem + ".bin", stem + ".idx"]
            for target in targets:
                parent = os.path.dirname(os.path.abspath(target))
                if kind == "dir":
                    if os.path.isfile(target):
                        raise ToolPathError(f"{option} {target}: is a file, not a directory")
                    if os.path.isdir(target) and os.listdir(target):
                        raise ToolPathError(f"{option} {target}: the directory exists and is not empty; choose a new "
                                            "directory (nothing was written)")
                elif os.path.isdir(target):
                    raise ToolPathError(f"{option} {target}: is a directory; give a file path")
                elif os.path.exists(target):
                    raise ToolPathError(f"{option} {target}: already exists; choose another path or remove it "
                                        "(nothing was written)")
                probe = parent
                while probe and not os.path.exists(probe):
                    probe = os.path.dirname(probe) if os.path.dirname(probe) != probe else ""
                if probe and not os.path.isdir(probe):
                    raise ToolPathError(f"{option} {target}: {probe} is a file, not a directory")
                if kind == "file" and not os.path.isdir(parent):
                    raise ToolPathError(f"{option} {target}: the directory {parent} does not exist")
                if probe and not os.access(probe, os.W_OK | os.X_OK):
                    raise ToolPathError(f"{option} {target}: {probe} is not writable")


def _describe(err: BaseException, tool: str, argv: list[str]) -> str:
    if isinstance(err, OSError) and getattr(err, "filename", None):
        return f"{err.filename}: {err.strerror or err}"
    inputs = [p for opt in INPUTS.get(tool, []) for p in _option_values(argv, opt)]
    where = ", ".join(inputs) if inputs else "input"
    if isinstance(err, UnicodeDecodeError):
        return f"{where}: not UTF-8 text ({err.reason} at byte {err.start})"
    if isinstance(err, EOFError):
        return f"{where}: the compressed file is truncated ({err})"
    return f"{where}: {type(err).__name__}: {' '.join(str(err).split())}"


def run_tool(tool: str, module: str, argv: list[str]) -> int:
    import gzip
    import lzma
    import zlib

    try:
        check_outputs(tool, argv)
    except ToolPathError as err:
        print(f"lit_moe {tool}: error: {one_line(err)}", file=sys.stderr)
        return 2
    from lit_moe.config import ConfigError

    main = importlib.import_module(module).main
    try:
        return int(main(argv) or 0)
    except ConfigError as err:  # a tool that lets its configuration error through
        print(f"lit_moe {tool}: error: {one_line(err)}", file=sys.stderr)
        return 2
    except (OSError, EOFError, UnicodeDecodeError, lzma.LZMAError, zlib.error, gzip.BadGzipFile) as err:
        print(f"lit_moe {tool}: error: {one_line(_describe(err, tool, argv))}", file=sys.stderr)
        return 2
