"""Typed, strict loader for the hardware and model catalog (YAML files under catalog/).

Owns the four entry types (`GPU`, `Interconnect`, `Node`, `ModelEntry`), the unit conversion from
the YAML keys (`memory_gib`, `line_rate_gbit_per_s`, `latency_us`, ...) to base units (bytes,
bytes/s, FLOP/s, seconds), and the layering of user catalog directories over the built-in one.

Rules (house style, calculon-ai/calculon `systems/*.json` loaders): every numeric key carries its unit
as a suffix; unknown keys, numbers without a unit, impossible values (a fraction outside (0, 1],
zero or negative sizes and rates, non-integer counts), missing required keys, a missing `source:`
and references to unknown entries are all rejected with a one-line `CatalogError` that names the
file, the key and what is accepted. Conversion happens once, here.

Nothing is read at import time: `load_catalog()` reads the files on first use and caches the result
per tuple of directories.

Known limitations: a user directory replaces whole entries (same file stem), it cannot patch one key
of a built-in entry; duplicate keys inside one YAML file are not detected (PyYAML keeps the last).
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

from .limits import LIMITS
from .yaml_guard import MAX_FILE_BYTES, MAX_YAML_DEPTH, Refused, read_yaml, yaml_load  # noqa: F401

from .entries import GPU, CatalogError, Interconnect, ModelEntry, Node, _short

__all__ = [
    "CatalogError", "GPU", "Interconnect", "Node", "ModelEntry", "Catalog", "load_catalog",
    "clear_cache", "BUILTIN_DIR", "KINDS", "UNIT_SUFFIXES",
]

BUILTIN_DIR = Path(__file__).resolve().parent
"""The built-in catalog: this package's folder, with gpus/, interconnects/, nodes/, models/."""

KINDS = ("gpus", "interconnects", "nodes", "models")
"""Sub-folders of a catalog directory, one per entry type."""

ENV_VAR = "DISTPLAN_CATALOG"
"""Extra catalog directories, os.pathsep-separated, layered over the built-in catalog."""


# -- units ----------------------------------------------------------------------------------------

# suffix -> (dimension, factor to base units). Checked longest first, so `_gb_per_s` wins over `_gb`.
UNIT_SUFFIXES: dict[str, tuple[str, float]] = {
    "_gbit_per_s": ("bytes_per_s", 1e9 / 8),   # 1e9 bits/s
    "_gb_per_s": ("bytes_per_s", 1e9),         # 1e9 bytes/s
    "_fraction": ("fraction", 1.0),            # 0 < x <= 1
    "_tflops": ("flops", 1e12),                # 1e12 FLOP/s
    "_count": ("count", 1),                    # positive integer
    "_gib": ("bytes", float(2**30)),           # GiB = 2^30 bytes
    "_mib": ("bytes", float(2**20)),           # MiB = 2^20 bytes
    "_gb": ("bytes", 1e9),                     # GB = 1e9 bytes
    "_us": ("seconds", 1e-6),                  # microseconds
    "_gflop": ("flop", 1e9),                   # 1e9 floating-point operations (a GEMM's 2*m*n*k)
}
_SUFFIXES_LONGEST_FIRST = sorted(UNIT_SUFFIXES, key=len, reverse=True)
_ACCEPTED_UNITS = ", ".join(sorted(UNIT_SUFFIXES))


def _split_unit(key: str) -> tuple[str, str] | None:
    for suffix in _SUFFIXES_LONGEST_FIRST:
        if key.endswith(suffix) and len(key) > len(suffix):
            return key[: -len(suffix)], suffix
    return None


# -- schema ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Kind:
    numeric: dict[str, tuple[str, bool]]        # base name -> (dimension, required)
    text: dict[str, bool]                        # key -> required (strings)
    enums: dict[str, tuple[tuple[str, ...], bool]] = field(default_factory=dict)
    bools: tuple[str, ...] = ()


_COMMON_TEXT = {"name": False, "vendor": False, "notes": False}

