"""The report's numbers: DuckDB queries over a run's Parquet folders (docs/design.md, "Output contract").

Every aggregate is computed by DuckDB over the part files; what comes back to Python is small (one row
per split, per tree depth, per probability bin, per grid cell), so a run of 10^5 images and 2.5·10^7
token rows is never loaded whole. DuckDB spills to `temp_directory` past its `memory_limit`.

The queries read only the columns every engine family writes (COMMON); a query whose columns a run
lacks returns None, and the report leaves its panel out. Columns beyond COMMON (a family's own, e.g. a
log acceptance ratio or a window position) are found by `extra_columns` and profiled generically.
"""
from __future__ import annotations

from dataclasses import dataclass

import duckdb

from actors.store import entries
import numpy as np

# The tokens columns the report reads by name (docs/design.md, "Output contract"). Fixed here, not
# imported from decoding.engines.log, so a column a new engine adds there is profiled as an extra.
COMMON = ("prompt_id", "engine", "token_index", "row", "col", "token_id", "step", "accepted", "accept_len",
          "p_target", "q_draft", "tree_depth", "tree_width", "proposer")
TREE = 2   # proposer of a drafter tree's tokens: their tree_depth and tree_width are a tree's shape
BINS = 10  # probability bins of the calibration queries: [0, 0.1), ..., [0.9, 1.0]


def connect(memory_limit: str = "4GB", temp_directory: str | None = None, threads: int | None = None):
    con = duckdb.connect()
    con.execute(f"SET memory_limit = '{memory_limit}'")
    con.execute("SET preserve_insertion_order = false")      # lets big aggregates stream and spill
    if temp_directory:
        con.execute(f"SET temp_directory = '{_quote(temp_directory)}'")
    if threads:
        con.execute(f"SET threads = {int(threads)}")
    return con


def _quote(s: str) -> str:
    return s.replace("'", "''")


def parquet(glob: str | None) -> str | None:
    """A FROM source over a folder's part files (parts may differ in columns: union by name)."""
    return None if glob is None else f"read_parquet('{_quote(glob)}', union_by_name = true)"


def source(con, where) -> str | None:
    """A FROM source over a run's table: read_parquet of a local glob, or, for a prefix on an object store
    (actors/store.py ObjPath), a pyarrow dataset over its part keys registered in DuckDB: DuckDB reads
    through the same pyarrow filesystem the job wrote with (no httpfs, no second set of credentials).
    Parts may differ in columns: their schemas are unified by name, as union_by_name does."""
    if where is None or isinstance(where, str):
        return parquet(where)
    import hashlib

    import pyarrow as pa
    import pyarrow.dataset as ds
    import pyarrow.parquet as pq
    keys = [f"{where.key}/{n}" for n in sorted(entries(where)) if n.endswith(".parquet")]
    schema = pa.unify_schemas([pq.read_schema(where.fs.open_input_file(k)) for k in keys])
    name = "store_" + hashlib.blake2b(str(where).encode(), digest_size=8).hexdigest()
    con.register(name, ds.dataset(keys, schema=schema, filesystem=where.fs, format="parquet"))
    return name


@dataclass
class Tables:
    """One run's tables as DuckDB sources: `img`, `tok`, `err` (None when the run has no such parts)."""
    con: duckdb.DuckDBPyConnection
    img: str
    tok: str | None
    err: str | None = None

    def __post_init__(self):
        self._cols = {}
        if self.tok is not None:
            self._cols = dict(self.con.execute(f"SELECT column_name, column_type FROM (DESCRIBE SELECT * FROM {self.tok})").fetchall())

    def has(self, *cols: str) -> bool:
        return all(c in self._cols for c in cols)

    def columns(self) -> dict[str, str]:
        return dict(self._cols)

    def rows(self, sql: str, params=None) -> list[dict]:
        cur = self.con.execute(sql, params or [])
        names = [d[0] for d in cur.description]
        return [dict(zip(names, r)) for r in cur.fetchall()]


def _split(col: str = "split") -> str:
    return f"CASE WHEN grouping({col}) = 1 THEN 'all' ELSE coalesce({col}, '(none)') END"


