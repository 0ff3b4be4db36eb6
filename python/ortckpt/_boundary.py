"""The one module that talks to the Rust core (``ortckpt._core``).

Everything crossing into Rust goes through here: typed records for what a load returns,
the byte views tensors are saved from, the save calls and the core's constants. The rest
of the package, and the subpackages, import these names, never ``_core`` itself (a test
holds them to it), so the boundary can change in one place.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from . import _core
from .dtypes import PackedBits, fixed_size_dtypes
from .errors import CheckpointStateError, InvalidArgumentTypeError
from .tensor_keys import TensorKey

MappedFile = _core.MappedFile
SaveProgress = _core.SaveProgress
# The one commit (the core's io::commit): staged files, directory renames, lock files.
Staging = _core.Staging
Lock = _core.Lock
stage = _core.stage
release_clean_cache = _core.release_clean_cache
rename_directory = _core.rename_directory
# A held signal handed back to Python once the saving call has returned (see ortckpt.interrupts).
SignalOnDrop = _core.SignalOnDrop
acquire_lock = _core.acquire_lock
# ONNX Runtime's saver given a buffer that grows in place, in a forked child (ortckpt.forked_save).
InPlacePlan = _core.InPlacePlan
in_place_plan = _core.in_place_plan
grow_in_place = _core.grow_in_place
placed_in_place = _core.placed_in_place
# The package's version: the crate's, as the core was built (Cargo.toml is its one place).
VERSION: str = _core.__version__
CHECKPOINT_VERSION = _core.CHECKPOINT_VERSION
DEFAULT_EXTERNAL_DATA_THRESHOLD = _core.DEFAULT_EXTERNAL_DATA_THRESHOLD
# How the core names its temporary files; Python-side temporaries use the same marker.
TEMP_MARKER = _core.TEMP_MARKER

PropertyValue = int | float | str

# A tensor as the core reads and writes it: (name, ONNX type code, dims, stored). On a load,
# ``stored`` is (offset, nbytes, in the external data file?), a list of str, or None (nominal);
# on a save, a contiguous byte buffer, a list of str, or None. Kept as the core's plain tuple:
# a loaded state holds these until a tensor is first used, so opening costs little per tensor.
CoreTensor = tuple[str, int, tuple[int, ...], Any]
# (momentum name, code, dims, stored) per momentum, for each parameter, in each group.
CoreGroup = tuple[str, int, float, list[tuple[str, list[CoreTensor]]]]


@dataclass(frozen=True)
class Loaded:
    """What a load of a file or buffer returns, typed."""

    version: int
    nominal: bool
    # (checkpoint, external data): the maps the stored offsets point into; views keep them alive.
    mappings: tuple[Any, Any]
    # The parameters as the core decoded them (trainable, then frozen): nothing is made per
    # parameter until asked (names, one entry, every view: see ``_core.ParameterIndex``).
    parameters: Any
    optimizer_groups: list[CoreGroup]
    # As stored: one list per type; for a name repeated the last entry wins (as in ONNX Runtime).
    properties: list[tuple[str, PropertyValue]]

    @property
    def trainable(self) -> list[CoreTensor]:
        """The trainable parameters' entries, in the file's order (made on each call)."""
        return self.parameters.entries(0, self.parameters.trainable_count)

    @property
    def frozen(self) -> list[CoreTensor]:
        """The frozen parameters' entries, in the file's order (made on each call)."""
        return self.parameters.entries(self.parameters.trainable_count, len(self.parameters))

    def tensors(self) -> Iterator[tuple[TensorKey, CoreTensor]]:
        """Every tensor with its key, in the file's order."""
        for requires_grad, tensors in ((True, self.trainable), (False, self.frozen)):
            for tensor in tensors:
                yield TensorKey.of_parameter(tensor[0], requires_grad), tensor
        for group_name, _step, _lr, states in self.optimizer_groups:
            for param, momentums in states:
                for tensor in momentums:
                    yield TensorKey.of_momentum(group_name, param, tensor[0]), tensor

    @classmethod
    def _of(cls, raw: dict[str, Any]) -> Loaded:
        return cls(
            version=raw["version"],
            nominal=raw["nominal"],
            mappings=(raw["mapping"], raw["external_mapping"]),
            parameters=raw["parameters"],
            optimizer_groups=raw["optimizer_groups"],
            properties=[*raw["ints"], *raw["floats"], *raw["strings"]],
        )


