"""Lossless deltas between two versions of a safetensors weights file (the manifest codec `xor-zstd`), and the
rebuilding of a delta checkpoint from the base version a receiver holds.

A payload is `MAGIC`, the length of the target file's header block, that header block as it is (the 8-byte length
and the JSON naming every tensor's dtype, shape and byte range), then one zstd frame of the target's data region
transformed tensor by tensor:

- a tensor the base file also has (same name, dtype and shape) is XORed with the base's bytes: at RL learning rates
  most weights keep every bit from one version to the next, so the XOR is mostly zero bytes;
- then its bytes are split into byte planes (every element's first byte, then every element's second byte, ...):
  where a value did change, its sign and exponent (the high byte) mostly did not, and the planes put those zero
  bytes together for the compressor (bench/deltas.py measures the gain).

The payload is trusted for nothing: `rebuild` checks the file it yields against the signed manifest (size, sha256,
and every tensor's name, dtype, shape and sha256), and a malformed payload is a ManifestError, never a crash.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import zstandard

from swarmrl.protocol.manifest import DeltaFile, DeltaSpec, ManifestError, TensorHash

MAGIC = b"SWRLDLT1"
CODEC = "xor-zstd"
DEFAULT_LEVEL = 3  # zstd level: see bench/RESULTS.md (deltas) for what the levels cost and give
_MAX_HEADER = 100 * 1024 * 1024  # safetensors' own limit on the JSON header
SPARSE_BELOW = 0.25  # share of changed elements under which positions + new bits beat byte planes (bench/deltas.py)
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4,
             "U16": 2, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


class DeltaError(ManifestError):
    """A payload or a weights file that cannot be read as what it claims to be."""


@dataclass(frozen=True)
class Tensor:
    """One tensor of a safetensors file: its byte range [begin, end) in the data region."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


def parse_header(header: bytes | memoryview, data_len: int) -> tuple[int, list[Tensor]]:
    """(length of the header block, tensors by data offset) of a safetensors file whose data region has
    `data_len` bytes; DeltaError if the header is malformed or names bytes outside the data region."""
    if len(header) < 8:
        raise DeltaError("no safetensors header")
    n = int.from_bytes(header[:8], "little")
    if n > _MAX_HEADER or 8 + n > len(header):
        raise DeltaError(f"safetensors header of {n} bytes does not fit")
    try:
        meta = json.loads(bytes(header[8:8 + n]))
        tensors = []
        for name, info in meta.items():
            if name == "__metadata__":
                continue
            begin, end = (int(x) for x in info["data_offsets"])
            shape = tuple(int(x) for x in info["shape"])
            dtype = str(info["dtype"])
            if not 0 <= begin <= end <= data_len:
                raise DeltaError(f"tensor {name!r} lies outside the data region")
            tensors.append(Tensor(name, dtype, shape, begin, end))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise DeltaError(f"malformed safetensors header: {e}") from None
    return 8 + n, sorted(tensors, key=lambda t: t.begin)


def read_tensors(data: bytes | bytearray) -> tuple[int, list[Tensor]]:
    """`parse_header` of a whole safetensors file."""
    if len(data) < 8:
        raise DeltaError("no safetensors header")
    n = int.from_bytes(data[:8], "little")
    return parse_header(data, len(data) - 8 - n)


def tensor_hashes(data: bytes | bytearray) -> list[TensorHash]:
    """What a delta manifest lists for a weights file: every tensor's name, dtype, shape and sha256."""
    start, tensors = read_tensors(data)
    view = memoryview(data)
    return [TensorHash(name=t.name, dtype=t.dtype, shape=list(t.shape),
                       sha256=hashlib.sha256(view[start + t.begin:start + t.end]).hexdigest()) for t in tensors]


def _varints(values: np.ndarray) -> bytes:
    """LEB128 of every value (unsigned), vectorised."""
    v = values.astype(np.uint64)
    nbytes = np.ones(len(v), dtype=np.int64)
    for k in range(1, 10):
        nbytes += v >= (np.uint64(1) << np.uint64(7 * k))
    starts = np.cumsum(nbytes) - nbytes
    out = np.empty(int(nbytes.sum()), dtype=np.uint8)
    for k in range(int(nbytes.max()) if len(v) else 0):
        m = nbytes > k
        low = ((v[m] >> np.uint64(7 * k)) & np.uint64(0x7F)).astype(np.uint8)
        out[starts[m] + k] = low | ((nbytes[m] > k + 1).astype(np.uint8) << 7)
    return out.tobytes()


