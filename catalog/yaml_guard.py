"""Every YAML file distplan reads (catalog entries, `validate --plan`, `calibrate`'s catalog copies) is
read here: its size capped before it is read, anchors and aliases refused and nesting bounded before
anything is built, so a few hundred bytes (the "billion laughs") cannot expand to gigabytes, and every
refusal is one line saying what is accepted. The caller names the file in its message."""

from __future__ import annotations

from pathlib import Path

MAX_FILE_BYTES = 2**20
"""A catalog or plan file is a few KB; a larger one is refused before it is read (1 MiB)."""
MAX_YAML_DEPTH = 4
"""Catalog files are a mapping of scalars and lists of strings (depth 2), plan files a list of such
mappings (depth 3); deeper nesting is refused."""


class Refused(Exception):
    """A YAML file distplan does not read (too large, anchors, aliases, deep nesting, not UTF-8, invalid):
    one line, without the file's name."""


def yaml_load(text: str, max_depth: int = MAX_YAML_DEPTH, accepted: str = "a mapping of key: value, values "
              "numbers, strings or lists of strings"):
    """The YAML document, refusing anchors and aliases (`&a` / `*a`) and nesting deeper than `max_depth`
    before anything is built: the events pass costs time linear in the text."""
    import yaml  # lazy: the planner imports nothing from here until a lookup is needed

    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    depth = 0
    for event in yaml.parse(text, Loader=loader):
        if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None) is not None:
            raise Refused("uses a YAML anchor or alias (&name / *name); accepted: plain YAML, "
                          "each value written out")
        if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
            depth += 1
            if depth > max_depth:
                raise Refused(f"nests deeper than {max_depth} levels; accepted: {accepted}")
        elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
            depth -= 1
    return yaml.load(text, Loader=loader)


def read_yaml(path: str | Path, what: str = "a catalog file", max_bytes: int = MAX_FILE_BYTES,
              max_depth: int = MAX_YAML_DEPTH, accepted: str | None = None):
    """The YAML document of the regular file `path`, at most `max_bytes` (refused unread past it), through
    `yaml_load`'s guards; else `Refused` (one line). `what` names the kind of file in the messages."""
    kw = {"accepted": accepted} if accepted else {}
    p = Path(path)
    if p.exists() and not p.is_file():
        raise Refused(f"is not a regular file; accepted: {what}")
    try:
        with open(p, "rb") as fh:
            raw = fh.read(max_bytes + 1)
        if len(raw) > max_bytes:
            raise Refused(f"is over {max_bytes / 2**20:g} MiB; accepted: {what} (a few KB)")
        return yaml_load(raw.decode("utf-8"), max_depth, **kw)
    except Refused:
        raise
    except OSError as e:
        raise Refused(f"cannot read it ({e.strerror or e})") from None
    except UnicodeDecodeError as e:
        raise Refused(f"is not UTF-8 text (byte {e.start}); accepted: a UTF-8 YAML file") from None
    except RecursionError:
        raise Refused("nests too deeply; accepted: a mapping of key: value") from None
    except Exception as e:  # yaml.YAMLError; keep it to one line
        if isinstance(e, ValueError) and "integer string conversion" in str(e):  # int() of 4,300+ digits
            raise Refused("holds an integer of over 4,300 digits; accepted: figures of a few digits "
                          "each") from None
        msg = " ".join(str(e).split())
        msg = msg if len(msg) <= 200 else msg[:197] + "..."
        raise Refused(f"invalid YAML ({msg})") from None