_SCHEMA: dict[str, _Kind] = {
    "gpus": _Kind(
        numeric={
            "memory": ("bytes", True),
            "hbm_bandwidth": ("bytes_per_s", True),
            "fp32": ("flops", False),
            "tf32": ("flops", False),
            "fp16": ("flops", False),
            "bf16": ("flops", False),
            "matmul_efficiency": ("fraction", True),
            "nvlink_links": ("count", False),
            "matmul_half_efficiency": ("flop", False),
            "hbm_efficiency": ("fraction", False),
            "attention_efficiency": ("fraction", False),
            "attention_backward_efficiency": ("fraction", False),
            "kernel_overhead": ("seconds", False),
            "host_op": ("seconds", False),
            "sm": ("count", False),
        },
        text={**_COMMON_TEXT, "vendor": True, "scale_up_link": True},
        enums={"vendor": (("nvidia", "amd", "intel", "other"), True)},
    ),
    "interconnects": _Kind(
        numeric={
            "line_rate": ("bytes_per_s", True),
            "busbw_efficiency": ("fraction", True),
            "latency": ("seconds", True),
            "half_efficiency_size": ("bytes", True),
            "nvls_busbw": ("bytes_per_s", False),
            "nvls_latency": ("seconds", False),
            "scale_out_loss": ("fraction", False),
        },
        text=dict(_COMMON_TEXT),
        enums={
            "kind": (("nvlink", "pcie", "infiniband", "roce", "tcp", "xgmi"), True),
            "tier": (("intra_node", "inter_node"), True),
        },
        bools=("simple_protocol_only", "ring_only"),
    ),
    "nodes": _Kind(
        numeric={"gpus_per_node": ("count", True), "nics_per_node": ("count", True),
                 "host_memory": ("bytes", False)},
        text={**_COMMON_TEXT, "gpu": True, "intra_link": True, "inter_link": True},
    ),
    "models": _Kind(
        numeric={
            "layers": ("count", True),
            "hidden": ("count", True),
            "heads": ("count", True),
            "kv_heads": ("count", True),
            "ffn_hidden": ("count", True),
            "vocab": ("count", True),
            "max_positions": ("count", True),
            "params_published": ("count", False),
        },
        text=dict(_COMMON_TEXT),
        enums={
            "mlp": (("swiglu", "gelu"), True),
            "norm": (("rmsnorm", "layernorm"), True),
            "position": (("rope", "learned"), True),
        },
        bools=("tie_embeddings", "linear_bias", "qkv_bias"),
    ),
}

_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9.-]*$")

# Plausible ranges, in base units: a figure outside is a typo or hostile, and would make the planner's
# arithmetic overflow (1.0e+300 GB) or its plans meaningless. (upper bound, why)
_DIM_MAX: dict[str, tuple[float, str]] = {
    "bytes": (2.0**50, "1 PiB"),
    "bytes_per_s": (1e15, "1 PB/s, over 100 times HBM3e's 8 TB/s"),
    "flops": (1e18, "1 EFLOP/s, over 200 times a B200's dense FP8 peak"),
    "flop": (1e15, "10^15 FLOP, a GEMM of 2 x 80k^3; a half-efficiency size is ~10^10"),
    "seconds": (1.0, "1 s; collective latencies are microseconds"),
    "count": (2.0**40, "2^40"),
    "fraction": (1.0, "1"),
}
_DIM_MIN: dict[str, tuple[float, str]] = {
    "bytes_per_s": (1e6, "1 MB/s, below any GPU link or NIC"),
    "flops": (1e9, "1 GFLOP/s, below any accelerator"),
}
_KEY_MAX: dict[tuple[str, str], tuple[float, str]] = {
    ("gpus", "memory"): (4.0 * 2**40, "4 TiB, over ten times the largest GPU memory built, 288 GB"),
    ("gpus", "nvlink_links"): (1024, "1,024; GPUs have up to 18"),
    ("models", "params_published"): (1e14, "10^14, 60 times the largest published model, Switch-C's 1.6T"),
}
_PLANNER_LIMITS = {("nodes", "gpus_per_node"): "gpus_per_node", ("nodes", "nics_per_node"): "nics_per_node",
                   **{("models", k): k for k in ("layers", "hidden", "heads", "kv_heads", "ffn_hidden",
                                                 "vocab", "max_positions")}}
