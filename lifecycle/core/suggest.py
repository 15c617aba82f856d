""""Did you mean": the ids nearest to one that was not found, for the commands that look a document up by doc_id or
source_id (`lineage doc`, `forget`). A user types a file name where the source_id is a path (`functions-datetime.html`
for `/usr/share/doc/.../functions-datetime.html`), or mistypes one character of a doc_id."""

from __future__ import annotations

# Jaro-Winkler similarity at or above which a different id counts as a near spelling (DuckDB's function)
NEAR = 0.85


def near_ids(con, relation: str, ident: str, limit: int = 5) -> list[str]:
    """Up to `limit` doc_ids or source_ids of `relation` (SQL with columns doc_id and source_id) that contain
    `ident` or nearly spell it, containing ones first, then by similarity. `con`: a DuckDB connection."""
    sql = f"""
        WITH ids AS (SELECT DISTINCT unnest([doc_id, source_id]) AS id FROM {relation}),
             scored AS (SELECT id, contains(lower(id), lower($q)) AS inside,
                               jaro_winkler_similarity(lower(id), lower($q)) AS sim FROM ids WHERE id IS NOT NULL)
        SELECT id FROM scored WHERE inside OR sim >= {NEAR} ORDER BY inside DESC, sim DESC, id LIMIT {int(limit)}"""
    return [r[0] for r in con.execute(sql, {"q": ident}).fetchall()]


def did_you_mean(found: list[str]) -> str:
    """'; did you mean a, b?' or '' when there is nothing near."""
    return f"; did you mean {', '.join(found)}?" if found else ""
