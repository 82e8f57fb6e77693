"""Records: classes of named fields with __init__, __repr__, __eq__ (and,
frozen, __hash__ and no assignment), as @dataclasses.dataclass makes them;
with the same field(), fields(), replace() and asdict().

Why not dataclasses: the hook starts a new Python for every domain start and
stop, and it reads some fifty of these classes.  dataclasses compiles each
class's methods from source with exec (0.42 ms a frozen class of six fields,
against 0.03 here, pyenv's 3.11.7).  These methods are closures over the
field list instead; __init__ puts the fields straight into the instance's
__dict__, so an instance is built faster than a frozen dataclass's (1.5 us
against 4.5 for DiskPlan's 17 fields: `vstor plan` reads some 17,000 at
2000 domains).  This is the one measured exception to "the
standard library, plainly" (issue 29; docs/performance.md): the whole tree
on dataclasses, byte-compiled, through `bench/bench_hook.py --pairs 20` at a
load under 1, took the hook's 4-disk prepare + release from 204 ms (ratio
1.90 to the yardstick) to 265 ms (2.35), past the bound of 2.0; hashlib
and the uuid module, brought back in the same run, cost nothing measurable
(1.91).  tests/test_records.py holds it to dataclasses' behaviour.

What is kept from dataclasses: fields in annotation order (a base record's
first, its default inherited by a field annotated again), defaults and
default_factory, a mutable default refused, a field without a default after
one with it refused, compare=False and hash=False, metadata, __post_init__,
methods the class body writes itself kept, equality only within one class,
unhashable when not frozen, FrozenInstanceError (an AttributeError) on
assignment, frozen and not frozen never mixed by inheritance; asdict into
records, lists, tuples, namedtuples and dicts.  Not kept: init=False,
repr=False, eq=False, order, kw_only, slots, InitVar and ClassVar fields
(vstor uses none; a ClassVar annotation is refused rather than misread).
"""

from __future__ import annotations

MISSING = type("MISSING", (), {"__repr__": lambda self: "MISSING"})()


class FrozenInstanceError(AttributeError):
    pass


class Field:
    __slots__ = ("name", "default", "default_factory", "compare", "hash", "metadata")

    def __init__(self, default=MISSING, default_factory=MISSING, compare=True, hash=None,
                 metadata=None):
        if default is not MISSING and default_factory is not MISSING:
            raise ValueError("cannot specify both default and default_factory")
        self.name = None
        self.default, self.default_factory = default, default_factory
        self.compare, self.hash = compare, hash
        self.metadata = dict(metadata or {})

    def __repr__(self) -> str:
        return f"Field(name={self.name!r}, default={self.default!r})"


def field(*, default=MISSING, default_factory=MISSING, compare=True, hash=None, metadata=None) -> Field:
    return Field(default, default_factory, compare, hash, metadata)


def record(cls=None, /, *, frozen: bool = True):
    """@record (frozen) or @record(frozen=False)."""
    def wrap(cls):
        return _process(cls, frozen)
    return wrap if cls is None else wrap(cls)


def fields(obj) -> tuple[Field, ...]:
    try:
        return obj.__record_fields__
    except AttributeError:
        raise TypeError(f"{obj!r} is not a record") from None


def replace(obj, /, **changes):
    """A copy of `obj` with `changes` (checked again by its __post_init__)."""
    for f in fields(obj):
        changes.setdefault(f.name, getattr(obj, f.name))
    return obj.__class__(**changes)


def asdict(obj) -> dict:
    """Fields by name, records within turned into dicts too (lists, tuples
    and dicts of them as well)."""
    fields(obj)
    return _plain(obj)


