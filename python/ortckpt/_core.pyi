# Type stubs for the Rust extension module ortckpt._core (checked by mypy's stubtest in `make test-wheel`).
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, final

__all__ = [
    "CHECKPOINT_VERSION",
    "DEFAULT_EXTERNAL_DATA_THRESHOLD",
    "PAYLOAD_ALIGNMENT",
    "TEMP_MARKER",
    "InPlacePlan",
    "Lock",
    "MappedFile",
    "ParameterIndex",
    "SaveProgress",
    "SignalOnDrop",
    "Staging",
    "Watched",
    "__version__",
    "acquire_lock",
    "checksum_root",
    "combine",
    "encode_segments",
    "encode_sharing_segments",
    "file_span",
    "grow_in_place",
    "histogram",
    "in_place_plan",
    "load",
    "load_buffer",
    "placed_in_place",
    "record_watched",
    "release_clean_cache",
    "rename_directory",
    "save",
    "save_bytes",
    "save_sharing",
    "save_staged",
    "stage",
    "tensor_changes",
    "tensor_stats",
    "verify_checksums",
    "views",
    "watch_writes",
]

__version__: str
CHECKPOINT_VERSION: int
PAYLOAD_ALIGNMENT: int
DEFAULT_EXTERNAL_DATA_THRESHOLD: int
TEMP_MARKER: str

@final
class MappedFile:
    """A loaded checkpoint's bytes (private, copy-on-write mapping); supports the buffer protocol."""
    def __len__(self) -> int: ...
    def _release(self, offset: int, len: int) -> None: ...
    if sys.version_info >= (3, 12):
        def __buffer__(self, flags: int, /) -> memoryview: ...

@final
class ParameterIndex:
    """A loaded checkpoint's parameters, decoded and kept in the core until used (trainable first)."""
    def __len__(self) -> int: ...
    @property
    def trainable_count(self) -> int: ...
    def positions(self) -> dict[str, int]: ...
    def frozen_names(self) -> set[str]: ...
    def entry(self, position: int) -> tuple[Any, ...]: ...
    def entries(self, start: int, stop: int) -> list[tuple[Any, ...]]: ...
    def views(
        self, mappings: tuple[Any | None, Any | None], dtypes: Sequence[tuple[Any, int] | None]
    ) -> list[Any | None]: ...

@final
class SaveProgress:
    """Bytes a running save has written (poll it from another thread)."""
    def __new__(cls) -> SaveProgress: ...
    @property
    def total(self) -> int: ...
    @property
    def written(self) -> int: ...

@final
class Staging:
    """Files being written that replace a target (and its data file) only when committed."""
    def fileno(self, data: bool = False) -> int: ...
    @property
    def target(self) -> str: ...
    def temporary(self, data: bool = False) -> str: ...
    def commit(self, *, durable: bool = False, lock_timeout: float | None = None, unpaired: bool = False) -> None: ...
    def reseal(self, filled: Sequence[tuple[bool, int, int | None]] | None = None) -> None: ...
    def seal(self) -> None: ...
    def discard(self) -> None: ...

@final
class Lock:
    """A held lock file (acquire_lock)."""
    def release(self) -> None: ...
    @property
    def held(self) -> bool: ...

def stage(target: str | os.PathLike[str], *, with_data: bool = False) -> Staging: ...
def release_clean_cache(target: str | os.PathLike[str]) -> bool: ...

@final
class InPlacePlan:
    """Where ONNX Runtime's library calls operator new[] and delete[] (in_place_plan)."""

def in_place_plan(library: str) -> InPlacePlan | None: ...
def grow_in_place(plan: InPlacePlan) -> bool: ...
def placed_in_place() -> int: ...
def rename_directory(
    source: str | os.PathLike[str], target: str | os.PathLike[str], *, durable: bool = False
) -> None: ...
def acquire_lock(path: str | os.PathLike[str], *, timeout: float, record: str = ...) -> Lock | None: ...

# (name, ONNX type code, dims, values): values are a contiguous byte buffer, a list of str, or None (nominal).
_TensorIn = tuple[str, int, Sequence[int], Any]
# (group name, step, initial learning rate, [(parameter, its momentums)]).
_GroupIn = tuple[str, int, float, Sequence[tuple[str, Sequence[_TensorIn]]]]