"""Keys bounded like the planner's flags (catalog/limits.py)."""


def _upper(kind: str, base: str, dim: str) -> tuple[float, str]:
    """(largest accepted value in base units, why) of one numeric key."""
    if (kind, base) in _PLANNER_LIMITS:
        _, hi, why = LIMITS[_PLANNER_LIMITS[kind, base]]
        return float(hi), f"{hi:,}, {why}"
    return _KEY_MAX.get((kind, base)) or _DIM_MAX[dim]


# -- parsing one file -----------------------------------------------------------------------------

_Refused = Refused
_yaml_load = yaml_load


def _err(path: Path, key: str | None, msg: str) -> CatalogError:
    if key and len(key) > 60:
        key = key[:57] + "..."
    where = f"{path}: key '{key}'" if key else f"{path}"
    return CatalogError(f"{where}: {msg}")


_KEYS: dict[str, tuple[set, set, str]] = {}


def _keys(kind: str) -> tuple[set, set, str]:
    """(numeric keys with their units, the other keys, the accepted keys in words) of one kind: the same for
    every file of the kind, so made once."""
    got = _KEYS.get(kind)
    if got is None:
        schema = _SCHEMA[kind]
        known_numeric = {base + sfx for base, (dim, _) in schema.numeric.items()
                         for sfx, (d, _) in UNIT_SUFFIXES.items() if d == dim}
        known_other = set(schema.text) | set(schema.enums) | set(schema.bools) | {"aliases", "source"}
        accepted_keys = ", ".join(sorted(
            [f"{b}_<{'|'.join(s.lstrip('_') for s, (d, _) in UNIT_SUFFIXES.items() if d == dim)}>"
             for b, (dim, _) in schema.numeric.items()] + sorted(known_other)))
        got = _KEYS[kind] = (known_numeric, known_other, accepted_keys)
    return got


