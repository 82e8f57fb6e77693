"""Other programs' file formats, read with their own rules.  Pure, and
below everything but vstor.errors and vstor.records (tests/test_layers.py),
so the planner and the renderers can use them as much as the integrations
that read and write the files."""