# -- per image --------------------------------------------------------------------------------------------
def image_summary(t: Tables) -> list[dict]:
    """Per split and 'all': images, τ (mean over images, p10 / median / p90), tokens, target and draft
    forwards and engine seconds per image, and pooled τ (all tokens / all target forwards)."""
    return t.rows(f"""
        SELECT {_split()} AS split, count(*) AS images,
               avg(mean_accept_len) AS tau, quantile_cont(mean_accept_len, 0.1) AS tau_p10,
               median(mean_accept_len) AS tau_p50, quantile_cont(mean_accept_len, 0.9) AS tau_p90,
               sum(num_tokens)::DOUBLE / sum(target_forwards) AS tau_pooled,
               avg(num_tokens) AS tokens, avg(target_forwards) AS target_forwards,
               avg(draft_forwards) AS draft_forwards, avg(wall_s) AS s_per_image
        FROM {t.img} GROUP BY GROUPING SETS ((), (split)) ORDER BY grouping(split) DESC, split""")


def tau_values(t: Tables) -> np.ndarray:
    """τ of every image (one float each: 10^5 images are 0.4 MB)."""
    return np.asarray([r[0] for r in t.con.execute(f"SELECT mean_accept_len FROM {t.img}").fetchall()], np.float64)


def matched(t: Tables, base: Tables) -> int:
    """Images of this run whose (prompt_id, seed) the other run also generated."""
    return t.con.execute(f"SELECT count(*) FROM {t.img} e JOIN {base.img} b USING (prompt_id, seed)").fetchall()[0][0]


def versus(t: Tables, base: Tables) -> list[dict]:
    """Against a baseline run over the (prompt_id, seed) pairs both have, per split and 'all':
    step compression = Σ baseline target forwards / Σ this run's; speedup = Σ baseline engine seconds /
    Σ this run's (each image's share of its batch's wall time, from the actors' clocks)."""
    return t.rows(f"""
        SELECT {_split('e.split')} AS split, count(*) AS matched,
               sum(b.target_forwards)::DOUBLE / sum(e.target_forwards) AS compression,
               sum(b.wall_s)::DOUBLE / sum(e.wall_s) AS speedup
        FROM {t.img} e JOIN {base.img} b ON e.prompt_id = b.prompt_id AND e.seed = b.seed
        GROUP BY GROUPING SETS ((), (e.split)) ORDER BY grouping(e.split) DESC, e.split""")


def errors(t: Tables) -> list[dict]:
    """Failed prompts by reason (the first line of the error), most frequent first."""
    if t.err is None:
        return []
    return t.rows(f"""SELECT split_part(error, chr(10), 1) AS error, count(*) AS prompts, min(prompt_id) AS example
                      FROM {t.err} GROUP BY 1 ORDER BY prompts DESC, error""")


def speculative(t: Tables) -> bool:
    """Whether the run drafted at all: a draft forward counted, or a token accepted from a draft."""
    drafted = t.con.execute(f"SELECT coalesce(sum(draft_forwards), 0) > 0 FROM {t.img}").fetchall()[0][0]
    if drafted or t.tok is None or not t.has("accepted"):
        return bool(drafted)
    return bool(t.con.execute(f"SELECT coalesce(bool_or(accepted), false) FROM {t.tok}").fetchall()[0][0])


# -- per speculative step -------------------------------------------------------------------------------
def step_histogram(t: Tables) -> dict[tuple[int, int], int] | None:
    """{(accepted drafts, tree depth): steps} over every speculative step (step > 0) of every image.
    A step is one verification (tree engines) or iteration (Jacobi); step 0 is the prefill's token.
    Steps are keyed by the 64-bit hash of the prompt id, not the string: the group table of 10^7 steps
    then takes a third of the memory, and two of 10^5 ids share a hash with odds of about 3e-10."""
    if not t.has("prompt_id", "step", "accepted", "tree_depth"):
        return None
    rows = t.con.execute(f"""
        WITH s AS (SELECT hash(prompt_id) AS image, step, sum(accepted::INTEGER) AS acc, max(tree_depth) AS d
                   FROM {t.tok} WHERE step > 0 GROUP BY image, step)
        SELECT acc, d, count(*) FROM s GROUP BY acc, d""").fetchall()
    return {(int(a), int(d)): int(n) for a, d, n in rows} or None


def depth_acceptance(hist: dict[tuple[int, int], int]) -> list[dict]:
    """Acceptance at each depth k of the accepted path: of the steps that accepted k-1 drafts and whose
    tree reached depth k, the share that accepted a k-th. With no tree depth logged (all 0, e.g.
    Jacobi windows) the depth condition is dropped."""
    trees = any(d > 0 for _, d in hist)
    top = max(a for a, _ in hist) + (1 if trees else 0)
    out = []
    for k in range(1, max(top, 1) + 1):
        reached = sum(n for (a, d), n in hist.items() if a >= k - 1 and (not trees or d >= k))
        accepted = sum(n for (a, d), n in hist.items() if a >= k)
        if reached:
            out.append({"depth": k, "reached": reached, "accepted": accepted, "rate": accepted / reached})
    return out


