"""The commit step of a speculative step: the accepted path's K/V move to contiguous slots, and the
features of root and path wait in st.feats for the drafter's next catch-up (proposers.py)."""
from __future__ import annotations

import torch


def put_rows(buf: torch.Tensor, idx: torch.Tensor, values: torch.Tensor) -> None:
    """buf[r, idx[r, k]] = values[r, k] for buf [R, S, D], idx [R, K], values [R, K, D]. Not scatter_: on a
    CPU, scatter_ into a bf16 buffer copies the whole buffer (docs/measurements.md); indexed assignment
    writes only the K rows."""
    buf[torch.arange(buf.shape[0], device=buf.device)[:, None], idx] = values


def commit(e, st, feats, path, m, P, n, active, in_place: bool = False) -> int:
    """Rows' accepted paths: block indices `path` [B, T + 1] (root first), m [B] accepted drafts, the root at
    slot P [B] and token n - 1. `in_place`: the path is the block's first m + 1 nodes (a chain), whose K/V
    are already where they belong. Returns the longest accepted path."""
    m_max = int(m.max())
    lanes = torch.arange(m_max + 1, device=e.device)
    idx = path[:, : m_max + 1]                                        # block indices: root, path
    keep = (lanes <= m[:, None]) & active[:, None]
    dst = P[:, None] + lanes
    if not in_place:
        st.target.move(e.rows(torch.where(keep, P[:, None] + idx, dst)), e.rows(dst))
    st.target.commit(e.rows(dst), e.rows(keep))
    if st.draft is not None:                                          # the drafter's next catch-up reads them
        at = torch.where(keep, n[:, None] - 1 + lanes, e.N)          # token index of each kept feature
        f = feats.gather(1, e.rows(idx)[..., None].expand(-1, -1, feats.shape[-1]))
        put_rows(st.feats, e.rows(at), f)
    return m_max
