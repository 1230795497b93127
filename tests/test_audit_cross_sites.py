"""Which mirror id is whose in a cross-site audit (`audit/cross_sites.py`), from what each
site's log says it applied from: a pair of sites, a full mesh, a ring, names given."""

from __future__ import annotations

import pytest

from twinmq.audit.cross_sites import SiteIdError, parse_site_ids, resolve_site_ids, site_names

ABC = site_names(3)


def test_sites_are_named_by_letter_in_store_order_from_two_on() -> None:
    assert site_names(2) == ["a", "b"] and ABC == ["a", "b", "c"]
    with pytest.raises(ValueError, match="2 to"):
        site_names(1)


def test_two_sites_each_applied_from_the_other() -> None:
    mapping = resolve_site_ids(["a", "b"], {"a": ["B"], "b": ["A"]})
    assert mapping == {"A": "a", "B": "b"}


def test_a_one_way_mirror_whose_source_applied_nothing_yet_maps_the_source() -> None:
    # Before any switchover only B applied (from A): B's own id appears nowhere.
    assert resolve_site_ids(["a", "b"], {"a": [], "b": ["A"]}) == {"A": "a"}


def test_a_full_mesh_tells_each_sites_own_id_as_the_one_it_never_applied_from() -> None:
    applied = {"a": ["B", "C"], "b": ["A", "C"], "c": ["A", "B"]}
    assert resolve_site_ids(ABC, applied) == {"A": "a", "B": "b", "C": "c"}


def test_a_ring_of_three_cannot_be_told_apart_and_is_refused_without_names() -> None:
    applied = {"a": ["C"], "b": ["A"], "c": ["B"]}
    with pytest.raises(SiteIdError, match="--site-ids"):
        resolve_site_ids(ABC, applied)
    named = {"a": "A", "b": "B", "c": "C"}
    assert resolve_site_ids(ABC, applied, named) == {"A": "a", "B": "b", "C": "c"}


def test_one_named_id_settles_a_ring_of_three_by_elimination() -> None:
    # a is A: c, which applied from B, is C (A taken); then b is B.
    applied = {"a": ["C"], "b": ["A"], "c": ["B"]}
    assert resolve_site_ids(ABC, applied, {"a": "A"}) == {"A": "a", "B": "b", "C": "c"}


def test_names_that_contradict_the_logs_are_refused() -> None:
    with pytest.raises(SiteIdError, match="its own"):
        resolve_site_ids(ABC, {"a": ["A"]}, {"a": "A", "b": "B", "c": "C"})
    with pytest.raises(SiteIdError, match="two sites"):
        resolve_site_ids(ABC, {}, {"a": "A", "b": "A"})
    with pytest.raises(SiteIdError, match="not audited"):
        resolve_site_ids(ABC, {}, {"d": "D"})


def test_an_origin_of_a_site_left_out_of_the_audit_is_refused() -> None:
    # A mesh of four audited as three: D's id is some site's origin, and no site's.
    applied = {"a": ["B", "C", "D"], "b": ["A", "C", "D"], "c": ["A", "B", "D"]}
    with pytest.raises(SiteIdError, match="'D'"):
        resolve_site_ids(ABC, applied, {"a": "A", "b": "B", "c": "C"})


def test_site_ids_flag_lists_ids_in_store_order_and_may_leave_some_to_the_logs() -> None:
    assert parse_site_ids("site-a,,site-c", ABC) == {"a": "site-a", "c": "site-c"}
    assert parse_site_ids(None, ABC) == {}
    with pytest.raises(ValueError, match="2 sites"):
        parse_site_ids("x,y", ABC)