def load(path: str | os.PathLike[str], *, follow_symlinks: bool = True, verify: bool = False) -> Loaded:
    """Maps and verifies a checkpoint file (and its data file); with ``verify``, every byte
    against the file's checksums first (CheckpointIntegrityError naming file and tensor)."""
    return Loaded._of(_core.load(os.fspath(path), follow_symlinks=follow_symlinks, verify=verify))


def verify_checksums(path: str | os.PathLike[str], *, follow_symlinks: bool = True) -> tuple[int, int, int] | None:
    """Checks every byte of a checkpoint file (and its data file) against its checksums, with
    the GIL released: (tensors, bytes of values, root checksum), or None when the file carries
    none (ONNX Runtime's own, an older ortckpt's). CheckpointIntegrityError names the file and
    tensor that differ."""
    return _core.verify_checksums(os.fspath(path), follow_symlinks=follow_symlinks)


def checksum_root(path: str | os.PathLike[str], *, follow_symlinks: bool = True) -> tuple[int, int | None]:
    """(size, root checksum) of a checkpoint file, the root read from its last bytes (None when
    it carries no checksums). Without ``follow_symlinks``, a symlink is refused (ELOOP)."""
    return _core.checksum_root(os.fspath(path), follow_symlinks=follow_symlinks)


# (dtype, itemsize) by ONNX type code, for the types `views` cuts (None: the others).
_VIEW_DTYPES = [None if dtype is None else (dtype, dtype.itemsize) for dtype in fixed_size_dtypes()]


def views(entries: list[Any], mappings: tuple[Any, Any]) -> list[np.ndarray | None]:
    """The NumPy views of loaded tensors (``entries`` as a load gives them) over their
    ``mappings``, made in one core call: each a view of the mapping through a memoryview
    (which keeps it alive), writable exactly when the mapping is, as ``np.frombuffer``
    makes them. None where the caller makes the value itself: strings, packed sub-byte
    types, empty or nominal tensors, and a mapping that is no buffer (an object store's
    data file, read a tensor at a time on first use)."""
    return _core.views(entries, (_buffer_of(mappings[0]), _buffer_of(mappings[1])), _VIEW_DTYPES)


def parameter_views(loaded: Loaded) -> list[np.ndarray | None]:
    """The views (as :func:`views` makes them) of every parameter of ``loaded``, by position
    (``loaded.parameters.positions()``), in one core call that reads the decoded parameters
    themselves; None where the caller makes the value itself (see :func:`views`)."""
    buffers = (_buffer_of(loaded.mappings[0]), _buffer_of(loaded.mappings[1]))
    return loaded.parameters.views(buffers, _VIEW_DTYPES)


def _buffer_of(mapping: Any) -> memoryview | None:
    if mapping is None or hasattr(mapping, "read_range"):
        return None
    return memoryview(mapping)


def load_buffer(view: memoryview) -> Loaded:
    """Verifies a checkpoint held in a contiguous byte buffer; nothing is copied."""
    return Loaded._of(_core.load_buffer(view))


def load_buffer_paired(view: memoryview, external: Any, external_len: int, external_tail: bytes) -> Loaded:
    """:func:`load_buffer` for a checkpoint whose external data file is ``external`` (any
    object: the loaded state reads its tensors from it), ``external_len`` bytes long and
    ending with ``external_tail`` (its last 32 bytes), which the checks read."""
    return Loaded._of(
        _core.load_buffer(view, external=external, external_len=external_len, external_tail=external_tail)
    )


class TensorRecord(NamedTuple):
    """A parameter as other code sees it, values aside (``CheckpointState.tensor_records``);
    its values: ``CheckpointState.tensor_value(name)``."""

    name: str
    code: int  # ONNX TensorProto data type
    dims: tuple[int, ...]
    requires_grad: bool


