"""The fault campaign (`exod chaos`): a real cluster, a seeded schedule of faults, an outsider's history and
the invariants it must keep (issue #26; the report in specs/reliability.md)."""
