"""Test support that is also useful to users: synthetic host trees.

`build_tree(layout, root)` writes the sysfs/procfs a host described in a short
TOML layout would show (see `vstor.testing.layout`), so that
`read_host(SysFS(root))` sees that host.  From a shell:

    python -m vstor.testing.layout LAYOUT.toml DIR
"""

__all__ = ["build_tree", "load_layout", "parse_size"]


def __getattr__(name):
    # Imported on first use so that `python -m vstor.testing.layout` does not
    # find its own module already imported (runpy warns about that).
    if name in __all__:
        from vstor.testing import layout
        return getattr(layout, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