def as_bytes(array: np.ndarray) -> np.ndarray:
    """A flat little-endian uint8 view of ``array``: no copy when it is contiguous and little-endian."""
    if not array.flags.c_contiguous:
        array = np.ascontiguousarray(array)
    if array.dtype.byteorder == ">":
        array = array.astype(array.dtype.newbyteorder("<"))
    # The core reads the buffer as flat bytes, so any C-contiguous shape will do
    # (a 0-d array cannot change its item size, hence the reshape there only).
    return array.view(np.uint8) if array.ndim else array.reshape(1).view(np.uint8)


def split_properties(properties: Mapping[str, PropertyValue]) -> tuple[list, list, list]:
    """(ints, floats, strings), as the format's property bag stores them."""
    return (
        [(k, v) for k, v in properties.items() if isinstance(v, int)],
        [(k, v) for k, v in properties.items() if isinstance(v, float)],
        [(k, v) for k, v in properties.items() if isinstance(v, str)],
    )


def unencodable_at(text: str) -> int | None:
    """Where ``text`` holds a character UTF-8 cannot encode (a lone surrogate, as a file name
    read with ``surrogateescape`` makes), or None: the files hold UTF-8, so such text is
    refused by name before it reaches a writer (which would raise a bare UnicodeEncodeError)."""
    if text.isascii():
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return e.start
    return None


def check_text(text: Any, what: str, tensor: str | None = None) -> None:
    """Refuses ``text`` (``what`` says what it is: "tensor name", "property 'p': value")
    unless it is a str a checkpoint can hold; ``tensor`` goes into the error."""
    if not isinstance(text, str):
        error: CheckpointStateError = InvalidArgumentTypeError(f"{what} {text!r} is a {type(text).__name__}, not a str")
    elif (at := unencodable_at(text)) is not None:
        error = CheckpointStateError(
            f"{what} {text!r} is not text: the character {text[at]!r} at position {at} is a lone "
            "surrogate (a checkpoint holds UTF-8)"
        )
    else:
        return
    error.tensor = tensor
    raise error


@dataclass(frozen=True)
class CoreState:
    """A checkpoint as the core writes it: tensors as (name, code, dims, values) where values
    are a contiguous byte buffer (the caller's own memory: never copied here), a list of str,
    or None (nominal); groups as (name, step, learning rate, [(parameter, [momentum tensors])]).
    What :meth:`ortckpt.CheckpointState.core_state` gives, and every writer takes: the core reads
    it by attribute (its ``CheckpointIn``)."""

    trainable: Sequence[Any]
    frozen: Sequence[Any]
    groups: Sequence[Any]
    properties: Mapping[str, PropertyValue]
    nominal: bool = False
    keep_order: bool = False  # tensors in the order given, not sorted as ONNX Runtime's state path sorts

    def __post_init__(self) -> None:
        # Every name and string the core writes, checked here, whoever built the state.
        for tensor in [*self.trainable, *self.frozen]:
            _check_tensor_text(tensor, "tensor")
        for group, _step, _rate, parameters in self.groups:
            check_text(group, "optimizer group name")
            for parameter, momentums in parameters:
                check_text(parameter, f"optimizer group {group!r}: parameter name")
                for momentum in momentums:
                    _check_tensor_text(momentum, f"optimizer group {group!r}: parameter {parameter!r}: momentum")
        for name, value in self.properties.items():
            check_text(name, "property name")
            if isinstance(value, str):
                check_text(value, f"property {name!r}: value")

    # The property bag by type, as the format stores it (the core reads these three by name).
    @property
    def ints(self) -> list[tuple[str, int]]:
        return split_properties(self.properties)[0]

    @property
    def floats(self) -> list[tuple[str, float]]:
        return split_properties(self.properties)[1]

    @property
    def strings(self) -> list[tuple[str, str]]:
        return split_properties(self.properties)[2]


@dataclass(frozen=True)
class WriteOptions:
    """How the core writes a checkpoint's files: the record its writers read, by attribute."""

    durable: bool = False  # the files and their directory fsynced before the call returns
    external_data_threshold: int = DEFAULT_EXTERNAL_DATA_THRESHOLD  # more bytes of values: <path>.data
    progress: SaveProgress | None = None  # counts the bytes written, for a bar in another thread
    lock_timeout: float | None = None  # seconds to wait for another save of the path (None: 60)
    holes: Sequence[int] = ()  # save_staged: values, by buffer address, left for the caller to fill


