"""Printing a result: a rich table for people, or CSV / JSON / Parquet on stdout for programs."""
from __future__ import annotations

import io
import json
import sys

import polars as pl


def _cell(v) -> str:
    if isinstance(v, list):
        return ", ".join(map(str, v[:4])) + (f", ... ({len(v)})" if len(v) > 4 else "")
    if isinstance(v, float):
        return f"{v:.4g}"
    return "" if v is None else str(v)


def json_rows(df: pl.DataFrame) -> str:
    """One JSON array of objects, one per row (times as ISO 8601)."""
    return json.dumps(df.to_dicts(), default=lambda o: o.isoformat() if hasattr(o, "isoformat") else str(o))


def emit(df: pl.DataFrame, fmt: str, title: str = "", out=None) -> int:
    out = out or sys.stdout
    if fmt == "json":
        out.write(json_rows(df) + "\n")
    elif fmt == "csv":
        flat = df.with_columns([pl.col(c).cast(pl.List(pl.String)).list.join(";")
                                for c, t in df.schema.items() if isinstance(t, pl.List)])
        flat = flat.with_columns([pl.col(c).cast(pl.String) for c, t in flat.schema.items()
                                  if isinstance(t, (pl.Map, pl.Struct)) or str(t).startswith("Map")])
        out.write(flat.write_csv())
    elif fmt == "parquet":
        buf = io.BytesIO()
        df.write_parquet(buf)
        (out.buffer if hasattr(out, "buffer") else out).write(buf.getvalue())
    else:
        from rich.console import Console
        from rich.table import Table
        t = Table(title=f"{title} - {df.height} row(s)")
        for c in df.columns:
            t.add_column(c, overflow="fold")
        for row in df.iter_rows():
            t.add_row(*map(_cell, row))
        Console(file=out, width=max(160, Console().width)).print(t)
    return 0