def _from_varints(data: np.ndarray, count: int) -> np.ndarray:
    """The `count` values `_varints` wrote into `data`; DeltaError if it holds anything else."""
    ends = np.flatnonzero(data < 0x80)
    if len(ends) != count or (count and ends[-1] != len(data) - 1):
        raise DeltaError("malformed positions in the payload")
    starts = np.concatenate(([0], ends[:-1] + 1)) if count else ends
    lens = ends - starts + 1
    if count and lens.max() > 9:
        raise DeltaError("a position in the payload is too large")
    values = np.zeros(count, dtype=np.uint64)
    for k in range(int(lens.max()) if count else 0):
        m = lens > k
        values[m] |= (data[starts[m] + k] & 0x7F).astype(np.uint64) << np.uint64(7 * k)
    return values


def _planes(elements: np.ndarray, k: int) -> bytes:
    return elements.view(np.uint8).reshape(-1, k).T.tobytes()


def _elements(seg: np.ndarray, dtype: str) -> tuple[np.ndarray, int]:
    """A tensor's bytes as unsigned integers of its element size (bytes when that does not divide them)."""
    k = _ITEMSIZE.get(dtype, 1)
    if len(seg) % k:
        k = 1
    return np.ascontiguousarray(seg).view(_UINT[k]), k


def _encode_tensor(seg: np.ndarray, base: np.ndarray | None, dtype: str) -> bytes:
    x, k = _elements(seg, dtype)
    if base is not None:
        x = x ^ _elements(base, dtype)[0]
        changed = np.flatnonzero(x)
        if len(changed) <= SPARSE_BELOW * len(x):  # positions (gaps between them) and new bits
            gaps = _varints(np.diff(changed, prepend=-1) - 1)
            return b"\x01" + struct.pack("<QQ", len(changed), len(gaps)) + gaps + _planes(x[changed], k)
    return b"\x00" + _planes(x, k)


def _decode_tensor(raw: memoryview, p: int, out: np.ndarray, base: np.ndarray | None, dtype: str) -> int:
    """Write the tensor the section at `p` encodes into `out` (its bytes in the file); where the next section
    starts. A sparse section copies the base and flips only the changed elements' bits."""
    n = len(out)
    k = _ITEMSIZE.get(dtype, 1)
    if n % k:
        k = 1
    if p >= len(raw):
        raise DeltaError("the payload ends early")
    mode, p = raw[p], p + 1
    if mode == 0:
        if p + n > len(raw):
            raise DeltaError("the payload ends early")
        x = np.frombuffer(raw[p:p + n], dtype=np.uint8).reshape(k, -1).T.copy().view(_UINT[k]).ravel()
        if base is not None:
            np.bitwise_xor(x, _elements(base, dtype)[0], out=x)
        out[:] = x.view(np.uint8)
        return p + n
    if mode != 1 or base is None:
        raise DeltaError(f"unknown section mode {mode}")
    if p + 16 > len(raw):
        raise DeltaError("the payload ends early")
    count, glen = struct.unpack("<QQ", raw[p:p + 16])
    p += 16
    if count > n // k or p + glen + count * k > len(raw):
        raise DeltaError("a sparse section does not fit")
    positions = np.cumsum(_from_varints(np.frombuffer(raw[p:p + glen], dtype=np.uint8), count) + 1) - 1
    p += glen
    if count and positions.max() >= n // k:  # max, not last: a forged gap can wrap the sum around
        raise DeltaError("a changed position lies outside its tensor")
    vals = np.frombuffer(raw[p:p + count * k], dtype=np.uint8).reshape(k, -1).T.copy().view(_UINT[k]).ravel()
    if base is not out:  # in place (`base is out`), the unchanged elements are already there
        out[:] = base
    out.view(_UINT[k])[positions.astype(np.int64)] ^= vals
    return p + count * k


def _pairs(tensors: list[Tensor], base: bytes) -> list[tuple[Tensor, np.ndarray | None]]:
    """Each tensor with the base's bytes of the same tensor (same name, dtype and shape), or None."""
    b_start, b_tensors = read_tensors(base)
    base_of = {t.name: t for t in b_tensors}
    base_arr = np.frombuffer(base, dtype=np.uint8)
    out = []
    for t in tensors:
        b = base_of.get(t.name)
        same = b is not None and b.dtype == t.dtype and b.shape == t.shape and b.end - b.begin == t.end - t.begin
        out.append((t, base_arr[b_start + b.begin:b_start + b.end] if same and b is not None else None))
    return out