def _check_tensor_text(tensor: Any, what: str) -> None:
    name, _code, _dims, stored = tensor
    check_text(name, f"{what} name", tensor=name)
    if isinstance(stored, list):  # a STRING tensor's elements
        for i, element in enumerate(stored):
            check_text(element, f"{what} {name!r}: element {i}", tensor=name)


def save(path: str | os.PathLike[str], state: CoreState, **options: Any) -> None:
    """Writes a checkpoint atomically (the core's one commit); ``options``: :class:`WriteOptions`'
    fields (durable, external_data_threshold, progress, lock_timeout)."""
    _core.save(os.fspath(path), state, WriteOptions(**options))


Watched = _core.Watched  # what watch_writes armed for one save


class Sharing(NamedTuple):
    """What :func:`save_sharing` found and did."""

    shared: bool
    """Whether it wrote the checkpoint sharing the previous data file (else nothing was
    written and the caller saves whole)."""
    unchanged: int
    """Bytes of values unchanged since ``previous``, wherever it keeps them."""
    values: int
    """Bytes of values in all."""
    compared: int
    """Bytes of values compared byte for byte: the others were proven the previous data
    file's own bytes (a mapping of it never written), or had nothing to compare with."""


def save_sharing(
    path: str | os.PathLike[str],
    previous: str | os.PathLike[str],
    state: CoreState,
    *,
    compare_only: bool = False,
    watched: Watched | None = None,
    **options: Any,
) -> Sharing:
    """Writes the new checkpoint ``path`` sharing, with the checkpoint ``previous``, its data
    file for the values that are byte-identical there (hard-linked as ``path``'s own; the rest
    inline), and says what it found (:class:`Sharing`). ``compare_only``: write nothing, only
    count; ``watched``: :func:`watch_writes` of ``state``; ``options``: :class:`WriteOptions`'
    durable, progress, lock_timeout."""
    if state.nominal:
        return Sharing(False, 0, 0, 0)
    return Sharing(
        *_core.save_sharing(
            os.fspath(path),
            os.fspath(previous),
            state,
            WriteOptions(**options),
            compare_only=compare_only,
            watched=watched,
        )
    )


def watch_writes(path: str | os.PathLike[str], state: CoreState) -> Watched:
    """Protects the pages of ``state``'s values (those of 64 KiB or more in this process's private
    memory) before a save of it to ``path`` (which names it in errors) reads them, so that the
    next sharing save need not compare the values
    none of whose pages was written since (the core's untouched.rs: Linux's asynchronous
    userfaultfd write protection, read with PAGEMAP_SCAN; nothing where the kernel lacks it).
    Only for a save of the caller's own arrays, which it keeps between saves: never of a copy."""
    return _core.watch_writes(os.fspath(path), state)


def record_watched(watched: Watched, path: str | os.PathLike[str], state: CoreState) -> None:
    """After the save ``watched`` was armed for committed ``path`` (from ``state``): records where
    the checkpoint keeps each watched value, for the next sharing save to prove it unchanged."""
    _core.record_watched(watched, os.fspath(path), state)


def file_span(array: np.ndarray) -> tuple[int, int, int] | None:
    """(st_dev, st_ino, offset) of the file whose current bytes ``array``'s are, proven by the
    kernel's records (a mapping of that file none of whose pages this process wrote), else None."""
    if array.nbytes == 0 or not array.flags.c_contiguous:
        return None
    return _core.file_span(as_bytes(array))


def save_staged(
    path: str | os.PathLike[str], state: CoreState, **options: Any
) -> tuple[Staging, dict[int, tuple[int, bool]]]:
    """:func:`save` written, not committed: the staged files, and where each tensor's values
    are in them, by the address of the buffer they were given in: {address: (offset, in the
    data file?)}. The caller may fill values in place (``os.pwrite`` on ``fileno()``; ``holes``
    are left unwritten for it), then commits (fsynced then, with ``durable``)."""
    staging, placed = _core.save_staged(os.fspath(path), state, WriteOptions(**options))
    return staging, {address: (offset, external) for address, offset, external in placed}


