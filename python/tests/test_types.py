"""The package's types: ``py.typed`` ships (PEP 561), the native extension's stub
(``_native.pyi``) matches what the extension exports (mypy's stubtest: every name, every
parameter and default), and the package type-checks against it."""

import os
import subprocess
import sys

import sparsekit


def _mypy(args, cwd, **env):
    return subprocess.run([sys.executable, "-m", *args], cwd=cwd, capture_output=True, text=True,
                          env=dict(os.environ, **env), timeout=600)


def test_stub_matches_the_extension_and_the_package_type_checks(tmp_path):
    pkg = os.path.dirname(sparsekit.__file__)
    for f in ("py.typed", "_native.pyi"):
        assert os.path.isfile(os.path.join(pkg, f)), f"{f} is not installed with the package"
    # torch's own types are skipped for the stub's check (its signatures are what is
    # compared; analysing torch takes seconds), not for the package's.
    cfg = tmp_path / "stubtest.ini"
    cfg.write_text("[mypy]\n[mypy-torch.*]\nfollow_imports = skip\n")
    r = _mypy(["mypy.stubtest", "sparsekit._native", "--mypy-config-file", str(cfg)], tmp_path)
    assert r.returncode == 0, f"the stub differs from the extension:\n{r.stdout}{r.stderr}"
    r = _mypy(["mypy", "-p", "sparsekit", "--cache-dir", os.devnull], tmp_path,
              MYPYPATH=os.path.dirname(pkg))
    assert r.returncode == 0, f"the package does not type-check:\n{r.stdout}{r.stderr}"
    assert "Success" in r.stdout


def test_stubtest_catches_a_stub_that_drifted(tmp_path):
    """The check above can fail: a copy of the stub missing one parameter is reported."""
    pkg = os.path.dirname(sparsekit.__file__)
    stub = open(os.path.join(pkg, "_native.pyi")).read()
    drifted = stub.replace("    take_all_short_rows: bool = False,\n", "")
    assert drifted != stub
    copy = tmp_path / "site" / "sparsekit"
    copy.mkdir(parents=True)
    for f in os.listdir(pkg):
        src = os.path.join(pkg, f)
        if os.path.isfile(src):
            (copy / f).write_bytes(open(src, "rb").read())
    (copy / "_native.pyi").write_text(drifted)
    cfg = tmp_path / "stubtest.ini"
    cfg.write_text("[mypy]\n[mypy-torch.*]\nfollow_imports = skip\n")
    r = _mypy(["mypy.stubtest", "sparsekit._native", "--mypy-config-file", str(cfg)], tmp_path,
              PYTHONPATH=str(tmp_path / "site"))
    assert r.returncode != 0 and "take_all_short_rows" in r.stdout, r.stdout + r.stderr
