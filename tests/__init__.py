"""vstor's tests; a package so that `python3 -m tests.hostlayout` and
`from tests.doubles ...` resolve here, not to some other installed `tests`."""