def save_bytes(state: CoreState) -> bytes:
    """The bytes :func:`save` would write (values must total under 2 GiB)."""
    return _core.save_bytes(state)


# One piece of a checkpoint being streamed: metadata bytes, or a tensor's own byte buffer.
Segment = Any


def encode_segments(
    state: CoreState, *, external_data_threshold: int
) -> tuple[list[Segment], tuple[int, list[tuple[int, Segment]]] | None]:
    """The files :func:`save` would write, as pieces to stream: (the checkpoint's segments in
    order, None or (the external data file's length, [(offset, segment)], zeros between)).
    Tensor segments are the caller's own buffers (no copy)."""
    main, external = _core.encode_segments(state, external_data_threshold=external_data_threshold)
    return main, external


def encode_sharing_segments(state: CoreState, pair_id: bytes, shared: Mapping[tuple[int, int], int]) -> list[Segment]:
    """The checkpoint file's segments, in order, of ``state`` saved sharing an existing data file
    (whose pair id is ``pair_id``): each tensor whose values buffer, by :func:`buffer_key`, is in
    ``shared`` is external at that offset there, every other value inline. The caller vouches
    that those bytes are equal (the checksums are summed from its own). CheckpointError when the
    inline values pass ONNX Runtime's 2 GiB."""
    return _core.encode_sharing_segments(state, pair_id, dict(shared))


def buffer_key(values: Any) -> tuple[int, int]:
    """(address, length) of a tensor's values buffer: how :func:`encode_sharing_segments` knows it."""
    view = memoryview(values)
    if view.nbytes == 0:
        return 0, 0
    return np.frombuffer(view.cast("B"), np.uint8, 1).__array_interface__["data"][0], view.nbytes


def _mapped_base(array: Any) -> Any:
    """The object at the bottom of an array's chain of bases."""
    base = array
    while isinstance(base, np.ndarray) and base.base is not None:
        base = base.base
    if isinstance(base, memoryview):  # np.frombuffer holds the exporter through a memoryview
        base = base.obj
    return base


def mapping_of(value: Any) -> tuple[int, int] | None:
    """(address, length) of the map of a file the core mapped that ``value`` is a view over,
    else None."""
    base = _mapped_base(value.packed if isinstance(value, PackedBits) else value)
    if not isinstance(base, MappedFile) or len(base) == 0:
        return None
    return np.frombuffer(memoryview(base), np.uint8, 1).__array_interface__["data"][0], len(base)


def maps_of(values: Iterable[Any]) -> tuple[list[tuple[int, int] | None], list[Any]]:
    """For many values over a few maps, each looked at once: :func:`mapping_of` of each value,
    and the maps themselves (for :func:`release_all_of`)."""
    found: dict[int, tuple[Any, tuple[int, int] | None]] = {}
    # The map under each value's own base, by that base's id: the views a load cut in one call
    # share theirs (the mapping's memoryview), so 16k of them walk one chain, not 16k.
    under: dict[int, tuple[int, int] | None] = {}
    mappings = []
    for value in values:
        array = value.packed if isinstance(value, PackedBits) else value
        first = array.base if type(array) is np.ndarray else None
        if first is not None and id(first) in under:
            mappings.append(under[id(first)])
            continue
        base = _mapped_base(array)
        if id(base) not in found:
            mapped = isinstance(base, MappedFile) and len(base) > 0
            address = np.frombuffer(memoryview(base), np.uint8, 1).__array_interface__["data"][0] if mapped else 0
            found[id(base)] = (base, (address, len(base)) if mapped else None)
        mapping = found[id(base)][1]
        if first is not None:
            under[id(first)] = mapping  # (alive as long as the value: ids stay unique meanwhile)
        mappings.append(mapping)
    return mappings, [base for base, mapping in found.values() if mapping is not None]


def release_all_of(maps: Iterable[Any]) -> None:
    """Drops every page of these maps (from :func:`maps_of`) from memory."""
    for base in maps:
        base._release(0, len(base))


