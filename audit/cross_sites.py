"""The sites of a cross-site audit: their names and which mirror id is whose (sans-Spark).

A cross-site audit reads one store per site: `--store` is site `a`, each
`--mirror-store` the next letter (`b`, `c`, ...). A site's logs name other sites only
by mirror id: `origin` (the site whose link it applied from) and `message_origin` (the
site where a client published the message). To give a copy its home site, each mirror
id must be tied to one audited site:

- ids the caller names (`--site-ids`) are taken as given;
- a site whose own id is not named is the one id, among all those seen, it never
  applied from and no other site has (every site applies from every other in a full
  mesh, and two sites each from the other): found when exactly one is left, repeated
  while each id found narrows the others;
- with two sites, what a site applied from is the other site (a one-way mirror whose
  source applied nothing yet, a ring of two).

A ring of three cannot be told apart this way (each site applies from its predecessor
only, so two ids are left for each): name one site's id and the rest follows. An id of a copy
that no audited site has is an error for three sites or more (a site outside the
audit, or mistyped ids), never a guess.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

MAX_SITES = 26


class SiteIdError(ValueError):
    """The mirror ids seen in the logs cannot be tied to the audited sites."""


def site_names(n: int) -> list[str]:
    """`a`, `b`, ... for `n` stores (`--store` first)."""
    if not 2 <= n <= MAX_SITES:
        raise ValueError(f"a cross-site audit compares 2 to {MAX_SITES} sites, not {n}")
    return [chr(ord("a") + i) for i in range(n)]


def resolve_site_ids(
    sites: Sequence[str],
    applied_from: Mapping[str, Sequence[str]],
    named: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """Mirror id -> site, for every id some site applied from (and every named one).

    `applied_from`: per site, the mirror ids of the `origin`s of what it applied.
    Raises SiteIdError when, with three sites or more, an id some site applied from is
    left to no site, or when the names contradict the logs (a site applied from its own
    id, one id named for two sites)."""
    named = dict(named or {})
    unknown = set(named) - set(sites)
    if unknown:
        raise SiteIdError(f"mirror ids named for sites {sorted(unknown)} not audited")
    if len(set(named.values())) != len(named):
        raise SiteIdError(f"one mirror id named for two sites: {named}")
    seen = {o for s in sites for o in applied_from.get(s, ())}
    own = dict(named)
    for s, mirror_id in named.items():
        if mirror_id in applied_from.get(s, ()):
            raise SiteIdError(f"site {s} applied from its own mirror id {mirror_id!r}")
    # By elimination, until nothing more is told: each id found narrows the others.
    progress = True
    while progress:
        progress = False
        for s in sites:
            if s in own:
                continue
            left = (seen | set(own.values())) - set(applied_from.get(s, ())) - set(own.values())
            if len(left) == 1:
                own[s] = left.pop()
                progress = True
    mapping = {mirror_id: s for s, mirror_id in own.items()}
    if len(sites) == 2:
        # What a site applied from is the other one, named or not.
        for s, other in zip(sites, reversed(sites), strict=True):
            for origin in applied_from.get(s, ()):
                mapping.setdefault(origin, other)
    missing = seen - set(mapping)
    if missing:
        raise SiteIdError(
            f"mirror ids {sorted(missing)} belong to no audited site as far as the logs tell "
            f"(a ring of three or more, or a site left out): name each site's mirror id "
            f"(--site-ids)"
        )
    return mapping


def parse_site_ids(value: str | None, sites: Sequence[str]) -> dict[str, str]:
    """`--site-ids site-a,site-b,site-c`: the stores' mirror ids in their order (empty
    entries left to the logs)."""
    if not value:
        return {}
    ids = [part.strip() for part in value.split(",")]
    if len(ids) != len(sites):
        raise ValueError(f"--site-ids names {len(ids)} sites, the audit has {len(sites)} stores")
    return {s: i for s, i in zip(sites, ids, strict=True) if i}