def _uncovered(tensors: list[Tensor], data_len: int) -> list[tuple[int, int]]:
    """Byte ranges of the data region no tensor covers (none in a file safetensors wrote), carried as they are."""
    out, pos = [], 0
    for t in tensors:
        if t.begin > pos:
            out.append((pos, t.begin))
        pos = max(pos, t.end)
    if pos < data_len:
        out.append((pos, data_len))
    return out


def encode(base: bytes, target: bytes, level: int = DEFAULT_LEVEL) -> bytes:
    """The payload that turns the safetensors file `base` into `target`, bit for bit."""
    start, tensors = read_tensors(target)
    data = np.frombuffer(target, dtype=np.uint8)[start:]
    parts = [_encode_tensor(data[t.begin:t.end], b, t.dtype) for t, b in _pairs(tensors, base)]
    parts += [data[a:b].tobytes() for a, b in _uncovered(tensors, len(data))]
    packed = zstandard.ZstdCompressor(level=level).compress(b"".join(parts))
    return MAGIC + struct.pack("<Q", start) + target[:start] + packed


def _open(payload: bytes, size: int) -> tuple[bytes, list[Tensor], memoryview]:
    """(the target's header block, its tensors, the decompressed sections) of a payload for a file of `size` bytes
    (the signed size: nothing in the payload decides how much is decompressed); DeltaError if malformed."""
    head = len(MAGIC) + 8
    if len(payload) < head or payload[:len(MAGIC)] != MAGIC:
        raise DeltaError("not a delta payload")
    (start,) = struct.unpack("<Q", payload[len(MAGIC):head])
    if start > size or head + start > len(payload):
        raise DeltaError("the payload's header block does not fit the file")
    header = payload[head:head + start]
    hb, tensors = parse_header(header, size - start)
    if hb != start:
        raise DeltaError("the payload's header block has the wrong length")
    try:  # sections add a few bytes per tensor to the data region at most
        raw = memoryview(zstandard.ZstdDecompressor().decompress(
            payload[head + start:], max_output_size=size - start + 32 * len(tensors) + 64))
    except zstandard.ZstdError as e:
        raise DeltaError(f"the payload does not decompress: {e}") from None
    return header, tensors, raw


def _decode(raw: memoryview, data: np.ndarray, tensors: list[Tensor],
            pairs: list[tuple[Tensor, np.ndarray | None]] | None) -> None:
    """Write every section of `raw` into `data` (the target's data region); `pairs` None: `data` holds the base,
    laid out as the target, and every tensor is its own base."""
    p = 0
    for t, b in pairs if pairs is not None else [(t, None) for t in tensors]:
        seg = data[t.begin:t.end]
        p = _decode_tensor(raw, p, seg, seg if pairs is None else b, t.dtype)
    for a, b_ in _uncovered(tensors, len(data)):
        if p + b_ - a > len(raw):
            raise DeltaError("the payload ends early")
        data[a:b_] = np.frombuffer(raw[p:p + b_ - a], dtype=np.uint8)
        p += b_ - a
    if p != len(raw):
        raise DeltaError("the payload has bytes left over")


def apply(base: bytes, payload: bytes, size: int) -> bytearray:
    """The file `payload` makes of `base`, which must be `size` bytes long (the signed size: nothing in the
    payload decides how much is decompressed). DeltaError if the payload is malformed. Not checked against any
    hash: that is `check`'s job."""
    header, tensors, raw = _open(payload, size)
    rebuilt = bytearray(size)  # written in place: no copy of the whole file at the end
    rebuilt[:len(header)] = header
    data = np.frombuffer(rebuilt, dtype=np.uint8)[len(header):]
    _decode(raw, data, tensors, _pairs(tensors, base))
    return rebuilt