def _plain(value):
    if hasattr(type(value), "__record_fields__"):
        return {f.name: _plain(getattr(value, f.name)) for f in value.__record_fields__}
    if isinstance(value, tuple) and hasattr(type(value), "_fields"):    # a namedtuple
        return type(value)(*(_plain(v) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value)
    if isinstance(value, dict):
        return {_plain(k): _plain(v) for k, v in value.items()}
    return value


def _process(cls, frozen: bool):
    bases = [b for b in cls.__mro__[1:] if "__record_fields__" in b.__dict__]
    if bases and any(b.__record_frozen__ for b in bases) != frozen:
        raise TypeError("cannot inherit non-frozen dataclass from a frozen one" if not frozen
                        else "cannot inherit frozen dataclass from a non-frozen one")
    own = []
    for name, note in cls.__dict__.get("__annotations__", {}).items():
        if "ClassVar" in str(note) or "InitVar" in str(note):
            raise TypeError(f"{cls.__name__}.{name}: ClassVar and InitVar are not supported")
        value = getattr(cls, name, MISSING)     # a base's default holds, as in dataclasses
        f = value if isinstance(value, Field) else Field(default=value)
        f.name = name
        if f.default is not MISSING and type(f.default).__hash__ is None:
            raise ValueError(f"mutable default {type(f.default)} for field {name} is not allowed: "
                             "use default_factory")
        if f.default is MISSING:
            if name in cls.__dict__:
                delattr(cls, name)
        else:
            setattr(cls, name, f.default)
        own.append(f)
    merged: dict[str, Field] = {}
    for base in reversed(cls.__mro__[1:]):
        merged.update((f.name, f) for f in base.__dict__.get("__record_fields__", ()))
    merged.update((f.name, f) for f in own)
    all_fields = tuple(merged.values())
    seen_default = False
    for f in all_fields:
        has_default = f.default is not MISSING or f.default_factory is not MISSING
        if seen_default and not has_default:
            raise TypeError(f"non-default argument '{f.name}' follows default argument")
        seen_default = seen_default or has_default
    # A __hash__ the class body wrote itself stays (not the None Python
    # puts there for a body that writes __eq__ alone), as in dataclasses.
    own_hash = cls.__dict__.get("__hash__", MISSING)
    explicit_hash = not (own_hash is MISSING or (own_hash is None and "__eq__" in cls.__dict__))
    cls.__record_fields__ = all_fields
    cls.__record_frozen__ = frozen
    cls.__match_args__ = tuple(f.name for f in all_fields)
    compared = tuple(f.name for f in all_fields if f.compare)
    names = frozenset(f.name for f in all_fields)
    made = {"__init__": _init(cls.__qualname__, all_fields), "__repr__": _repr(all_fields),
            "__eq__": _eq(compared)}
    if frozen:
        made["__setattr__"], made["__delattr__"] = _frozen(cls, names)
    for name, method in made.items():   # what the class body wrote itself stays
        if name not in cls.__dict__:
            setattr(cls, name, method)
    if not explicit_hash:
        hashed = tuple(f.name for f in all_fields if (f.compare if f.hash is None else f.hash))
        cls.__hash__ = (lambda self: hash(tuple(getattr(self, n) for n in hashed))) if frozen else None
    return cls


def _init(qualname: str, all_fields: tuple[Field, ...]):
    names = tuple(f.name for f in all_fields)
    index = set(names)
    required = sum(1 for f in all_fields if f.default is MISSING and f.default_factory is MISSING)
    takes = (f"{len(names) + 1}" if required == len(names)
             else f"from {required + 1} to {len(names) + 1}")
    slots = tuple((f.name, f.default, f.default_factory) for f in all_fields)

    def merged(args, kwargs) -> dict:
        """The arguments by field name, refused as Python refuses them."""
        if len(args) > len(names):
            raise TypeError(f"{qualname}.__init__() takes {takes} positional arguments "
                            f"but {len(args) + 1} were given")
        values = dict(zip(names, args))
        for key, value in kwargs.items():
            if key not in index:
                raise TypeError(f"{qualname}.__init__() got an unexpected keyword argument '{key}'")
            if key in values:
                raise TypeError(f"{qualname}.__init__() got multiple values for argument '{key}'")
            values[key] = value
        return values

    def __init__(self, *args, **kwargs):
        # Keyword arguments alone, each a field's (every parse of a
        # declaration): taken as they are.  The fields go straight into the
        # instance's __dict__ (past a frozen record's __setattr__), in
        # declaration order, as dataclasses' __init__ sets them.
        values = merged(args, kwargs) if args or not index.issuperset(kwargs) else kwargs
        own = self.__dict__
        missing = []
        for name, default, factory in slots:
            if name in values:
                own[name] = values[name]
            elif default is not MISSING:
                own[name] = default
            elif factory is not MISSING:
                own[name] = factory()
            else:
                missing.append(f"'{name}'")
        if missing:
            listed = (missing[0] if len(missing) == 1 else
                      f"{', '.join(missing[:-1])}{',' if len(missing) > 2 else ''} and {missing[-1]}")
            raise TypeError(f"{qualname}.__init__() missing {len(missing)} required positional "
                            f"argument{'s' if len(missing) > 1 else ''}: {listed}")
        post = getattr(self, "__post_init__", None)
        if post is not None:
            post()
    return __init__


def _repr(all_fields: tuple[Field, ...]):
    names = tuple(f.name for f in all_fields)

    def __repr__(self) -> str:
        inner = ", ".join(f"{n}={getattr(self, n)!r}" for n in names)
        return f"{type(self).__qualname__}({inner})"
    return __repr__


def _eq(compared: tuple[str, ...]):
    def __eq__(self, other):
        if other.__class__ is not self.__class__:
            return NotImplemented
        return tuple(getattr(self, n) for n in compared) == tuple(getattr(other, n) for n in compared)
    return __eq__


def _frozen(cls, names: frozenset):
    """__setattr__ and __delattr__ of a frozen record: no field is assigned
    or deleted (nor anything else on the class's own instances; a subclass
    that is no record may keep attributes of its own)."""
    def __setattr__(self, name, value):
        if type(self) is cls or name in names:
            raise FrozenInstanceError(f"cannot assign to field '{name}'")
        object.__setattr__(self, name, value)

    def __delattr__(self, name):
        if type(self) is cls or name in names:
            raise FrozenInstanceError(f"cannot delete field '{name}'")
        object.__delattr__(self, name)
    return __setattr__, __delattr__