# -- per token ------------------------------------------------------------------------------------------
def by_value(t: Tables, col: str) -> list[dict] | None:
    """Per value of an integer token column (tree_depth, tree_width: over drafter trees' tokens only):
    tokens and the share accepted from the draft."""
    if not t.has(col, "accepted"):
        return None
    tree = f" AND proposer = {TREE}" if col.startswith("tree_") and t.has("proposer") else ""
    return t.rows(f"""SELECT {col} AS value, count(*) AS tokens, avg(accepted::INTEGER) AS accepted
                      FROM {t.tok} WHERE {col} IS NOT NULL{tree} GROUP BY {col} ORDER BY {col}""")


def _tree_only(t: Tables, col: str, alias: str = "") -> str:
    """col where the token came from a drafter tree, else NULL (a chain step logs its chain's length as
    depth, a plain step 0: neither is a tree's shape). Runs from before the proposer column: col."""
    c = f"{alias}{col}"
    return f"CASE WHEN {alias}proposer = {TREE} THEN {c} END" if t.has("proposer") else c


def _finite(col: str) -> str:
    return f"{col} IS NOT NULL AND NOT isnan({col})"


def _bin(col: str) -> str:
    return f"least(floor({col} * {BINS}), {BINS - 1})::INTEGER"


def calibration_draft(t: Tables) -> list[dict] | None:
    """Accepted drafts binned by their draft probability q: per bin the count, mean q and mean target
    probability p of the same token. A calibrated drafter has mean p = mean q; below the diagonal it is
    over-confident. (The log holds committed tokens only, so rejected drafts are not in it.)"""
    if not t.has("q_draft", "p_target", "accepted"):
        return None
    return t.rows(f"""SELECT {_bin('q_draft')} AS bin, count(*) AS tokens, avg(q_draft) AS q, avg(p_target) AS p
                      FROM {t.tok} WHERE accepted AND {_finite('q_draft')} AND {_finite('p_target')}
                      GROUP BY bin ORDER BY bin""") or None


def calibration_target(t: Tables) -> list[dict] | None:
    """Committed tokens binned by their target probability p: per bin the count, mean p and the share
    that came from the draft (accepted) rather than from the target's own draw."""
    if not t.has("p_target", "accepted"):
        return None
    return t.rows(f"""SELECT {_bin('p_target')} AS bin, count(*) AS tokens, avg(p_target) AS p,
                             avg(accepted::INTEGER) AS accepted
                      FROM {t.tok} WHERE {_finite('p_target')} GROUP BY bin ORDER BY bin""") or None


def cells(t: Tables) -> dict[str, np.ndarray] | None:
    """[grid_rows, grid_cols] maps over all images: tokens, accepted share, mean tree depth and width (of
    the drafter trees that made a cell's tokens)."""
    if not t.has("row", "col", "accepted"):
        return None
    extra = [c for c in ("tree_depth", "tree_width") if t.has(c)]
    rows = t.con.execute(f"""SELECT row, col, count(*), avg(accepted::INTEGER) {''.join(f', avg({_tree_only(t, c)})' for c in extra)}
                             FROM {t.tok} GROUP BY row, col""").fetchall()
    if not rows:
        return None
    a = np.asarray(rows, dtype=np.float64)
    shape = (int(a[:, 0].max()) + 1, int(a[:, 1].max()) + 1)
    out = {}
    for j, name in enumerate(["tokens", "accepted", *extra]):
        m = np.full(shape, np.nan)
        m[a[:, 0].astype(int), a[:, 1].astype(int)] = a[:, 2 + j]
        out[name] = m
    return out


def flat_busy(t: Tables, flat: str) -> list[dict] | None:
    """Tokens on flat vs busy cells, per split and 'all': count, accepted share, mean tree depth and
    width. `flat` is a relation (prompt_id, split, grid, mask) with mask[cell] = '1' on flat cells,
    cell = row * grid + col (report.images.flat_cells decides it from the pixels)."""
    if not t.has("row", "col", "accepted"):
        return None
    extra = "".join(f", avg({_tree_only(t, c, 't.')}) AS {c}" for c in ("tree_depth", "tree_width") if t.has(c))
    return t.rows(f"""
        SELECT {_split('f.split')} AS split,
               CASE WHEN substr(f.mask, t.row * f.grid + t.col + 1, 1) = '1' THEN 'flat' ELSE 'busy' END AS cell,
               count(*) AS tokens, avg(t.accepted::INTEGER) AS accepted {extra}
        FROM {t.tok} t JOIN {flat} f USING (prompt_id)
        GROUP BY GROUPING SETS ((cell), (f.split, cell)) ORDER BY grouping(f.split) DESC, f.split, cell""")