def apply_in_place(path: Path, payload: bytes, size: int) -> mmap.mmap | None:
    """Turn the file at `path`, a copy of the base, into the file `payload` makes of it, by writing only what
    changed through a shared memory map, which is returned (for `check` to read without another pass over the
    disk); None (the file untouched) when the payload's target has another size or header block than the file,
    which `apply` handles. DeltaError if the payload is malformed (the file is then part written). Not checked
    against any hash: that is `check`'s job."""
    header, tensors, raw = _open(payload, size)
    if path.stat().st_size != size:
        return None
    with path.open("r+b") as f:  # the mapping outlives the descriptor
        if f.read(len(header)) != header:
            return None
        # Populated at once: one call maps every page, rather than a fault per page as the XOR first touches it.
        mapped = mmap.mmap(f.fileno(), size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
    # Same header, so every tensor lies where the base's did: each is its own base, XORed where it stands.
    _decode(raw, np.frombuffer(mapped, dtype=np.uint8)[len(header):], tensors, None)
    return mapped


def _copy(src: Path, dst: Path) -> None:
    """`src` copied to `dst` by the kernel (a reflink where the file system shares blocks): no pass through Python."""
    with src.open("rb") as fi, dst.open("wb") as fo:
        left = os.fstat(fi.fileno()).st_size
        try:
            while left > 0:
                n = os.copy_file_range(fi.fileno(), fo.fileno(), left)
                if n == 0:
                    break
                left -= n
        except OSError:
            left = -1
    if left != 0:  # copy_file_range unsupported here (or the file changed size): an ordinary copy
        shutil.copyfile(src, dst)


def check(data: bytes | bytearray, expected: DeltaFile) -> None:
    """ManifestError unless `data` is the file `expected` describes: its size, its header block, every tensor
    (name, dtype, shape, sha256, in order) and so, when the tensors tile the data region as safetensors writes them,
    the whole file bit for bit (otherwise its sha256 is checked too)."""
    if len(data) != expected.size:
        raise ManifestError(f"{expected.path}: rebuilt {len(data)} bytes, the manifest says {expected.size}")
    start, tensors = read_tensors(data)
    if hashlib.sha256(memoryview(data)[:start]).hexdigest() != expected.header_sha256:
        raise ManifestError(f"{expected.path}: the rebuilt header does not match its signed hash")
    got = tensor_hashes(data)
    if len(got) != len(expected.tensors):
        raise ManifestError(f"{expected.path}: rebuilt {len(got)} tensors, the manifest lists "
                            f"{len(expected.tensors)}")
    for have, want in zip(got, expected.tensors, strict=True):
        if have != want:
            raise ManifestError(f"{expected.path}: tensor {want.name!r} does not match its signed hash")
    overlap = any(a.end > b.begin for a, b in zip(tensors, tensors[1:], strict=False))
    tiled = not overlap and not _uncovered(tensors, len(data) - start)
    if not tiled and hashlib.sha256(data).hexdigest() != expected.sha256:
        raise ManifestError(f"{expected.path}: the rebuilt file does not match its signed hash")


def describe(path: str, payload_path: str, target: bytes) -> DeltaFile:
    """The manifest's entry for a weights file `path` sent as the payload file `payload_path`."""
    start, _ = read_tensors(target)
    return DeltaFile(path=path, size=len(target), sha256=hashlib.sha256(target).hexdigest(),
                     header_sha256=hashlib.sha256(target[:start]).hexdigest(), payload=payload_path,
                     tensors=tensor_hashes(target))


def rebuild(base_dir: Path, staged: Path, delta: DeltaSpec, out: Path) -> Path:
    """Turn `staged` (a delta checkpoint's files as listed, assembled and hash-checked) into the full checkpoint
    at `out`: every weights file rebuilt from `base_dir`'s file of the same path (in a copy of it, patched in place
    where the layout is the same; the base is never written), checked (`check`), put in place of its payload; then
    `staged` is moved to `out` at once. ManifestError (and `staged` removed) if the
    base lacks a file or anything does not match."""
    if delta.codec != CODEC:
        raise ManifestError(f"unknown delta codec {delta.codec!r}")
    try:
        for entry in delta.files:
            base_file = base_dir / entry.path
            if not base_file.is_file():
                raise ManifestError(f"the base version has no {entry.path}")
            payload = (staged / entry.payload).read_bytes()
            dest = staged / entry.path
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.unlink(missing_ok=True)
            _copy(base_file, dest)  # the base stays as it is: it may be loaded, and this one may be refused
            rebuilt = apply_in_place(dest, payload, entry.size)
            if rebuilt is not None:
                with rebuilt:
                    check(rebuilt, entry)
            else:  # another layout than the base's: rebuilt in memory
                data = apply(base_file.read_bytes(), payload, entry.size)
                check(data, entry)
                dest.write_bytes(data)
            (staged / entry.payload).unlink()
        if out.exists():  # rebuilt meanwhile by someone else: theirs stands
            shutil.rmtree(staged, ignore_errors=True)
        else:
            os.replace(staged, out)
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        raise
    return out