class _CheckpointIn(Protocol):
    """A checkpoint to write (ortckpt._boundary.CoreState), read by attribute."""
    @property
    def trainable(self) -> Sequence[_TensorIn]: ...
    @property
    def frozen(self) -> Sequence[_TensorIn]: ...
    @property
    def groups(self) -> Sequence[_GroupIn]: ...
    @property
    def ints(self) -> Sequence[tuple[str, int]]: ...
    @property
    def floats(self) -> Sequence[tuple[str, float]]: ...
    @property
    def strings(self) -> Sequence[tuple[str, str]]: ...
    @property
    def nominal(self) -> bool: ...
    @property
    def keep_order(self) -> bool: ...

class _WriteOptionsIn(Protocol):
    """How to write the files (ortckpt._boundary.WriteOptions), read by attribute."""
    @property
    def durable(self) -> bool: ...
    @property
    def external_data_threshold(self) -> int: ...
    @property
    def progress(self) -> SaveProgress | None: ...
    @property
    def lock_timeout(self) -> float | None: ...
    @property
    def holes(self) -> Sequence[int]: ...

def load(path: str, *, follow_symlinks: bool = True, verify: bool = False) -> dict[str, Any]: ...
def verify_checksums(path: str, *, follow_symlinks: bool = True) -> tuple[int, int, int] | None: ...
def checksum_root(path: str, *, follow_symlinks: bool = True) -> tuple[int, int | None]: ...
def load_buffer(
    data: Any, *, external: Any | None = None, external_len: int = 0, external_tail: bytes | None = None
) -> dict[str, Any]: ...
def views(
    entries: list[tuple[str, int, tuple[int, ...], Any]],
    mappings: tuple[memoryview | None, memoryview | None],
    dtypes: list[tuple[Any, int] | None],
) -> list[Any]: ...
def encode_segments(
    checkpoint: _CheckpointIn, *, external_data_threshold: int = ...
) -> tuple[list[Any], tuple[int, list[tuple[int, Any]]] | None]: ...
def encode_sharing_segments(
    checkpoint: _CheckpointIn, pair_id: bytes, shared: Mapping[tuple[int, int], int]
) -> list[Any]: ...
def save(path: str, checkpoint: _CheckpointIn, options: _WriteOptionsIn) -> None: ...
def save_staged(
    path: str, checkpoint: _CheckpointIn, options: _WriteOptionsIn
) -> tuple[Staging, list[tuple[int, int, bool]]]: ...
def combine(
    operation: str,
    coefficients: Sequence[float],
    jobs: Sequence[tuple[int, Sequence[Any], Sequence[bool], Any]],
    progress: Callable[[int], object] | None = None,
) -> tuple[tuple[int, int, float] | None, list[int | None]]: ...
def tensor_stats(
    codes: Sequence[int],
    values: Sequence[Any],
    elements: Sequence[int | None],
    maps: Sequence[tuple[int, int]] = ...,
    progress: Callable[[int], object] | None = None,
) -> tuple[
    list[int], list[int], list[int], list[int], list[float], list[float], list[float], list[float], list[float]
]: ...
def tensor_changes(
    codes: Sequence[int],
    a: Sequence[Any],
    b: Sequence[Any],
    elements: Sequence[int | None],
    maps: Sequence[tuple[int, int]] = ...,
    progress: Callable[[int], object] | None = None,
) -> tuple[list[int], list[int], list[float], list[float], list[float], list[float]]: ...
def histogram(code: int, values: Any, elements: int | None, edges: Sequence[float]) -> list[int]: ...
def save_sharing(
    path: str,
    previous: str,
    checkpoint: _CheckpointIn,
    options: _WriteOptionsIn,
    *,
    compare_only: bool = False,
    watched: Watched | None = None,
) -> tuple[bool, int, int, int]: ...

@final
class Watched:
    """What watch_writes armed for one save (nothing where the kernel offers no watch)."""

def watch_writes(path: str, checkpoint: _CheckpointIn) -> Watched: ...
def record_watched(watched: Watched, path: str, checkpoint: _CheckpointIn) -> None: ...
def file_span(data: Any) -> tuple[int, int, int] | None: ...
def save_bytes(checkpoint: _CheckpointIn) -> bytes: ...

@final
class SignalOnDrop:
    """Simulates the arrival of ``signum`` when freed (see ortckpt.interrupts)."""
    def __new__(cls, signum: int) -> SignalOnDrop: ...