def release_maps(values: Iterable[Any]) -> None:
    """Drops every page of the maps that ``values`` are views over (see :func:`release_pages`)."""
    bases = {id(b): b for b in (_mapped_base(v.packed if isinstance(v, PackedBits) else v) for v in values)}
    for base in bases.values():
        if isinstance(base, MappedFile) and len(base):
            base._release(0, len(base))


def combine(
    operation: str, coefficients: list[float], jobs: list[Any], progress: Callable[[int], object] | None
) -> tuple[tuple[int, int, float] | None, list[int | None]]:
    """The core's arithmetic kernels over ``jobs`` (see ``_core.combine``): (None, the XXH3-64
    sum of each job's values written to a file, None for one in memory), or (the first result
    element that does not fit its type, as (job, element, exact value), [])."""
    return _core.combine(operation, coefficients, jobs, progress)


# (ONNX type code, contiguous little-endian bytes, the map they lie in when its pages may be
# dropped once read, else None): a tensor as the statistics kernels take it one by one.
StatsTensor = tuple[int, np.ndarray, tuple[int, int] | None]
# (nan, posinf, neginf, finite, min, max, mean, std, l2): the figures NaN without finite values.
StatsFigures = tuple[int, int, int, int, float, float, float, float, float]
# The same as columns, one entry a tensor: what the core returns for many tensors at once.
StatsColumns = tuple[
    list[int], list[int], list[int], list[int], list[float], list[float], list[float], list[float], list[float]
]
# (changed, nonfinite, L2 of b - a, L2 of a, max abs difference, the first L2 over the second), as columns.
ChangeColumns = tuple[list[int], list[int], list[float], list[float], list[float], list[float]]


def tensor_stats(tensors: list[StatsTensor], progress: Callable[[int], object] | None) -> list[StatsFigures]:
    """The core's statistics of every tensor, in one pass over each (see ``_core.tensor_stats``)."""
    maps = list({m for _code, _values, m in tensors if m is not None})
    codes, values = [t[0] for t in tensors], [t[1] for t in tensors]
    return list(zip(*stats_columns(codes, values, [None] * len(tensors), maps, progress), strict=True))


def stats_columns(
    codes: list[int],
    values: list[Any],
    elements: list[int | None],
    maps: list[tuple[int, int]],
    progress: Callable[[int], object] | None,
) -> StatsColumns:
    """The core's statistics of many tensors in one call: ``codes[i]``, ``values[i]`` (any
    C-contiguous buffer of little-endian values; a packed sub-byte tensor's bytes) and
    ``elements[i]`` (None: as many as the bytes hold) are one tensor; those lying in one of
    ``maps`` (``(address, length)`` of a map :func:`maps_of` gave) have their pages dropped once
    read. The figures come back as columns (see ``_core.tensor_stats``)."""
    return _core.tensor_stats(codes, values, elements, maps, progress)


def changes_columns(
    codes: list[int],
    a: list[Any],
    b: list[Any],
    elements: list[int | None],
    maps: list[tuple[int, int]],
    progress: Callable[[int], object] | None,
) -> ChangeColumns:
    """The change figures from each tensor of ``a`` to the same one of ``b`` (same type and
    element count), in one call, as columns (see :func:`stats_columns`)."""
    return _core.tensor_changes(codes, a, b, elements, maps, progress)


def histogram(code: int, values: Any, elements: int | None, edges: list[float]) -> list[int]:
    """Counts of a tensor's finite values between ``edges``, as ``numpy.histogram`` counts
    (the tensor as one entry of :func:`stats_columns`)."""
    return _core.histogram(code, values, elements, edges)


def release_pages(value: Any) -> None:
    """Drops the pages of ``value`` from memory when it is a view over a file the core mapped
    (MADV_DONTNEED on a private map: they are read again from the file if used again)."""
    array = value.packed if isinstance(value, PackedBits) else value
    base = _mapped_base(array)
    if isinstance(base, MappedFile) and array.nbytes:
        start = np.frombuffer(memoryview(base), np.uint8, 1).__array_interface__["data"][0]
        base._release(array.__array_interface__["data"][0] - start, array.nbytes)
