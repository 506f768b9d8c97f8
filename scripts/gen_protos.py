"""Generate Python code for every contract under protos/ into the miles.proto package of libs/miles-common.

The .proto files live at protos/miles/<area>/v1/ and import each other as "miles/<area>/v1/x.proto" (their
protobuf packages are miles.<area>.v1). Generated Python must not land in miles.<area> — that namespace belongs
to the services (miles.common is our shared library, not the common protos) — so the files are staged under
miles/proto/<area>/v1/ with their imports rewritten before protoc runs. The wire names (packages, services,
methods) are unchanged by this. Output is gitignored and rebuilt by `make protos`; never edit it.
"""

from __future__ import annotations

import re
import shutil
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
PROTO_ROOT = REPO_ROOT / "protos"
OUT_ROOT = REPO_ROOT / "libs" / "miles-common" / "src"
GENERATED_PACKAGE = OUT_ROOT / "miles" / "proto"
_IMPORT_RE = re.compile(r'^import "miles/', re.MULTILINE)


def stage_protos(staging_root: Path) -> list[Path]:
    """Copy every .proto to staging_root/miles/proto/<area>/v1/ with imports rewritten; return staged paths."""
    staged: list[Path] = []
    for source in sorted(PROTO_ROOT.glob("miles/*/v*/*.proto")):
        relative = source.relative_to(PROTO_ROOT / "miles")
        target = staging_root / "miles" / "proto" / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(_IMPORT_RE.sub('import "miles/proto/', source.read_text()))
        staged.append(target)
    return staged


def generate() -> int:
    import grpc_tools
    from grpc_tools import protoc  # deferred: only needed at build time

    well_known_include = Path(grpc_tools.__file__).parent / "_proto"
    if GENERATED_PACKAGE.exists():
        shutil.rmtree(GENERATED_PACKAGE)
    with tempfile.TemporaryDirectory() as tmp:
        staging_root = Path(tmp)
        staged = stage_protos(staging_root)
        if not staged:
            print(f"no .proto files under {PROTO_ROOT}", file=sys.stderr)
            return 1
        args = [
            "grpc_tools.protoc",
            f"-I{staging_root}",
            f"-I{well_known_include}",
            f"--python_out={OUT_ROOT}",
            f"--pyi_out={OUT_ROOT}",
            f"--grpc_python_out={OUT_ROOT}",
            *[str(path.relative_to(staging_root)) for path in staged],
        ]
        status = protoc.main(args)
        if status != 0:
            print(f"protoc failed with status {status}", file=sys.stderr)
            return status
    (GENERATED_PACKAGE / "py.typed").write_text("")
    print(f"generated {len(staged)} proto files into {GENERATED_PACKAGE.relative_to(REPO_ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(generate())
