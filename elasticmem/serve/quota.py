"""Per-tenant memory quotas (rows and bytes on disk), counted from the bank.

The package's docstring (``elasticmem/serve/__init__.py``) describes the server and its API.
"""

import fnmatch
from typing import Any, Sequence


class TenantQuota:
    """A tenant's memory usage, from the bank, against ``Limits.tenant_max_rows`` / ``tenant_max_bytes``.

    A tenant's memories are the rows of every group its keys cover (the union of their patterns;
    a group two tenants may write counts for both). A row's bytes are its share of the shard file
    that holds it (cached states and keys: the file's bytes over its rows) plus its chunk text in
    UTF-8. Called from the model worker only (the one writer), so no lock: the bank cannot change
    under it except by another process's append, which the next check sees.
    """

    def __init__(self, live: Any, patterns: dict[str | None, tuple[str, ...]], max_rows: int | None,
                 max_bytes: int | None) -> None:
        self.live = live
        self.patterns = patterns
        self.max_rows = max_rows
        self.max_bytes = max_bytes
        self._covers: dict[tuple[str | None, str], bool] = {}
        self._text_bytes: dict[str, tuple[Any, int]] = {}  # group -> (its segments, their text bytes)
        self._bank: Any = None
        self._starts: list[int] = []

    def _covered(self, tenant: str | None, group: str) -> bool:
        k = (tenant, group)
        if k not in self._covers:
            self._covers[k] = any(fnmatch.fnmatchcase(group, p) for p in self.patterns.get(tenant, ()))
        return self._covers[k]

    def _shard_bytes(self, bank: Any, start: int, end: int) -> float:
        """Bytes of rows [start, end) as their shares of the shard files that hold them."""
        import bisect

        total, i = 0.0, bisect.bisect_right(self._starts, start) - 1
        while start < end and i < len(bank.shards):
            sh = bank.shards[i]
            stop = min(end, sh.start + sh.rows)
            if sh.rows:
                total += (stop - start) * sh.bytes / sh.rows
            start, i = stop, i + 1
        return total

    def usage(self, tenant: str | None) -> tuple[int, int]:
        """(rows, bytes) of the tenant's memories in the bank as it is now."""
        bank = self.live.bank
        if bank is not self._bank:
            self._bank, self._starts = bank, [sh.start for sh in bank.shards]
        rows, nbytes = 0, 0.0
        for group in list(bank.groups):
            if not self._covered(tenant, group):
                continue
            segments = bank.group_segments(group)
            cached = self._text_bytes.get(group)
            if cached is None or cached[0] != segments:  # rows added (or renumbered): count its text again
                chunks = bank.chunks()
                text = sum(len(chunks[r]["text"].encode("utf-8", "replace")) for a, b in segments for r in range(a, b))
                cached = self._text_bytes[group] = (segments, text)
            rows += sum(b - a for a, b in segments)
            nbytes += cached[1] + sum(self._shard_bytes(bank, a, b) for a, b in segments)
        return rows, int(nbytes)

    def refusals(self, adds: Sequence[tuple[str | None, int]]) -> list[str | None]:
        """For adds ``(tenant, turns)`` applied in this order: None for each one the quota admits, else
        the message that refuses it. An add may make one chunk per turn, so rows are checked against
        usage + turns (and the turns of the earlier admitted adds of the same tenant); bytes are known
        only once encoded, so an add is refused while the tenant is at or over its byte quota."""
        if self.max_rows is None and self.max_bytes is None:
            return [None] * len(adds)
        usage: dict[str | None, list[int]] = {}
        out: list[str | None] = []
        for tenant, turns in adds:
            if tenant not in usage:
                usage[tenant] = list(self.usage(tenant))
            rows, nbytes = usage[tenant]
            who = "this tenant" if tenant is None else f"tenant {tenant!r}"
            if self.max_rows is not None and rows + turns > self.max_rows:
                out.append(f"memory quota: {who} holds {rows} memories and this add may make {turns} more; the quota "
                           f"is {self.max_rows} memories (--tenant-max-rows)")
            elif self.max_bytes is not None and nbytes >= self.max_bytes:
                out.append(f"memory quota: {who} holds {nbytes} bytes of memory; the quota is {self.max_bytes} bytes "
                           "(--tenant-max-bytes)")
            else:
                usage[tenant][0] += turns
                out.append(None)
        return out