def _parse_file(path: Path, kind: str) -> dict[str, Any]:
    """Validate one YAML file; return its fields in base units (not yet cross-checked)."""
    stem = path.stem
    if not _NAME_RE.match(stem):
        raise _err(path, None, f"file name {_short(stem)} is not a catalog name; "
                   "accepted: lowercase letters, digits, '-' and '.', e.g. 'h100-sxm.yaml'")
    try:
        data = read_yaml(path)
    except Refused as e:
        raise _err(path, None, str(e)) from None
    if not isinstance(data, dict):
        raise _err(path, None, "must be a YAML mapping of key: value")

    schema = _SCHEMA[kind]
    known_numeric, known_other, accepted_keys = _keys(kind)

    out: dict[str, Any] = {"name": stem, "path": str(path)}
    seen_base: dict[str, str] = {}
    for key, value in data.items():
        if not isinstance(key, str):
            raise _err(path, str(key), f"keys must be strings; accepted: {accepted_keys}")
        if key in known_numeric:
            base, suffix = _split_unit(key)  # type: ignore[misc]
            if base in seen_base:
                raise _err(path, key, f"duplicates '{seen_base[base]}'; give {base} once, in one unit")
            seen_base[base] = key
            out[base] = _convert(path, key, value, suffix, _upper(kind, base, UNIT_SUFFIXES[suffix][0]))
        elif key in known_other:
            out[key] = value
        else:
            split = _split_unit(key)
            if split and split[0] in schema.numeric:
                dim = schema.numeric[split[0]][0]
                ok = [split[0] + s for s, (d, _) in UNIT_SUFFIXES.items() if d == dim]
                raise _err(path, key, f"wrong unit for {split[0]}; accepted: {', '.join(ok)}")
            if key in schema.numeric:
                dim = schema.numeric[key][0]
                ok = [key + s for s, (d, _) in UNIT_SUFFIXES.items() if d == dim]
                raise _err(path, key, f"a number needs its unit in the key; accepted: {', '.join(ok)}")
            if isinstance(value, (int, float)) and not isinstance(value, bool) and split is None:
                raise _err(path, key, f"a number needs a unit suffix; accepted suffixes: {_ACCEPTED_UNITS}")
            raise _err(path, key, f"unknown key for {kind}; accepted: {accepted_keys}")

    # source: a non-empty string or list of non-empty strings
    if "source" not in out:
        raise _err(path, "source", "missing; every catalog file needs source: (datasheet, URL, paper or file)")
    src = out["source"]
    if isinstance(src, str):
        src = [src]
    if (not isinstance(src, list) or not src
            or not all(isinstance(s, str) and s.strip() for s in src)):
        raise _err(path, "source", "must be a non-empty string or a list of non-empty strings")
    out["source"] = tuple(s.strip() for s in src)

    aliases = out.get("aliases", [])
    if isinstance(aliases, str):
        aliases = [aliases]
    if not isinstance(aliases, list) or not all(isinstance(a, str) and a.strip() for a in aliases):
        raise _err(path, "aliases", "must be a list of non-empty strings")
    out["aliases"] = tuple(a.strip() for a in aliases)

    name = data.get("name")
    if "name" in data and (not isinstance(name, str) or name.lower() != stem):  # `name:` alone is null
        raise _err(path, "name", f"{_short(name)} differs from the file name; accepted: {_short(stem)} (or omit name)")

    for key, required in schema.text.items():
        if key == "name":
            continue
        if key not in out:
            if required:
                raise _err(path, key, "missing (required)")
            continue
        if not isinstance(out[key], str) or not out[key].strip():
            raise _err(path, key, "must be a non-empty string")
        out[key] = out[key].strip()
    for key, (choices, required) in schema.enums.items():
        if key not in out:
            if required:
                raise _err(path, key, f"missing (required); accepted: {', '.join(choices)}")
            continue
        v = out[key]
        if not isinstance(v, str) or v.strip().lower() not in choices:
            raise _err(path, key, f"{_short(v)} is not accepted; accepted: {', '.join(choices)}")
        out[key] = v.strip().lower()
    for key in schema.bools:
        v = out.get(key, False)
        if not isinstance(v, bool):
            raise _err(path, key, f"{_short(v)} is not a boolean; accepted: true, false")
        out[key] = v
    for base, (dim, required) in schema.numeric.items():
        if required and base not in out:
            ok = [base + s for s, (d, _) in UNIT_SUFFIXES.items() if d == dim]
            raise _err(path, ok[0] if len(ok) == 1 else base,
                       f"missing (required); accepted: {', '.join(ok)}")
    return out


