"""Generate the Python gRPC stubs from ``proto/speedpipe.proto``, or check that they are up to date.

This module is the one place that runs ``protoc``. It owns the include path and the output file
names; it must not edit generated code (if an import in a stub is wrong, the include path is wrong).

Decision: the stubs ``proto/speedpipe_pb2.py``, ``proto/speedpipe_pb2.pyi`` and
``proto/speedpipe_pb2_grpc.py`` are committed, so running speedpipe needs only ``grpcio`` and
``protobuf``. ``grpcio-tools`` is a test/dev dependency only. The test suite runs :func:`find_stale`
(``tests/unit/test_proto.py``) so a ``.proto`` edit without regenerating fails CI.

Usage, from the repository root::

    python -m proto.generate           # (re)write the committed stubs
    python -m proto.generate --check   # exit 1 if a committed stub differs from a fresh generation

``protoc`` runs with the repository root as its include path on ``proto/speedpipe.proto``, so the
generated ``speedpipe_pb2_grpc.py`` imports ``from proto import speedpipe_pb2`` and the stubs import
as ``from proto import speedpipe_pb2, speedpipe_pb2_grpc`` from the repository root.

Generated code records the ``grpcio-tools`` version that produced it, so the check is exact only
against the same ``grpcio-tools`` version; the failure message prints the version in use.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.resources
import shutil
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PROTO_FILE = "proto/speedpipe.proto"
GENERATED_FILES = (
    "proto/speedpipe_pb2.py",
    "proto/speedpipe_pb2.pyi",
    "proto/speedpipe_pb2_grpc.py",
)
REGENERATE_COMMAND = "python -m proto.generate"
_EXPECTED_PB2_IMPORT = "from proto import speedpipe_pb2"


def _protoc(*, include_root: Path, proto_file: str, out_args: list[str]) -> None:
    """Run ``grpc_tools.protoc`` on ``include_root/proto_file``.

    Raises:
        RuntimeError: grpcio-tools is missing or protoc reports an error (its message is on stderr).
    """
    try:
        from grpc_tools import protoc
    except ImportError as e:
        raise RuntimeError(
            "grpcio-tools is not installed; install the test extras: pip install -e '.[test]'"
        ) from e
    well_known_types = importlib.resources.files("grpc_tools") / "_proto"
    args = [
        "grpc_tools.protoc",
        f"--proto_path={include_root}",
        f"--proto_path={well_known_types}",
        *out_args,
        str(include_root / proto_file),
    ]
    returncode = protoc.main(args)
    if returncode != 0:
        raise RuntimeError(
            f"protoc failed with exit code {returncode} on {proto_file}; see its message above"
        )


def generate_into(out_root: Path) -> list[Path]:
    """Generate the stubs under ``out_root`` (as ``out_root/proto/speedpipe_pb2*.py[i]``).

    Returns:
        The generated file paths, in the order of :data:`GENERATED_FILES`.

    Raises:
        RuntimeError: protoc failed, or the grpc stub does not import its messages as ``from proto
            import speedpipe_pb2`` (the include path would then be wrong).
    """
    out_root.mkdir(parents=True, exist_ok=True)
    _protoc(
        include_root=REPO_ROOT,
        proto_file=PROTO_FILE,
        out_args=[f"--python_out={out_root}", f"--pyi_out={out_root}", f"--grpc_python_out={out_root}"],
    )
    paths = [out_root / name for name in GENERATED_FILES]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise RuntimeError(f"protoc did not write {missing}")
    grpc_stub = paths[GENERATED_FILES.index("proto/speedpipe_pb2_grpc.py")]
    if _EXPECTED_PB2_IMPORT not in grpc_stub.read_text():
        raise RuntimeError(
            f"{grpc_stub} does not contain {_EXPECTED_PB2_IMPORT!r}; check the protoc include path"
        )
    return paths


def compile_descriptor(*, include_root: Path = REPO_ROOT, proto_file: str = PROTO_FILE):
    """Parse ``include_root/proto_file`` with protoc, keeping comments, for checks on the schema.

    Returns:
        The file's ``google.protobuf.descriptor_pb2.FileDescriptorProto`` with ``source_code_info``
        (each declaration's leading comment) filled in.

    Raises:
        RuntimeError: protoc failed.
    """
    from google.protobuf import descriptor_pb2

    with tempfile.TemporaryDirectory(prefix="speedpipe-proto-") as tmp:
        out = Path(tmp) / "descriptor_set.binpb"
        _protoc(
            include_root=include_root,
            proto_file=proto_file,
            out_args=[f"--descriptor_set_out={out}", "--include_source_info"],
        )
        file_set = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())
    (file_proto,) = file_set.file
    return file_proto


def find_stale(committed_root: Path = REPO_ROOT) -> list[str]:
    """Compare the stubs under ``committed_root`` byte for byte with a fresh generation.

    Args:
        committed_root: folder holding ``proto/speedpipe_pb2*.py[i]``; the repository root by default,
            another folder in tests.

    Returns:
        The names (as in :data:`GENERATED_FILES`) of the stubs that are missing or differ; empty when
        all are up to date.
    """
    with tempfile.TemporaryDirectory(prefix="speedpipe-proto-") as tmp:
        fresh_paths = generate_into(Path(tmp))
        stale = []
        for name, fresh in zip(GENERATED_FILES, fresh_paths, strict=True):
            committed = committed_root / name
            if not committed.is_file() or committed.read_bytes() != fresh.read_bytes():
                stale.append(name)
    return stale


def write() -> list[Path]:
    """Regenerate the committed stubs in the repository.

    Generates into a temporary folder first, so a protoc error leaves the committed stubs untouched.

    Returns:
        The written paths.
    """
    with tempfile.TemporaryDirectory(prefix="speedpipe-proto-") as tmp:
        fresh_paths = generate_into(Path(tmp))
        written = []
        for name, fresh in zip(GENERATED_FILES, fresh_paths, strict=True):
            target = REPO_ROOT / name
            shutil.copyfile(fresh, target)
            written.append(target)
    return written


def stale_message(stale: list[str]) -> str:
    """Explain which stubs are stale and how to regenerate them."""
    try:
        tools_version = importlib.metadata.version("grpcio-tools")
    except importlib.metadata.PackageNotFoundError:
        tools_version = "not installed"
    return (
        f"stale generated stubs: {', '.join(stale)} differ from what {PROTO_FILE} generates "
        f"(grpcio-tools {tools_version}).\n"
        f"Regenerate from the repository root with: {REGENERATE_COMMAND}"
    )


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the process exit code."""
    parser = argparse.ArgumentParser(prog="python -m proto.generate", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--check",
        action="store_true",
        help="do not write; exit 1 if a committed stub differs from a fresh generation",
    )
    args = parser.parse_args(argv)
    if args.check:
        stale = find_stale()
        if stale:
            print(stale_message(stale), file=sys.stderr)
            return 1
        print(f"generated stubs are up to date with {PROTO_FILE}")
        return 0
    for path in write():
        print(f"wrote {path.relative_to(REPO_ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
