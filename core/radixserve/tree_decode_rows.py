"""Tree verifies as decode rows, so they replay the decode CUDA graphs (issue 13).

A verify of a draft tree scores every node of every request. Eagerly that is one EXTEND forward
with a per-request tree mask; the decode graphs only take DECODE batches, whose rows each attend
a plain prefix of one ReqToTokenPool row. So each node becomes a decode row whose visible KV is
its request's prefix slots followed by the slots of its ancestors and itself, in depth order:

- a node on the request's first chain (its ancestors are nodes 0, 1, ..., j - 1, so its depth is
  its index j) reads the request's own row: the scheduler wrote node t's slot at position
  prefix + t, which is exactly that path;
- any other node gets a *scratch* row of the pool (reserved at start-up, never a request's): one
  device copy puts the request row's first slots in it, then the path's slots are written at
  positions prefix .. prefix + depth (`write`, before the forward, outside any graph).

Node j of a request with prefix p is then the row (its row, position p + depth, seq_len
p + depth + 1), and writes its KV at its own slot like any decode row. This relies on the
backend's `decode_rows_share_requests` promise: every row's KV is stored before any row attends
(stores go by `out_cache_loc`, whatever row a token reads through), so a node sees its
ancestors' KV of this very forward.

Scratch rows are taken afresh for every batch (the first ones, in node order): no state lives
in them between forwards and two nodes of one batch never share one. A batch needing more
scratch rows than were reserved is verified eagerly (`TreeDecodeRows.fits` says so first).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def node_depths(parents: list[int]) -> list[int]:
    """Depth of every node of one request's draft tree (root 0); parents come before children."""
    d = [0] * len(parents)
    for j in range(1, len(parents)):
        d[j] = d[parents[j]] + 1
    return d


@dataclass
class TreeRowsPlan:
    """The decode rows of one tree verify, node order (request by request, as the batch packs them).

    rows / positions / seq_lens: per node, the ReqToTokenPool row it reads, its position
    (prefix + depth) and its visible length (position + 1). copy_to / copy_from / copy_width:
    scratch row k gets the first `copy_width` slots of request row copy_from[k]. path_rows /
    path_cols / path_tokens: then slot of the batch's new token path_tokens[i] (an index into
    `out_cache_loc`) goes to position path_cols[i] of row path_rows[i]."""

    rows: list[int]
    positions: list[int]
    seq_lens: list[int]
    copy_to: list[int]
    copy_from: list[int]
    copy_width: int
    path_rows: list[int]
    path_cols: list[int]
    path_tokens: list[int]


class TreeDecodeRows:
    """Scratch rows of the ReqToTokenPool for verifying draft trees as decode rows.

    :param scratch_rows: row indices of the pool reserved for this (taken from the pool with
        `alloc()` at start-up and never freed while the runner lives).
    """

    def __init__(self, scratch_rows: list[int]) -> None:
        if len(set(scratch_rows)) != len(scratch_rows):
            raise ValueError(f"tree decode rows: scratch rows repeat: {scratch_rows}")
        self.scratch_rows = list(scratch_rows)

    @staticmethod
    def scratch_needed(parents: list[list[int]]) -> int:
        """Scratch rows a batch with these trees needs: its nodes off their request's first chain."""
        return sum(sum(d != j for j, d in enumerate(node_depths(ps))) for ps in parents)

    def fits(self, parents: list[list[int]]) -> bool:
        """Whether this batch's nodes off the first chains fit the reserved scratch rows."""
        return self.scratch_needed(parents) <= len(self.scratch_rows)

    def plan(self, req_rows: list[int], prefix_lens: list[int], parents: list[list[int]]) -> TreeRowsPlan:
        """The decode rows of a tree verify (host lists only; `write` applies the scratch rows).

        :param req_rows: each request's ReqToTokenPool row (its new tokens' slots at positions
            prefix .. prefix + n - 1, in node order, as the scheduler writes them).
        :param prefix_lens: each request's prefix (tokens with KV before this batch).
        :param parents: each request's tree (`SpecVerify.parents`).
        :raises ValueError: when the batch needs more scratch rows than were reserved (check `fits`).
        """
        rows, positions, seq_lens = [], [], []
        copy_to, copy_from, width = [], [], 0
        path_rows, path_cols, path_tokens = [], [], []
        free = iter(self.scratch_rows)
        base = 0  # the request's first new token in the batch's out_cache_loc
        for row, p, ps in zip(req_rows, prefix_lens, parents, strict=True):
            depths = node_depths(ps)
            for j, d in enumerate(depths):
                rows_pos = p + d
                positions.append(rows_pos)
                seq_lens.append(rows_pos + 1)
                if d == j:  # on the first chain: the request's own row holds its path
                    rows.append(row)
                    continue
                scratch = next(free, None)
                if scratch is None:
                    raise ValueError(f"tree verify needs {self.scratch_needed(parents)} scratch rows, "
                                     f"{len(self.scratch_rows)} reserved")
                rows.append(scratch)
                path = [j]
                while ps[path[-1]] >= 0:
                    path.append(ps[path[-1]])
                path.reverse()  # root .. j, one node per depth
                same = 0  # the path's leading nodes 0, 1, ...: already at their place in the request row
                while same < len(path) and path[same] == same:
                    same += 1
                copy_to.append(scratch)
                copy_from.append(row)
                width = max(width, p + same)
                for t in range(same, len(path)):
                    path_rows.append(scratch)
                    path_cols.append(p + t)
                    path_tokens.append(base + path[t])
            base += len(ps)
        return TreeRowsPlan(rows, positions, seq_lens, copy_to, copy_from, width, path_rows, path_cols, path_tokens)

    @staticmethod
    def write(plan: TreeRowsPlan, req_to_token: torch.Tensor, out_cache_loc: torch.Tensor) -> None:
        """Fill the plan's scratch rows of the pool's device table: one gather-copy of the request
        rows' first `copy_width` slots (positions past a node's path are left as copied and never
        read), then one scatter of the path slots from `out_cache_loc` (the batch's new slots, on
        the device). Device work only, no host sync; runs before the forward, outside the graph.
        The pool's host mirror is not updated: scratch rows are read by the attention kernels only."""
        if not plan.copy_to:
            return
        dev = req_to_token.device
        n, m = len(plan.copy_to), len(plan.path_rows)
        idx = torch.tensor(plan.copy_to + plan.copy_from + plan.path_rows + plan.path_cols + plan.path_tokens,
                           dtype=torch.int64).to(dev, non_blocking=True)  # one host -> device copy
        to, frm = idx[:n], idx[n : 2 * n]
        if plan.copy_width:
            req_to_token[to, : plan.copy_width] = req_to_token[frm, : plan.copy_width]
        if m:
            at = 2 * n
            r, c, tok = idx[at : at + m], idx[at + m : at + 2 * m], idx[at + 2 * m :]
            req_to_token[r, c] = out_cache_loc[tok].to(req_to_token.dtype)