def _convert(path: Path, key: str, value: Any, suffix: str,
             upper: tuple[float, str] | None = None) -> float | int:
    """`value` of `key` in base units; `upper` (largest base-unit value, why) bounds it."""
    dim, factor = UNIT_SUFFIXES[suffix]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        hint = " (YAML reads 1e9 as text: write 1.0e+9, and no quotes)" if isinstance(value, str) else ""
        raise _err(path, key, f"{_short(value)} is not a number{hint}")
    if isinstance(value, int) and abs(value) >= 1e300 or isinstance(value, float) and not math.isfinite(value):
        raise _err(path, key, f"{_short(value)} is not finite")
    hi, why = upper or _DIM_MAX[dim]
    if dim != "fraction" and value * factor > hi:  # a fraction's own check says (0, 1]
        top = hi / factor
        shown = f"{int(top):,}" if dim == "count" or top == int(top) and top < 1e15 else f"{top:.4g}"
        raise _err(path, key, f"{_short(value)} is implausibly large; accepted: at most {shown} ({why})")
    if dim == "count":
        if not isinstance(value, int) or value <= 0:
            raise _err(path, key, f"{_short(value)} is not a positive integer")
        return value
    if dim == "fraction":
        if not 0 < value <= 1:
            raise _err(path, key, f"{_short(value)} is outside (0, 1]; accepted: 0 < x <= 1")
        return float(value)
    if dim == "seconds":
        if value < 0:
            raise _err(path, key, f"{_short(value)} is negative; accepted: >= 0")
        return value * factor
    if value <= 0:
        raise _err(path, key, f"{_short(value)} must be > 0; accepted: a positive number")
    low = _DIM_MIN.get(dim)
    if low is not None and value * factor < low[0]:
        raise _err(path, key, f"{_short(value)} is implausibly small; accepted: at least {low[0] / factor:.4g} "
                              f"({low[1]})")
    if dim == "bytes":
        nbytes = int(round(value * factor))
        if nbytes < 1:
            raise _err(path, key, f"{_short(value)} is less than one byte; accepted: a positive size")
        return nbytes
    return value * factor


# -- building entries -----------------------------------------------------------------------------

_GPU_KERNEL_KEYS = {"matmul_half_efficiency": "matmul_half_efficiency_flop", "hbm_efficiency": "hbm_efficiency",
                    "attention_efficiency": "attention_efficiency",
                    "attention_backward_efficiency": "attention_backward_efficiency",
                    "kernel_overhead": "kernel_overhead_s", "host_op": "host_op_s", "sm": "sm_count"}
"""Optional GPU keys of the per-kernel time model -> GPU fields (defaults on the dataclass)."""


def _build(kind: str, f: dict[str, Any]) -> Any:
    common = dict(name=f["name"], aliases=f["aliases"], source=f["source"],
                  notes=f.get("notes", ""), path=f["path"])
    if kind == "gpus":
        flops = {d: f[d] for d in ("fp32", "tf32", "fp16", "bf16") if d in f}
        if not flops:
            raise _err(Path(f["path"]), "bf16_tflops",
                       "no throughput given; accepted: fp32_tflops, tf32_tflops, fp16_tflops, bf16_tflops")
        return GPU(vendor=f["vendor"], memory_bytes=f["memory"], hbm_bytes_per_s=f["hbm_bandwidth"],
                   flops=flops, matmul_efficiency=f["matmul_efficiency"],
                   scale_up_link=f["scale_up_link"].lower(), nvlink_links=f.get("nvlink_links"),
                   **{field_: f[key] for key, field_ in _GPU_KERNEL_KEYS.items() if key in f},
                   **common)
    if kind == "interconnects":
        return Interconnect(kind=f["kind"], tier=f["tier"], line_rate_bytes_per_s=f["line_rate"],
                            busbw_efficiency=f["busbw_efficiency"], latency_s=f["latency"],
                            half_efficiency_bytes=float(f["half_efficiency_size"]),
                            nvls_busbw_bytes_per_s=f.get("nvls_busbw", 0.0),
                            nvls_latency_s=f.get("nvls_latency", 0.0),
                            simple_protocol_only=f.get("simple_protocol_only", False), ring_only=f.get("ring_only", False),
                            scale_out_loss=f.get("scale_out_loss", 0.0), **common)
    if kind == "nodes":
        return Node(gpu=f["gpu"].lower(), gpus_per_node=f["gpus_per_node"],
                    intra_link=f["intra_link"].lower(), inter_link=f["inter_link"].lower(),
                    nics_per_node=f["nics_per_node"], host_memory_bytes=int(f.get("host_memory", 0)), **common)
    path = Path(f["path"])
    if f["hidden"] % f["heads"]:
        raise _err(path, "heads_count", f"{f['heads']} does not divide hidden_count={f['hidden']}")
    if f["heads"] % f["kv_heads"]:
        raise _err(path, "kv_heads_count", f"{f['kv_heads']} does not divide heads_count={f['heads']}")
    arch = {k: f[k] for k in ("layers", "hidden", "heads", "kv_heads", "ffn_hidden", "vocab",
                              "max_positions", "mlp", "norm", "position", "tie_embeddings",
                              "linear_bias", "qkv_bias")}
    return ModelEntry(arch=arch, params_published=f.get("params_published"), **common)