def image_tokens(t: Tables, prompt_id: str) -> dict[str, np.ndarray] | None:
    """One image's per-cell maps (accepted, tree depth), for the examples."""
    if not t.has("row", "col", "accepted"):
        return None
    extra = [c for c in ("tree_depth",) if t.has(c)]
    rows = t.con.execute(f"SELECT row, col, accepted::INTEGER {''.join(', ' + _tree_only(t, c) for c in extra)} FROM {t.tok} "
                         f"WHERE prompt_id = ?", [prompt_id]).fetchall()
    if not rows:
        return None
    a = np.asarray(rows, dtype=np.float64)
    shape = (int(a[:, 0].max()) + 1, int(a[:, 1].max()) + 1)
    out = {}
    for j, name in enumerate(["accepted", *extra]):
        m = np.full(shape, np.nan)
        m[a[:, 0].astype(int), a[:, 1].astype(int)] = a[:, 2 + j]
        out[name] = m
    return out


def image_bytes(t: Tables, prompt_ids: list[str]) -> dict[str, tuple[bytes, str]]:
    """prompt_id -> (PNG bytes, prompt) for a few images."""
    if not prompt_ids:
        return {}
    marks = ", ".join("?" * len(prompt_ids))
    rows = t.con.execute(f"SELECT prompt_id, image.bytes, prompt FROM {t.img} WHERE prompt_id IN ({marks})",
                         list(prompt_ids)).fetchall()
    return {p: (b, pr) for p, b, pr in rows}


def first_ids(t: Tables, n: int) -> list[str]:
    """n prompt ids in a fixed pseudo-random order (hash of the id), the same for every run."""
    return [r[0] for r in t.con.execute(f"SELECT prompt_id FROM {t.img} ORDER BY hash(prompt_id), prompt_id LIMIT ?",
                                        [n]).fetchall()]


# -- columns a family adds ------------------------------------------------------------------------------
def extra_columns(t: Tables) -> dict[str, str]:
    """Numeric or boolean token columns beyond COMMON, with their DuckDB types."""
    numeric = ("TINYINT", "SMALLINT", "INTEGER", "BIGINT", "FLOAT", "DOUBLE", "BOOLEAN", "UTINYINT", "USMALLINT",
               "UINTEGER", "UBIGINT", "HUGEINT")
    return {c: ty for c, ty in t.columns().items() if c not in COMMON and ty in numeric}


def profile(t: Tables, col: str, ty: str, max_values: int = 64) -> dict | None:
    """How a family's own column relates to acceptance. Integer (or boolean) columns with at most
    max_values distinct values: tokens and accepted share per value. Otherwise BINS equal-width bins
    between the finite min and max: tokens per bin, accepted and not. None for a column with fewer than
    two distinct values: that is the fill value (decoding/engines/log.py) of an engine that does not
    write the column, e.g. a tree engine's window_pos once TOKEN_COLUMNS holds it."""
    if not t.has(col, "accepted"):
        return None
    integer = ty not in ("FLOAT", "DOUBLE")
    x = f"{col}::DOUBLE" if ty == "BOOLEAN" else col
    if integer:
        distinct = t.con.execute(f"SELECT count(DISTINCT {col}) FROM {t.tok}").fetchall()[0][0]
        if distinct < 2:
            return None
        if distinct <= max_values:
            return {"kind": "values", "rows": t.rows(
                f"""SELECT {x} AS value, count(*) AS tokens, avg(accepted::INTEGER) AS accepted FROM {t.tok}
                    WHERE {col} IS NOT NULL GROUP BY {x} ORDER BY {x}""")}
    ok = f"{col} IS NOT NULL" + ("" if integer else f" AND isfinite({col})")
    lo, hi = t.con.execute(f"SELECT min({x}), max({x}) FROM {t.tok} WHERE {ok}").fetchall()[0]
    if lo is None or not hi > lo:
        return None
    width = (hi - lo) / BINS
    rows = t.rows(f"""SELECT least(floor(({x} - ?) / ?), {BINS - 1})::INTEGER AS bin, accepted, count(*) AS tokens
                      FROM {t.tok} WHERE {ok} GROUP BY bin, accepted ORDER BY bin, accepted""", [lo, width])
    return {"kind": "bins", "lo": lo, "width": width, "rows": rows}