# -- the catalog ----------------------------------------------------------------------------------

_SINGULAR = {"gpus": "gpu", "interconnects": "interconnect", "nodes": "node", "models": "model"}


class Catalog:
    """All entries, by kind; lookups by name or alias, case-insensitive."""

    def __init__(self, entries: dict[str, dict[str, Any]], dirs: tuple[Path, ...]):
        self.dirs = dirs
        """The directories read, built-in first; later ones replace same-named entries."""
        self._entries = entries
        self._index: dict[str, dict[str, str]] = {}
        for kind, by_name in entries.items():
            idx: dict[str, str] = {}
            for name, e in by_name.items():
                idx[name.lower()] = name
            for name, e in by_name.items():
                for alias in e.aliases:
                    a = alias.lower()
                    if a in idx and idx[a] != name:
                        raise CatalogError(
                            f"{e.path}: key 'aliases': {_short(alias)} is already the name or an alias of "
                            f"{_SINGULAR[kind]} '{idx[a]}'; accepted: an unused name")
                    idx[a] = name
            self._index[kind] = idx

    def names(self, kind: str) -> list[str]:
        """Sorted entry names of one kind: gpus, interconnects, nodes or models."""
        return sorted(self._entries[self._kind(kind)])

    def entries(self, kind: str) -> list[Any]:
        """All entries of one kind, sorted by name."""
        k = self._kind(kind)
        return [self._entries[k][n] for n in sorted(self._entries[k])]

    def _kind(self, kind: str) -> str:
        k = kind.lower()
        k = {v: key for key, v in _SINGULAR.items()}.get(k, k)
        if k not in KINDS:
            raise CatalogError(f"unknown catalog kind {_short(kind)}; known: {', '.join(KINDS)}")
        return k

    def _get(self, kind: str, name: str) -> Any:
        key = str(name).strip().lower()
        real = self._index[kind].get(key)
        if real is None:
            raise CatalogError(
                f"unknown {_SINGULAR[kind]} {_short(name)}; known: {', '.join(self.names(kind))}")
        return self._entries[kind][real]

    def gpu(self, name: str) -> GPU:
        return self._get("gpus", name)

    def interconnect(self, name: str) -> Interconnect:
        return self._get("interconnects", name)

    def node(self, name: str) -> Node:
        return self._get("nodes", name)

    def model(self, name: str) -> ModelEntry:
        return self._get("models", name)

    def entry(self, name: str) -> Any:
        """An entry of any kind by name or alias (for `distplan catalog show`)."""
        key = str(name).strip().lower()
        hits = [(k, self._index[k][key]) for k in KINDS if key in self._index[k]]
        if len(hits) == 1:
            k, real = hits[0]
            return self._entries[k][real]
        if hits:
            raise CatalogError(f"{_short(name)} is ambiguous: " + ", ".join(
                f"{_SINGULAR[k]} '{n}'" for k, n in hits) + "; use the kind-specific lookup")
        known = sorted(n for k in KINDS for n in self._entries[k])
        raise CatalogError(f"unknown catalog entry {_short(name)}; known: {', '.join(known)}")

    def kind_of(self, entry: Any) -> str:
        """'gpus', 'interconnects', 'nodes' or 'models' for an entry object."""
        return {GPU: "gpus", Interconnect: "interconnects", Node: "nodes", ModelEntry: "models"}[type(entry)]

    def __repr__(self) -> str:
        counts = ", ".join(f"{len(self._entries[k])} {k}" for k in KINDS)
        return f"Catalog({counts}; dirs={[str(d) for d in self.dirs]})"


def _cross_check(entries: dict[str, dict[str, Any]]) -> None:
    """References between entries: node -> gpu and links; gpu -> scale_up_link."""
    links = entries["interconnects"]
    link_index = {n.lower(): n for n in links}
    for e in links.values():
        for a in e.aliases:
            link_index.setdefault(a.lower(), e.name)
    gpu_index = {n.lower(): n for n in entries["gpus"]}
    for e in entries["gpus"].values():
        for a in e.aliases:
            gpu_index.setdefault(a.lower(), e.name)

    def need(index, value, path, key, what, tier=None):
        real = index.get(value.lower())
        if real is None:
            pool = sorted(links if what == "interconnect" else entries["gpus"])
            raise CatalogError(f"{path}: key '{key}': unknown {what} {_short(value)}; known: {', '.join(pool)}")
        if tier and links[real].tier != tier:
            raise CatalogError(f"{path}: key '{key}': interconnect {_short(real)} has tier "
                               f"{links[real].tier}; accepted: an interconnect with tier {tier}")

    for g in entries["gpus"].values():
        need(link_index, g.scale_up_link, g.path, "scale_up_link", "interconnect", "intra_node")
    for n in entries["nodes"].values():
        need(gpu_index, n.gpu, n.path, "gpu", "gpu")
        need(link_index, n.intra_link, n.path, "intra_link", "interconnect", "intra_node")
        need(link_index, n.inter_link, n.path, "inter_link", "interconnect", "inter_node")


def _read_dirs(dirs: Iterable[Path]) -> dict[str, dict[str, Any]]:
    entries: dict[str, dict[str, Any]] = {k: {} for k in KINDS}
    for d in dirs:
        for kind in KINDS:
            sub = d / kind
            if not sub.is_dir():
                continue
            for path in sorted(sub.iterdir()):
                if path.suffix not in (".yaml", ".yml") or not path.is_file():
                    continue
                fields = _parse_file(path, kind)
                entries[kind][fields["name"]] = _build(kind, fields)
    _cross_check(entries)
    return entries


_CACHE: dict[tuple[Path, ...], Catalog] = {}


def _env_dirs() -> list[str]:
    raw = os.environ.get(ENV_VAR, "")
    return [p for p in raw.split(os.pathsep) if p.strip()]


def load_catalog(extra_dirs: Sequence[str | Path] = ()) -> Catalog:
    """The built-in catalog, then $DISTPLAN_CATALOG dirs, then `extra_dirs`, each layered over the last.

    A later directory's file replaces an earlier one with the same stem (same kind). Each directory
    may hold any of the sub-folders gpus/, interconnects/, nodes/, models/. Cached per tuple of dirs.
    """
    if isinstance(extra_dirs, (str, os.PathLike)):
        extra_dirs = [extra_dirs]
    if not isinstance(extra_dirs, (list, tuple)) or not all(isinstance(d, (str, os.PathLike)) for d in extra_dirs):
        raise CatalogError(f"catalog directories {_short(extra_dirs)}: accepted: a directory (str or path) "
                           f"or a list of them")
    resolved: list[Path] = [BUILTIN_DIR]
    for raw, origin in [(p, ENV_VAR) for p in _env_dirs()] + [(p, "--catalog / catalog_dirs") for p in extra_dirs]:
        try:
            p = Path(raw).expanduser().resolve()
            found = p.is_dir()
        except (OSError, ValueError, RuntimeError):  # a name the file system cannot hold, a link loop
            found = False
        if not found:
            raise CatalogError(f"catalog directory {_short(str(raw), 200)} (from {origin}) not found; accepted: a directory "
                               f"with any of {', '.join(k + '/' for k in KINDS)}")
        resolved.append(p)
    key = tuple(resolved)
    cat = _CACHE.get(key)
    if cat is None:
        cat = Catalog(_read_dirs(key), key)
        _CACHE[key] = cat
    return cat


def clear_cache() -> None:
    """Forget loaded catalogs (after editing YAML files in a running process)."""
    _CACHE.clear()
